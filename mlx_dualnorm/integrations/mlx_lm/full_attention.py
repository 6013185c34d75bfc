"""Full-attention layers: the q/k norm + RoPE as one call.

``qwen3``, ``qwen3_moe`` and ``qwen3_next``'s attention: their q/k prework
is ``rms_norm`` by ``q_norm`` / ``k_norm``, a transpose to ``(B, H, L, D)``
and ``nn.RoPE`` at ``cache.offset``, six graph nodes per layer. ``patch()`` also replaces those attention classes'
``__call__`` with one written here that runs the same projections, cache
update and attention, and makes the prework ONE call of
:class:`~mlx_dualnorm.CompiledDualHeadNormRope` with the layer's own
weights, epsilon and RoPE constants: the same primitives in the same order,
so the bits are the same. The scaled RoPEs of ``rope_utils`` that rotate
with a frequency table (``Llama3RoPE``, ``YarnRoPE``, ``SuScaledRoPE``,
``ProportionalRoPE``) are covered too: the table is an input of each call,
their input scale a constant. A layer whose RoPE is none of these (such as
``DynamicNTKScalingRoPE``, whose base depends on the position), whose norms
are not exactly ``nn.RMSNorm`` with one epsilon, or whose call raises in the
prework, runs the class's own ``__call__``. On MLX's CUDA backend the
prework is one kernel launch (the fused mode), as the gated-delta norm is.

Every covered attention class is one :class:`AttentionFamily` in the
registry here (:func:`register_attention_families`): the qwen3 shapes are
registered by this module, other shapes by a module of their own. The
per-layer decision below works the same for all of them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
import threading
import weakref
from typing import Callable, Iterator, NamedTuple, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dualnorm._composite import Mode
from mlx_dualnorm.dual_head_norm_rope import CompiledDualHeadNormRope
from mlx_dualnorm.integrations.mlx_lm._shared import (
    PLAIN_SCALAR_TYPES,
    REPLACEMENT_MARKER,
    cached_or_built,
    log_fallback_once,
)


@dataclasses.dataclass(frozen=True)
class AttentionFamily:
    """One attention class the patch covers.

    ``call`` becomes the ``__call__`` of the layers that engage; it may
    call ``type(self).mlx_dualnorm_original_call`` (the class's own
    ``__call__``) where a call cannot take the package's path. ``engages``
    decides once per layer, at its first call, whether the layer's norms
    and RoPE are exactly what ``call`` computes; a layer it refuses runs the
    class's own ``__call__``, and ``refusal`` says why in the debug log."""

    module: str  # the mlx-lm module; one that does not import is skipped
    class_name: str
    call: Callable
    engages: Callable[[object], bool]
    refusal: str = "its norms or RoPE are not plain nn.RMSNorm / nn.RoPE"

    def attention_class(self) -> Optional[type]:
        """The class in the installed mlx-lm, or None where it has none."""
        try:
            module = importlib.import_module(self.module)
        except ImportError:
            return None
        attention_class = getattr(module, self.class_name, None)
        return attention_class if isinstance(attention_class, type) else None


# Every family, in registration order; a class registered twice keeps its
# first family.
_attention_families: list = []


def register_attention_families(*families: AttentionFamily) -> None:
    """Adds ``families`` to what :func:`patch` covers (from its next
    install on). Each ``call`` is marked as a replacement."""
    for family in families:
        setattr(family.call, REPLACEMENT_MARKER, True)
        if family not in _attention_families:
            _attention_families.append(family)


def attention_families() -> tuple:
    """Every registered :class:`AttentionFamily`, in registration order."""
    return tuple(_attention_families)

# class -> its own __call__, recorded the first time it is patched.
_original_attention_calls: dict = {}
# Classes that inherit __call__ from mlx-lm: unpatching deletes ours.
_inheriting_classes: set = set()
_norm_ropes: dict = {}
_norm_ropes_lock = threading.Lock()
_full_attention_mode: Optional[Mode] = None


# mlx.nn.Module is a dict of its submodules and arrays: reading them as
# items skips Module.__getattr__, Python code that costs about 0.5 µs a
# lookup on a 2-core CPU, several per layer and decode token.
_module_item = dict.get


def _norm_rope_for(rope, query_norm, key_norm):
    """The cached CompiledDualHeadNormRope for a layer's constants, or None
    where the layer's norms or RoPE are not exactly what it computes. For
    the scaled RoPEs of ``rope_utils`` (:data:`SCALED_ROPE_CLASSES`), the
    object bound to the layer's frequency table, read at this call: a
    callable taking the same arguments.

    Runs for every layer of every decode step, so a known layer costs one
    dict lookup: the key holds everything the result depends on, read
    afresh each call (a module swapped or a constant changed in place gets
    a new key), with the types that change what MLX makes of a value (an
    int 1 is not the bool ``traditional``). A frequency table is no part
    of the key: it is an input of each call, so a replaced table is used
    as it is, never a stale copy."""
    rope_type = type(rope)
    if rope_type is not nn.RoPE and rope_type in SCALED_ROPE_CLASSES:  # nn.RoPE: one test
        return _scaled_norm_rope_for(rope, query_norm, key_norm)
    key = (
        _full_attention_mode, type(rope), type(query_norm), type(key_norm),
        query_norm.eps, key_norm.eps, rope.dims, type(rope.dims),
        rope.traditional, type(rope.traditional), rope.base, rope.scale,
    )
    norm_rope = _norm_ropes.get(key)
    if norm_rope is not None or not _is_plain_norm_rope(rope, query_norm, key_norm):
        return norm_rope
    mode = _full_attention_mode
    return cached_or_built(
        _norm_ropes, _norm_ropes_lock, key,
        lambda: CompiledDualHeadNormRope(
            query_norm.eps, rope.dims, base=rope.base, traditional=rope.traditional,
            scale=rope.scale, **({} if mode is None else {"mode": mode}),
        ),
        None,
    )


def _is_plain_norm_rope(rope, query_norm, key_norm) -> bool:
    """Whether the layer computes what CompiledDualHeadNormRope does: plain
    nn.RMSNorm on both sides with one plain eps, then plain nn.RoPE with
    plain constants, or one of the scaled RoPEs of :data:`SCALED_ROPE_CLASSES`
    (exact types) with plain constants and an ``mx.array`` table."""
    if not (type(query_norm) is type(key_norm) is nn.RMSNorm):
        return False
    eps = query_norm.eps
    if type(eps) not in PLAIN_SCALAR_TYPES or type(key_norm.eps) is not type(eps):
        return False
    if key_norm.eps != eps:
        return False
    if type(rope) in SCALED_ROPE_CLASSES:
        constants = _scaled_rope_constants(rope)
        return constants is not None and type(_rope_table(rope)) is mx.array
    if type(rope) is not nn.RoPE or type(rope.dims) is not int:
        return False
    if type(rope.traditional) is not bool:
        return False
    return type(rope.base) in PLAIN_SCALAR_TYPES and type(rope.scale) in PLAIN_SCALAR_TYPES


def _scaled_rope_classes() -> tuple:
    """rope_utils' RoPE classes whose call is ``mx.fast.rope(x', dims,
    traditional=, base=None, scale=1.0, offset=, freqs=self._freqs)`` with
    ``x'`` the input, or the input with its first ``dims`` features
    multiplied by a Python float: Llama3RoPE, YarnRoPE (``mscale``, when not
    1), SuScaledRoPE (``_scale``, always), ProportionalRoPE. Empty without
    mlx-lm (or with one whose rope_utils lacks a class: those present)."""
    try:
        rope_utils = importlib.import_module("mlx_lm.models.rope_utils")
    except ImportError:
        return ()
    names = ("Llama3RoPE", "YarnRoPE", "SuScaledRoPE", "ProportionalRoPE")
    return tuple(getattr(rope_utils, name) for name in names if hasattr(rope_utils, name))


SCALED_ROPE_CLASSES = _scaled_rope_classes()


def _rope_table(rope):
    """The module's frequency table, read as an item (see _module_item)."""
    table = _module_item(rope, "_freqs")
    return table if table is not None else getattr(rope, "_freqs", None)


def _scaled_rope_constants(rope):
    """(dims, traditional, input_scale) as the class's __call__ uses them
    (input_scale None where it multiplies nothing), or None where one is not
    a plain value: dims an int, traditional a bool, a scale a float."""
    name = type(rope).__name__
    try:
        if name == "SuScaledRoPE":
            dims, traditional, input_scale = rope.dim, False, rope._scale
        else:
            dims, traditional, input_scale = rope.dims, rope.traditional, None
            if name == "YarnRoPE":
                input_scale = rope.mscale
                if type(input_scale) is not float:
                    return None
                if input_scale == 1.0:  # YarnRoPE skips the multiply then
                    input_scale = None
    except AttributeError:  # a module missing what its class sets
        return None
    if type(dims) is not int or type(traditional) is not bool:
        return None
    if input_scale is not None and type(input_scale) is not float:
        return None
    return dims, traditional, input_scale


def _scaled_norm_rope_for(rope, query_norm, key_norm):
    """_norm_rope_for for a scaled RoPE: the cached object for the
    constants, bound to the table read now."""
    constants = _scaled_rope_constants(rope)
    key = (
        _full_attention_mode, type(rope), type(query_norm), type(key_norm),
        query_norm.eps, key_norm.eps, constants,
    )
    norm_rope = _norm_ropes.get(key)
    if norm_rope is None:
        if not _is_plain_norm_rope(rope, query_norm, key_norm):
            return None
        dims, traditional, input_scale = constants
        mode = _full_attention_mode
        norm_rope = cached_or_built(
            _norm_ropes, _norm_ropes_lock, key,
            lambda: CompiledDualHeadNormRope(
                query_norm.eps, dims, base=None, traditional=traditional,
                input_scale=input_scale, **({} if mode is None else {"mode": mode}),
            ),
            None,
        )
        if norm_rope is None:
            return None
    return functools.partial(norm_rope, freqs=_rope_table(rope))


class LayerPrework(NamedTuple):
    """What a layer's q/k prework is made of, read at each call: its RoPE
    module, its two norms as ``nn.RMSNorm`` modules (or stand-ins of the
    same eps for norm classes that compute ``rms_norm`` with another
    weight: only their type and eps are read) and the weights those norms
    pass to ``rms_norm`` (None for none)."""

    rope: object
    query_norm: object
    key_norm: object
    query_weight: Optional[mx.array]
    key_weight: Optional[mx.array]


def _layer_prework(attention) -> LayerPrework:
    """The prework of a qwen3-shaped layer (``rope``, ``q_norm``,
    ``k_norm``), read as items where the module keeps them so."""
    item = _module_item
    rope, query_norm = item(attention, "rope"), item(attention, "q_norm")
    key_norm = item(attention, "k_norm")
    if rope is None or query_norm is None or key_norm is None:  # not kept as items
        rope, query_norm, key_norm = attention.rope, attention.q_norm, attention.k_norm
    query_weight, key_weight = item(query_norm, "weight"), item(key_norm, "weight")
    if query_weight is None or key_weight is None:
        query_weight, key_weight = query_norm.weight, key_norm.weight
    return LayerPrework(rope, query_norm, key_norm, query_weight, key_weight)


def _rotated_queries_and_keys(norm_rope, prework: LayerPrework, queries, keys, cache):
    """(B, H, L, D) queries and keys, normalized and rotated in one call, or
    None (the caller then runs the class's own __call__)."""
    try:
        return rotated_at_cache_offset(
            norm_rope, queries, keys, prework.query_weight, prework.key_weight, cache
        )
    except Exception as error:  # anything unexpected runs mlx-lm's own code instead
        log_fallback_once("the full-attention norm + RoPE", error)
        return None


def rotated_at_cache_offset(norm_rope, queries, keys, query_weight, key_weight, cache):
    """``norm_rope``'s call at the cache's offset, as mlx-lm's layers rotate
    (position 0 without a cache)."""
    return norm_rope(
        queries, keys, query_weight, key_weight, offset=0 if cache is None else cache.offset
    )


# The cache classes whose decode-step update the one call performs, by
# mlx-lm's name, and the kind of bookkeeping each keeps.
_PLAIN, _BATCHED = "plain", "batched"
_ROTATING, _BATCHED_ROTATING = "rotating", "batched rotating"
_WRITTEN_CACHE_KINDS = {
    "KVCache": _PLAIN, "BatchKVCache": _BATCHED, "RotatingKVCache": _ROTATING,
    "BatchRotatingKVCache": _BATCHED_ROTATING,
}

# Those classes as mlx-lm has them, each mapped to its kind, looked up once
# (None: not yet looked up; empty where mlx-lm has none of them).
_written_cache_kinds: Optional[dict] = None


def _cache_kinds() -> dict:
    global _written_cache_kinds
    if _written_cache_kinds is None:
        # Imported here: _release_check imports this module.
        from mlx_dualnorm.integrations.mlx_lm import _release_check

        try:
            from mlx_lm.models import cache as cache_module
        except ImportError:
            _written_cache_kinds = {}
        else:
            # Only a class whose code is, on any mlx-lm release, the code
            # recorded from the tested one (its fingerprint): the call below
            # performs its update and bookkeeping itself, line for line.
            _written_cache_kinds = {
                getattr(cache_module, name): kind
                for name, kind in _WRITTEN_CACHE_KINDS.items()
                if hasattr(cache_module, name)
                and _release_check.is_proven(getattr(cache_module, name))
            }
    return _written_cache_kinds


class _CacheStep(NamedTuple):
    """Where a step's rows go in a cache's buffers (axis 2) and what the
    class's update returns once they are written: the whole buffers, or
    rows ``[0, row + L)``."""

    row: int
    returns_whole_buffers: bool


def _cache_step(kind: str, cache, length: int) -> Optional[_CacheStep]:
    """The step the class's ``update_and_fetch`` would take for ``length``
    new rows, where it writes them into its buffers as they are; None where
    it would grow, trim, concatenate or reorder them (the class then runs
    its own update)."""
    buffer = cache.keys
    if buffer is None:
        return None
    capacity = buffer.shape[2]
    if kind in (_ROTATING, _BATCHED_ROTATING):
        # RotatingKVCache._update_in_place (one row) without growing or
        # trimming: the row goes at _idx, at `keep` once _idx reaches
        # max_size; keys_and_values then gives rows [0, rows written) while
        # the buffer is not yet full (no rotation has happened), else all.
        # BatchRotatingKVCache's is the same with `keep` 0 and its written
        # rows in `_offset` (`offset` holds each sequence's position), once
        # finalize() has run (`_lengths` None; else the class raises).
        batched = kind == _BATCHED_ROTATING
        if batched and cache._lengths is not None:
            return None
        written = cache._offset if batched else cache.offset
        grows = written >= capacity and capacity < cache.max_size
        if length != 1 or grows or capacity > cache.max_size:
            return None
        keep = 0 if batched else cache.keep
        row = keep if cache._idx == cache.max_size else cache._idx
        end = written + length
        if row < 0 or row + length > capacity or (end < capacity and row + length != end):
            return None
        return _CacheStep(row, returns_whole_buffers=end >= capacity)
    row = cache._idx if kind == _BATCHED else cache.offset
    if row < 0 or row + length > capacity:
        return None
    # KVCache.keys_and_values: the whole buffer once the rows reach its end.
    return _CacheStep(row, returns_whole_buffers=kind == _PLAIN and row + length >= capacity)


def _advance(kind: str, cache, step: _CacheStep, length: int) -> None:
    """The class's bookkeeping after its update wrote ``step``'s rows (the
    buffers already replaced by the written ones)."""
    end = step.row + length
    if kind == _PLAIN:
        cache.offset = end
        return
    if kind == _BATCHED_ROTATING:
        if cache._idx == cache.max_size:
            cache.rotated = True
        if cache.rotated:
            cache.left_padding -= length
        cache._offset += length
    cache.offset = cache.offset + length  # per-sequence offsets in the batched classes
    cache._idx = end
    if kind == _BATCHED_ROTATING:
        # As the class does: its padding and offsets evaluated with its keys.
        cache.keys = mx.depends(cache.keys, (cache.left_padding, cache.offset))


def _written_in_one_call(norm_rope, prework: LayerPrework, queries, keys, values, cache):
    """What ``update_and_fetch`` of a ``KVCache``, ``BatchKVCache``,
    ``RotatingKVCache`` or ``BatchRotatingKVCache`` (exact types) returns,
    with the norm + RoPE and both buffer writes in ONE call
    (:meth:`CompiledDualHeadNormRope.apply_with_cache`), the cache left as
    the class leaves it: ``(rotated queries, keys, values)``. None where the
    call does not apply (another cache, a step that grows, trims or
    reorders the buffers); the caller then takes the two-step path, whose
    ``update_and_fetch`` does that as the class does."""
    kind = _cache_kinds().get(type(cache))
    if kind is None:
        return None
    length = keys.shape[1]
    step = _cache_step(kind, cache, length)
    if step is None:
        return None
    try:
        table = {}
        if type(norm_rope) is functools.partial:  # a scaled RoPE: the object and its table
            norm_rope, table = norm_rope.func, norm_rope.keywords
        rotated_queries, written_keys, written_values, fetched_keys, fetched_values = (
            norm_rope.apply_with_cache(
                queries, keys, values, prework.query_weight, prework.key_weight,
                key_cache=cache.keys, value_cache=cache.values, offset=cache.offset,
                write_offset=step.row, fetch=True, **table,
            )
        )
    except Exception as error:  # the cache is untouched: the two-step path runs instead
        log_fallback_once("the full-attention norm + RoPE with the cache write", error)
        return None
    # The class's own bookkeeping. Replacing the buffers drops the cache's
    # references to the old ones, so MLX writes into their memory.
    cache.keys, cache.values = written_keys, written_values
    _advance(kind, cache, step, length)
    if step.returns_whole_buffers:
        return rotated_queries, cache.keys, cache.values
    # Rows [0, row + L) of both buffers, as the class slices them (made by
    # the same call: no indexing left to do here).
    return rotated_queries, fetched_keys, fetched_values


def prework_and_cache_update(prework: LayerPrework, queries, keys, values, cache):
    """The q/k prework and the cache update of a full-attention layer, for
    queries ``(B, L, Hq, D)``, keys ``(B, L, Hk, D)`` and values
    ``(B, L, Hk, Dv)`` as the projections give them: ``(queries, keys,
    values)`` ready for attention, ``(B, H, L', D)``, or None where the
    layer's norms or RoPE are not what the package computes (the caller
    then runs the class's own __call__). One call of the package for a
    step of one of the caches :func:`_written_in_one_call` writes within
    its buffers; otherwise the norm + RoPE call, then
    ``cache.update_and_fetch``. For any family whose attention is
    ``rms_norm`` + RoPE of q and k before the cache: the norms of ``(B, L,
    H, D)`` heads and of their ``(B, H, L, D)`` transposes are the same
    rows, normalized alike."""
    try:
        norm_rope = _norm_rope_for(prework.rope, prework.query_norm, prework.key_norm)
    except Exception as error:  # anything unexpected runs mlx-lm's own code instead
        log_fallback_once("the full-attention norm + RoPE", error)
        return None
    if norm_rope is None:
        return None
    written = _written_in_one_call(norm_rope, prework, queries, keys, values, cache)
    if written is not None:
        return written
    rotated = _rotated_queries_and_keys(norm_rope, prework, queries, keys, cache)
    if rotated is None:
        return None
    rotated_queries, rotated_keys = rotated
    return with_cache_update(rotated_queries, rotated_keys, values, cache)


def with_cache_update(rotated_queries, rotated_keys, values, cache):
    """``(queries, keys, values)`` ready for attention from rotated ``(B, H,
    L, D)`` queries and keys and ``(B, L, H, D)`` values: the values
    transposed, and keys and values through the cache's own
    ``update_and_fetch`` where there is a cache."""
    values = values.transpose(0, 2, 1, 3)
    if cache is not None:
        rotated_keys, values = cache.update_and_fetch(rotated_keys, values)
    return rotated_queries, rotated_keys, values


def _prework_and_cache_update(attention, queries, keys, values, cache):
    """:func:`prework_and_cache_update` of a qwen3-shaped layer."""
    try:
        prework = _layer_prework(attention)
    except Exception as error:  # anything unexpected runs mlx-lm's own code instead
        log_fallback_once("the full-attention norm + RoPE", error)
        return None
    return prework_and_cache_update(prework, queries, keys, values, cache)


def _attention_output(attention, queries, keys, values, cache, mask, batch, length):
    """The cache update and attention of mlx-lm's layers, as (B, L, H*D)."""
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    return _attended(attention, queries, keys, values, cache, mask, batch, length)


def _attended(attention, queries, keys, values, cache, mask, batch, length):
    """Attention over keys and values already fetched, as (B, L, H*D)."""
    # The model module's own name, looked up at each call as its code does.
    attend = sys.modules[type(attention).__module__].scaled_dot_product_attention
    attended = attend(queries, keys, values, cache=cache, scale=attention.scale, mask=mask)
    return attended.transpose(0, 2, 1, 3).reshape(batch, length, -1)


def _attention_after_queries(attention, x, mask, cache, head_queries, key_value_heads):
    """The rest of a layer's attention once its queries are projected: the
    key and value projections, the q/k prework with the cache update, and
    attention, as (B, L, H*D); None where the call must take the layer's
    original code (_prework_and_cache_update says when)."""
    batch, length, _ = x.shape
    head_keys = attention.k_proj(x).reshape(batch, length, key_value_heads, -1)
    head_values = attention.v_proj(x).reshape(batch, length, key_value_heads, -1)
    attended = _prework_and_cache_update(attention, head_queries, head_keys, head_values, cache)
    if attended is None:
        return None
    return _attended(attention, *attended, cache, mask, batch, length)


def _qwen3_attention_call(self, x, mask=None, cache=None):
    """Qwen3 / Qwen3-MoE attention with the q/k prework in one call."""
    batch, length, _ = x.shape
    head_queries = self.q_proj(x).reshape(batch, length, self.n_heads, -1)
    output = _attention_after_queries(self, x, mask, cache, head_queries, self.n_kv_heads)
    if output is None:
        return type(self).mlx_dualnorm_original_call(self, x, mask, cache)
    return self.o_proj(output)


def _qwen3_next_attention_call(self, x, mask=None, cache=None):
    """Qwen3-Next's gated full attention with the q/k prework in one call."""
    batch, length, _ = x.shape
    projected = self.q_proj(x).reshape(batch, length, self.num_attention_heads, -1)
    head_queries, gate = mx.split(projected, 2, axis=-1)
    output = _attention_after_queries(
        self, x, mask, cache, head_queries, self.num_key_value_heads
    )
    if output is None:
        return type(self).mlx_dualnorm_original_call(self, x, mask, cache)
    return self.o_proj(output * mx.sigmoid(gate.reshape(batch, length, -1)))


def _layer_engages(attention) -> bool:
    """Whether the layer's norms and RoPE are what the package computes."""
    try:
        rope, query_norm, key_norm = attention.rope, attention.q_norm, attention.k_norm
    except AttributeError:
        return False
    return _is_plain_norm_rope(rope, query_norm, key_norm)


register_attention_families(
    AttentionFamily("mlx_lm.models.qwen3", "Attention", _qwen3_attention_call, _layer_engages),
    AttentionFamily(
        "mlx_lm.models.qwen3_moe", "Attention", _qwen3_attention_call, _layer_engages
    ),
    AttentionFamily(
        "mlx_lm.models.qwen3_next", "Qwen3NextAttention", _qwen3_next_attention_call,
        _layer_engages,
    ),
)


def _attention_classes() -> Iterator[tuple]:
    """(class, family) for every registered family the installed mlx-lm
    has, each class once."""
    seen: set = set()
    for family in attention_families():
        attention_class = family.attention_class()
        if attention_class is None or attention_class in seen:
            continue
        seen.add(attention_class)
        yield attention_class, family


# ---- One decision per layer ------------------------------------------------------
#
# The patch decides once per attention layer, at its first call, whether it
# engages, and then moves the layer to a subclass whose __call__ is the
# outcome: the replacement for a layer it engages, the class's own
# __call__ for a layer it leaves alone (another RoPE class, other norms). A layer
# left alone then runs exactly mlx-lm's code, with no check of ours per
# call. The subclasses keep the class's name and module (the layers' code
# looks names up in its module), and unpatching moves every layer back.

# (attention class, engaged) -> the subclass layers of that outcome get.
_decided_classes: dict = {}
# id(layer) -> a weak reference to it (modules are dicts, so unhashable).
# No weakref callbacks: one could run inside the lock (a garbage collection
# while a layer is registered) and wait on it. Dead entries are pruned
# instead whenever the table has doubled since the last pruning.
_decided_layers: dict = {}
_decided_layers_lock = threading.Lock()
_decided_layers_pruned_size = 64


def _decided_class(attention_class, replacement, engaged: bool):
    key = (attention_class, engaged)
    decided = _decided_classes.get(key)
    if decided is None:
        original = _original_attention_calls[attention_class]
        decided = type(
            attention_class.__name__,
            (attention_class,),
            {
                "__module__": attention_class.__module__,
                "__qualname__": attention_class.__qualname__,
                "__call__": replacement if engaged else original,
                "mlx_dualnorm_original_call": original,
                "mlx_dualnorm_engaged": engaged,
            },
        )
        _decided_classes[key] = decided
    return decided


def _deciding_call(attention_class, family: AttentionFamily):
    """The patched class's __call__: decides for the layer, moves it to its
    subclass, then runs the outcome with the call's own arguments."""

    def first_call(self, *args, **kwargs):
        if type(self) is not attention_class:  # a subclass of mlx-lm's: leave it alone
            return _original_attention_calls[attention_class](self, *args, **kwargs)
        engaged = _family_engages(family, self)
        if not engaged:
            log_fallback_once(
                f"{attention_class.__module__}.{attention_class.__qualname__}", family.refusal
            )
        decided = _decided_class(attention_class, family.call, engaged)
        reference = weakref.ref(self)
        object.__setattr__(self, "__class__", decided)
        with _decided_layers_lock:
            _decided_layers[id(self)] = reference
            _prune_decided_layers()
        return decided.__call__(self, *args, **kwargs)

    setattr(first_call, REPLACEMENT_MARKER, True)
    setattr(first_call, "__wrapped__", _original_attention_calls[attention_class])
    return first_call


def _family_engages(family: AttentionFamily, attention) -> bool:
    """``family.engages(attention)``; a predicate that raises leaves the
    layer to mlx-lm's code."""
    try:
        return family.engages(attention) is True
    except Exception as error:  # anything unexpected runs mlx-lm's own code instead
        log_fallback_once(f"{family.module}.{family.class_name}", error)
        return False


def _prune_decided_layers() -> None:
    """Drops the entries of collected layers once the table has doubled;
    the caller holds _decided_layers_lock."""
    global _decided_layers_pruned_size
    if len(_decided_layers) < 2 * _decided_layers_pruned_size:
        return
    for layer_id, reference in list(_decided_layers.items()):
        if reference() is None:
            del _decided_layers[layer_id]
    _decided_layers_pruned_size = max(64, len(_decided_layers))


def _install_full_attention_calls(mode: Optional[Mode]) -> None:
    global _full_attention_mode
    _full_attention_mode = mode
    for attention_class, family in _attention_classes():
        current = attention_class.__dict__.get("__call__")
        if current is None:  # inherited: restoring deletes ours again
            _inheriting_classes.add(attention_class)
            _original_attention_calls[attention_class] = _own_call(attention_class)
        elif getattr(current, REPLACEMENT_MARKER, False) is not True:
            _original_attention_calls[attention_class] = current
        attention_class.__call__ = _deciding_call(attention_class, family)


def _own_call(attention_class):
    """The __call__ mlx-lm gives ``attention_class``: the nearest class of
    its MRO that defines one, with a patched base's recorded original in
    place of our replacement."""
    for base in attention_class.__mro__[1:]:
        call = base.__dict__.get("__call__")
        if call is None:
            continue
        if getattr(call, REPLACEMENT_MARKER, False) is True:
            return _original_attention_calls[base]
        return call
    raise TypeError(f"{attention_class.__qualname__} has no __call__")


def clear_norm_ropes() -> None:
    """Drops every cached norm + RoPE object."""
    with _norm_ropes_lock:
        _norm_ropes.clear()


def _restore_full_attention_calls() -> None:
    for attention_class, original in _original_attention_calls.items():
        if attention_class not in _inheriting_classes:
            attention_class.__call__ = original
        elif "__call__" in attention_class.__dict__:
            del attention_class.__call__
    with _decided_layers_lock:
        references = list(_decided_layers.values())
        _decided_layers.clear()
    for reference in references:
        layer = reference()
        if layer is not None:
            object.__setattr__(layer, "__class__", type(layer).__mro__[1])
