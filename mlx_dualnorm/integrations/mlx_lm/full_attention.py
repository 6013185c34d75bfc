"""Full-attention layers: the q/k norm + RoPE as one call.

``qwen3``, ``qwen3_moe`` and ``qwen3_next``'s attention: their q/k prework is ``rms_norm`` by ``q_norm`` / ``k_norm``, a
transpose to ``(B, H, L, D)`` and ``nn.RoPE`` at ``cache.offset``, six
graph nodes per layer. ``patch()`` also replaces those attention classes'
``__call__`` with one written here that runs the same projections, cache
update and attention, and makes the prework ONE call of
:class:`~mlx_dualnorm.CompiledDualHeadNormRope` with the layer's own
weights, epsilon and RoPE constants: the same primitives in the same order,
so the bits are the same. A layer whose RoPE is not exactly ``nn.RoPE``
(the scaled-RoPE classes of ``rope_utils``, frequency tables), whose norms
are not exactly ``nn.RMSNorm`` with one epsilon, or whose call raises in the
prework, runs the class's own ``__call__``. On MLX's CUDA backend the
prework is one kernel launch (the fused mode), as the gated-delta norm is.
"""

from __future__ import annotations

import importlib
import sys
import threading
import weakref
from typing import Optional

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

# (module, attention class, how its __call__ is replaced). Modules that do
# not import (an older mlx-lm) are skipped.
FULL_ATTENTION_CLASSES = (
    ("mlx_lm.models.qwen3", "Attention", "qwen3"),
    ("mlx_lm.models.qwen3_moe", "Attention", "qwen3"),
    ("mlx_lm.models.qwen3_next", "Qwen3NextAttention", "qwen3_next"),
)

# class -> its own __call__, recorded the first time it is patched.
_original_attention_calls: dict = {}
_norm_ropes: dict = {}
_norm_ropes_lock = threading.Lock()
_full_attention_mode: Optional[Mode] = None


# mlx.nn.Module is a dict of its submodules and arrays: reading them as
# items skips Module.__getattr__, Python code that costs about 0.5 µs a
# lookup on a 2-core CPU, several per layer and decode token.
_module_item = dict.get


def _norm_rope_for(rope, query_norm, key_norm):
    """The cached CompiledDualHeadNormRope for a layer's constants, or None
    where the layer's norms or RoPE are not exactly what it computes.

    Runs for every layer of every decode step, so a known layer costs one
    dict lookup: the key holds everything the result depends on, read
    afresh each call (a module swapped or a constant changed in place gets
    a new key), with the types that change what MLX makes of a value (an
    int 1 is not the bool ``traditional``)."""
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
    plain constants."""
    if type(rope) is not nn.RoPE or not (type(query_norm) is type(key_norm) is nn.RMSNorm):
        return False
    eps = query_norm.eps
    if type(eps) not in PLAIN_SCALAR_TYPES or type(key_norm.eps) is not type(eps):
        return False
    if key_norm.eps != eps or type(rope.dims) is not int or type(rope.traditional) is not bool:
        return False
    return type(rope.base) in PLAIN_SCALAR_TYPES and type(rope.scale) in PLAIN_SCALAR_TYPES


def _layer_norm_rope(attention):
    """(norm_rope, query_weight, key_weight) of a layer, norm_rope None where
    the layer's norms or RoPE are not what it computes."""
    item = _module_item
    rope, query_norm = item(attention, "rope"), item(attention, "q_norm")
    key_norm = item(attention, "k_norm")
    if rope is None or query_norm is None or key_norm is None:  # not kept as items
        rope, query_norm, key_norm = attention.rope, attention.q_norm, attention.k_norm
    norm_rope = _norm_rope_for(rope, query_norm, key_norm)
    if norm_rope is None:
        return None, None, None
    query_weight, key_weight = item(query_norm, "weight"), item(key_norm, "weight")
    if query_weight is None or key_weight is None:
        query_weight, key_weight = query_norm.weight, key_norm.weight
    return norm_rope, query_weight, key_weight


def _rotated_queries_and_keys(attention, queries, keys, cache):
    """(B, H, L, D) queries and keys, normalized and rotated in one call, or
    None (the caller then runs the class's own __call__)."""
    try:
        norm_rope, query_weight, key_weight = _layer_norm_rope(attention)
        if norm_rope is None:
            return None
        return norm_rope(
            queries, keys, query_weight, key_weight, offset=0 if cache is None else cache.offset
        )
    except Exception as error:  # anything unexpected runs mlx-lm's own code instead
        log_fallback_once("the full-attention norm + RoPE", error)
        return None


# mlx-lm's KVCache and BatchKVCache, looked up once (None: not yet looked
# up; () where mlx-lm has neither).
_written_cache_classes: Optional[tuple] = None


def _cache_classes() -> tuple:
    global _written_cache_classes
    if _written_cache_classes is None:
        try:
            from mlx_lm.models import cache as cache_module
        except ImportError:
            _written_cache_classes = ()
        else:
            _written_cache_classes = tuple(
                getattr(cache_module, name)
                for name in ("KVCache", "BatchKVCache")
                if hasattr(cache_module, name)
            )
    return _written_cache_classes


def _written_in_one_call(attention, queries, keys, values, cache):
    """What ``update_and_fetch`` of a ``KVCache`` or ``BatchKVCache`` (exact
    types) returns, with the norm + RoPE and both buffer writes in ONE call
    (:meth:`CompiledDualHeadNormRope.apply_with_cache`), the cache left as
    the class leaves it: ``(rotated queries, keys, values)``. None where
    the call does not apply (another cache, a step that grows the buffer,
    a layer the package does not compute); the caller then takes the
    two-step path, whose ``update_and_fetch`` grows the buffer as the class
    does."""
    cache_type = type(cache)
    classes = _cache_classes()
    batched = len(classes) > 1 and cache_type is classes[1]
    if not batched and (not classes or cache_type is not classes[0]):
        return None
    buffer = cache.keys
    row = cache._idx if batched else cache.offset
    length = keys.shape[1]
    if buffer is None or row + length > buffer.shape[2]:
        return None
    try:
        norm_rope, query_weight, key_weight = _layer_norm_rope(attention)
        if norm_rope is None:
            return None
        rotated_queries, written_keys, written_values = norm_rope.apply_with_cache(
            queries, keys, values, query_weight, key_weight, key_cache=buffer,
            value_cache=cache.values, offset=cache.offset, write_offset=row,
        )
    except Exception as error:  # the cache is untouched: the two-step path runs instead
        log_fallback_once("the full-attention norm + RoPE with the cache write", error)
        return None
    # The class's own bookkeeping. Replacing the buffers drops the cache's
    # references to the old ones, so MLX writes into their memory.
    del buffer
    cache.keys, cache.values = written_keys, written_values
    end = row + length
    if batched:
        cache.offset = cache.offset + length
        cache._idx = end
    else:
        cache.offset = end
        if end >= written_keys.shape[2]:  # KVCache.keys_and_values: the whole buffer
            return rotated_queries, written_keys, written_values
    return rotated_queries, written_keys[..., :end, :], written_values[..., :end, :]


def _prework_and_cache_update(attention, queries, keys, values, cache):
    """The q/k prework and the cache update of a full-attention layer, for
    queries ``(B, L, Hq, D)``, keys ``(B, L, Hk, D)`` and values
    ``(B, L, Hk, Dv)`` as the projections give them: ``(queries, keys,
    values)`` ready for attention, ``(B, H, L', D)``, or None (the caller
    then runs the class's own __call__). One call of the package for a
    ``KVCache`` / ``BatchKVCache`` step within the buffer; otherwise the
    norm + RoPE call, then ``cache.update_and_fetch``. For any family whose
    attention is ``rms_norm`` + ``nn.RoPE`` of q and k before the cache."""
    written = _written_in_one_call(attention, queries, keys, values, cache)
    if written is not None:
        return written
    rotated = _rotated_queries_and_keys(attention, queries, keys, cache)
    if rotated is None:
        return None
    rotated_queries, rotated_keys = rotated
    values = values.transpose(0, 2, 1, 3)
    if cache is not None:
        rotated_keys, values = cache.update_and_fetch(rotated_keys, values)
    return rotated_queries, rotated_keys, values


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


def _qwen3_attention_call(self, x, mask=None, cache=None):
    """Qwen3 / Qwen3-MoE attention with the q/k prework in one call."""
    batch, length, _ = x.shape
    head_queries = self.q_proj(x).reshape(batch, length, self.n_heads, -1)
    head_keys = self.k_proj(x).reshape(batch, length, self.n_kv_heads, -1)
    head_values = self.v_proj(x).reshape(batch, length, self.n_kv_heads, -1)
    attended = _prework_and_cache_update(self, head_queries, head_keys, head_values, cache)
    if attended is None:
        return type(self).mlx_dualnorm_original_call(self, x, mask, cache)
    output = _attended(self, *attended, cache, mask, batch, length)
    return self.o_proj(output)


def _qwen3_next_attention_call(self, x, mask=None, cache=None):
    """Qwen3-Next's gated full attention with the q/k prework in one call."""
    batch, length, _ = x.shape
    projected = self.q_proj(x).reshape(batch, length, self.num_attention_heads, -1)
    head_queries, gate = mx.split(projected, 2, axis=-1)
    head_keys = self.k_proj(x).reshape(batch, length, self.num_key_value_heads, -1)
    head_values = self.v_proj(x).reshape(batch, length, self.num_key_value_heads, -1)
    attended = _prework_and_cache_update(self, head_queries, head_keys, head_values, cache)
    if attended is None:
        return type(self).mlx_dualnorm_original_call(self, x, mask, cache)
    output = _attended(self, *attended, cache, mask, batch, length)
    return self.o_proj(output * mx.sigmoid(gate.reshape(batch, length, -1)))


_ATTENTION_REPLACEMENTS = {
    "qwen3": _qwen3_attention_call,
    "qwen3_next": _qwen3_next_attention_call,
}
for _replacement in _ATTENTION_REPLACEMENTS.values():
    setattr(_replacement, REPLACEMENT_MARKER, True)


def _full_attention_classes():
    """(class, replacement) for every covered class mlx-lm has."""
    for module_name, class_name, replacement_name in FULL_ATTENTION_CLASSES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        yield getattr(module, class_name), _ATTENTION_REPLACEMENTS[replacement_name]


# ---- One decision per layer ------------------------------------------------------
#
# The patch decides once per attention layer, at its first call, whether it
# engages, and then moves the layer to a subclass whose __call__ is the
# outcome: the replacement for a layer it engages, the class's own
# __call__ for a layer it leaves alone (a scaled RoPE, other norms). A layer
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


def _layer_engages(attention) -> bool:
    """Whether the layer's norms and RoPE are what the package computes."""
    try:
        rope, query_norm, key_norm = attention.rope, attention.q_norm, attention.k_norm
    except AttributeError:
        return False
    return _is_plain_norm_rope(rope, query_norm, key_norm)


def _deciding_call(attention_class, replacement):
    """The patched class's __call__: decides for the layer, moves it to its
    subclass, then runs the outcome."""

    def first_call(self, x, mask=None, cache=None):
        if type(self) is not attention_class:  # a subclass of mlx-lm's: leave it alone
            return _original_attention_calls[attention_class](self, x, mask, cache)
        engaged = _layer_engages(self)
        if not engaged:
            log_fallback_once(
                f"{attention_class.__module__}.{attention_class.__qualname__}",
                "its norms or RoPE are not plain nn.RMSNorm / nn.RoPE",
            )
        decided = _decided_class(attention_class, replacement, engaged)
        reference = weakref.ref(self)
        object.__setattr__(self, "__class__", decided)
        with _decided_layers_lock:
            _decided_layers[id(self)] = reference
            _prune_decided_layers()
        return decided.__call__(self, x, mask, cache)

    setattr(first_call, REPLACEMENT_MARKER, True)
    first_call.__wrapped__ = _original_attention_calls[attention_class]
    return first_call


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
    for attention_class, replacement in _full_attention_classes():
        current = attention_class.__dict__["__call__"]
        if getattr(current, REPLACEMENT_MARKER, False) is not True:
            _original_attention_calls[attention_class] = current
        attention_class.__call__ = _deciding_call(attention_class, replacement)


def clear_norm_ropes() -> None:
    """Drops every cached norm + RoPE object."""
    with _norm_ropes_lock:
        _norm_ropes.clear()


def _restore_full_attention_calls() -> None:
    for attention_class, original in _original_attention_calls.items():
        attention_class.__call__ = original
    with _decided_layers_lock:
        references = list(_decided_layers.values())
        _decided_layers.clear()
    for reference in references:
        layer = reference()
        if layer is not None:
            object.__setattr__(layer, "__class__", type(layer).__mro__[1])
