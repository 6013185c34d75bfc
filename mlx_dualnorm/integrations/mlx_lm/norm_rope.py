"""The norm + RoPE of a full-attention layer as one package call.

mlx-lm's full-attention layers (qwen3's shape and the families that share
it) normalize queries and keys with ``q_norm`` / ``k_norm``
(``nn.RMSNorm``), transpose them to ``(B, H, L, D)`` and rotate them with
the layer's RoPE. :func:`norm_rope_for` gives the
:class:`~mlx_dualnorm.CompiledDualHeadNormRope` that computes all of that
in one call, with the layer's own epsilon and RoPE constants: the same
primitives in the same order, so the same bits. Besides ``nn.RoPE``, the
scaled RoPEs of ``rope_utils`` that rotate with a frequency table
(``Llama3RoPE``, ``YarnRoPE``, ``SuScaledRoPE``, ``ProportionalRoPE``) are
covered: the table is an input of each call, their input scale a
constant. Any other RoPE (such as ``DynamicNTKScalingRoPE``, whose base
depends on the position), or norms that are not exactly ``nn.RMSNorm``
with one epsilon, get None: the caller runs the class's own code. On MLX's
CUDA backend the call is one kernel launch (the fused mode).

A layer without q/k norms (mlx-lm's Llama family) passes None for both
norms: the object is then made without norms (``eps=None``), the RoPE,
transposes and cache write of its attention in the same one call.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple, Optional

import mlx.core as mx
from mlx.nn.layers.normalization import RMSNorm
from mlx.nn.layers.positional_encoding import RoPE

from mlx_dualnorm._composite import Mode
from mlx_dualnorm.dual_head_norm_rope import CompiledDualHeadNormRope
from mlx_dualnorm.integrations.mlx_lm import registry
from mlx_dualnorm.integrations.mlx_lm._shared import (
    PLAIN_SCALAR_TYPES,
    cached_or_built,
    log_fallback_once,
)

# The classes as MLX defines them, from their own modules (a name the
# program rebinds, such as ``nn.RMSNorm = MyNorm``, changes nothing here).
RMS_NORM = RMSNorm
ROPE = RoPE

# Built objects by the constants they depend on (see norm_rope_for).
_norm_ropes: dict = {}
_norm_ropes_lock = threading.Lock()

# mlx.nn.Module is a dict of its submodules and arrays: reading them as
# items skips Module.__getattr__, Python code run for every lookup:
# several per layer and decode token.
module_item = dict.get


def norm_rope_for(rope, query_norm, key_norm, mode: Optional[Mode] = None):
    """The cached CompiledDualHeadNormRope for a layer's constants in
    ``mode`` (None: the default, the best path here), or None
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
    as it is, never a stale copy. Norms of None (both): a layer without
    q/k norms, whose object rotates without normalizing."""
    rope_type = type(rope)
    if rope_type is not ROPE and rope_type in SCALED_ROPE_CLASSES:  # nn.RoPE: one test
        return _scaled_norm_rope_for(rope, query_norm, key_norm, mode)
    eps, key_eps = _epsilons(query_norm, key_norm)
    key = (
        mode, type(rope), type(query_norm), type(key_norm),
        eps, key_eps, rope.dims, type(rope.dims),
        rope.traditional, type(rope.traditional), rope.base, rope.scale,
    )
    norm_rope = _norm_ropes.get(key)
    if norm_rope is not None or not is_plain_norm_rope(rope, query_norm, key_norm):
        return norm_rope
    return cached_or_built(
        _norm_ropes, _norm_ropes_lock, key,
        lambda: CompiledDualHeadNormRope(
            eps, rope.dims, base=rope.base, traditional=rope.traditional,
            scale=rope.scale, mode="auto" if mode is None else mode,
        ),
        None,
    )


def _epsilons(query_norm, key_norm) -> tuple:
    """The two norms' eps as read now; None for a side without a norm."""
    return (
        None if query_norm is None else query_norm.eps,
        None if key_norm is None else key_norm.eps,
    )


def is_plain_norm_rope(rope, query_norm, key_norm) -> bool:
    """Whether the layer computes what CompiledDualHeadNormRope does: plain
    nn.RMSNorm on both sides with one plain eps (or no norm on either side:
    both None), then plain nn.RoPE with plain constants, or one of the
    scaled RoPEs of :data:`SCALED_ROPE_CLASSES` (exact types) with plain
    constants and an ``mx.array`` table."""
    if query_norm is not None or key_norm is not None:
        if not (type(query_norm) is type(key_norm) is RMSNorm):
            return False
        eps = query_norm.eps
        if type(eps) not in PLAIN_SCALAR_TYPES or type(key_norm.eps) is not type(eps):
            return False
        if key_norm.eps != eps:
            return False
    if type(rope) in SCALED_ROPE_CLASSES:
        constants = _scaled_rope_constants(rope)
        return constants is not None and type(_rope_table(rope)) is mx.array
    if type(rope) is not RoPE or type(rope.dims) is not int:
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
    names = ("Llama3RoPE", "YarnRoPE", "SuScaledRoPE", "ProportionalRoPE")
    found = (registry.defined_class("mlx_lm.models.rope_utils", name) for name in names)
    return tuple(cls for cls in found if cls is not None)


SCALED_ROPE_CLASSES = _scaled_rope_classes()


def _rope_table(rope):
    """The module's frequency table, read as an item (see module_item)."""
    table = module_item(rope, "_freqs")
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


def _scaled_norm_rope_for(rope, query_norm, key_norm, mode):
    """_norm_rope_for for a scaled RoPE: the cached object for the
    constants, bound to the table read now."""
    constants = _scaled_rope_constants(rope)
    eps, key_eps = _epsilons(query_norm, key_norm)
    key = (mode, type(rope), type(query_norm), type(key_norm), eps, key_eps, constants)
    norm_rope = _norm_ropes.get(key)
    if norm_rope is None:
        if not is_plain_norm_rope(rope, query_norm, key_norm):
            return None
        dims, traditional, input_scale = constants
        norm_rope = cached_or_built(
            _norm_ropes, _norm_ropes_lock, key,
            lambda: CompiledDualHeadNormRope(
                eps, dims, base=None, traditional=traditional,
                input_scale=input_scale, mode="auto" if mode is None else mode,
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
    weight: only their type and eps are read; None for both in a layer
    without q/k norms) and the weights those norms pass to ``rms_norm``
    (None for none); the mode the package's objects are built in (the one
    the layer was decided in; None: the default)."""

    rope: object
    query_norm: object
    key_norm: object
    query_weight: Optional[mx.array]
    key_weight: Optional[mx.array]
    mode: Optional[Mode] = None


def layer_prework(attention, mode: Optional[Mode] = None) -> LayerPrework:
    """The prework of a qwen3-shaped layer (``rope``, ``q_norm``,
    ``k_norm``), read as items where the module keeps them so, for
    objects built in ``mode``."""
    item = module_item
    rope, query_norm = item(attention, "rope"), item(attention, "q_norm")
    key_norm = item(attention, "k_norm")
    if rope is None or query_norm is None or key_norm is None:  # not kept as items
        rope, query_norm, key_norm = attention.rope, attention.q_norm, attention.k_norm
    query_weight, key_weight = item(query_norm, "weight"), item(key_norm, "weight")
    if query_weight is None or key_weight is None:
        # As nn.RMSNorm reads it (``self["weight"]``): a norm without one
        # raises here, and the class's own code raises as unpatched.
        query_weight, key_weight = query_norm["weight"], key_norm["weight"]
    return LayerPrework(rope, query_norm, key_norm, query_weight, key_weight, mode)


def rotated_queries_and_keys(norm_rope, prework: LayerPrework, queries, keys, cache):
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


def clear_norm_ropes() -> None:
    """Drops every cached norm + RoPE object."""
    with _norm_ropes_lock:
        _norm_ropes.clear()

