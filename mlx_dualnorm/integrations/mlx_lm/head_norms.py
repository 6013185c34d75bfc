"""The q/k norm pair as one call, for attention layers of any layout.

mlx-lm's attention layers outside the qwen3 shape normalize queries and keys
with two norm modules, at different points of their code: over each head
after the transpose to ``(B, H, L, D)``, over each head before it, or over
the whole ``H * D`` projection. Whatever the point, the two calls are
``mx.fast.rms_norm(x, weight, eps)`` on arrays that exist right there, so
the patched layers make them ONE call of
:class:`~mlx_dualnorm.CompiledDualHeadNorm` on those very arrays, with the
weight each norm class passes, and leave every other op (RoPE included) to
the model's own code in its own order: the same primitives on the same
inputs, so the same bits. Where a layer's norms, RoPE and cache write can
be one norm + RoPE call with mlx-lm's row order (:func:`norm_rope_prework`:
decode steps of the heads-first layers, the whole-projection layers), the
layer takes that call instead.

The norm classes known here, and the weight each passes to ``rms_norm``:

* ``nn.RMSNorm``: its ``weight``.
* gemma3_text's ``RMSNorm`` and minimax_m3_vl's ``GemmaRMSNorm``:
  ``1.0 + weight``.
* gear's ``GearRMSNorm``: ``(1.0 + weight).astype(x.dtype)``.
* plamo3's ``RMSNorm``: its own ``scale`` property (``weight + offset``,
  which that class caches itself while its weight stays the same array).

The weight expression is evaluated at every call from the module's current
parameter, exactly as the class does, so weights replaced after loading
(``load_weights``, ``update``, an optimizer step) are followed. Anything
else (another norm class, two epsilons, an epsilon that is not a plain
number) is not normalized here: the caller then runs mlx-lm's own code.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dualnorm._composite import Mode
from mlx_dualnorm.dual_head_norm import CompiledDualHeadNorm
from mlx_dualnorm.integrations.mlx_lm import norm_rope, registry
from mlx_dualnorm.integrations.mlx_lm.prework_log import NORM_ONLY, NORM_ROPE, note_prework
from mlx_dualnorm.integrations.mlx_lm.state import STATE
from mlx_dualnorm.integrations.mlx_lm._shared import (
    PLAIN_SCALAR_TYPES,
    cached_or_built,
    log_fallback_once,
)


@dataclasses.dataclass(frozen=True)
class NormKind:
    """What a norm class passes to ``mx.fast.rms_norm``: its epsilon, and
    its weight for an input ``x``, read from the module at each call."""

    epsilon: Callable[[nn.Module], object]
    weight: Callable[[nn.Module, mx.array], mx.array]


def _own_weight(norm, x):
    return norm["weight"]


def _one_plus_weight(norm, x):
    return 1.0 + norm["weight"]


def _one_plus_weight_as_input(norm, x):
    return (1.0 + norm["weight"]).astype(x.dtype)


def _scale_property(norm, x):
    return norm.scale


def _eps(norm):
    return norm.eps


def _variance_epsilon(norm):
    return norm.variance_epsilon


_PLAIN = NormKind(_eps, _own_weight)
_ONE_PLUS = NormKind(_eps, _one_plus_weight)

# (mlx-lm module, class) -> kind; a module that does not import is skipped.
MODEL_NORM_KINDS = (
    ("mlx_lm.models.gemma3_text", "RMSNorm", _ONE_PLUS),
    ("mlx_lm.models.minimax_m3_vl", "GemmaRMSNorm", _ONE_PLUS),
    ("mlx_lm.models.gear", "GearRMSNorm", NormKind(_eps, _one_plus_weight_as_input)),
    ("mlx_lm.models.plamo3", "RMSNorm", NormKind(_variance_epsilon, _scale_property)),
)

_norm_kinds: dict = {}
_norm_kinds_lock = threading.Lock()


def norm_kinds() -> dict:
    """class -> :class:`NormKind` for every known norm class mlx-lm has."""
    if not _norm_kinds:
        with _norm_kinds_lock:
            if not _norm_kinds:
                kinds: dict = {norm_rope.RMS_NORM: _PLAIN}
                for module_name, class_name, kind in MODEL_NORM_KINDS:
                    norm_class = registry.defined_class(module_name, class_name)
                    if norm_class is not None:
                        kinds[norm_class] = kind
                _norm_kinds.update(kinds)
    return _norm_kinds


def _kind_and_epsilon(query_norm, key_norm):
    """(kind, eps) of a pair of one known norm class with one plain
    epsilon, or None."""
    kind = norm_kinds().get(type(query_norm))
    if kind is None or type(key_norm) is not type(query_norm):
        return None
    eps, key_eps = kind.epsilon(query_norm), kind.epsilon(key_norm)
    if type(eps) not in PLAIN_SCALAR_TYPES or type(key_eps) is not type(eps) or key_eps != eps:
        return None
    return kind, eps


def norms_engage(query_norm, key_norm) -> bool:
    """Whether :func:`normalized_pair` computes this pair exactly."""
    return _kind_and_epsilon(query_norm, key_norm) is not None


_dual_norms: dict = {}
_dual_norms_lock = threading.Lock()


def dual_norm_for(eps, mode: Optional[Mode] = None) -> Optional[CompiledDualHeadNorm]:
    """The CompiledDualHeadNorm of epsilon ``eps`` in ``mode`` (the one the
    layer was decided in; None: the default), built once and shared by
    every layer whose q/k norm pair it computes; None once the cache is
    full."""
    return cached_or_built(
        _dual_norms, _dual_norms_lock, (mode, eps, type(eps)),
        lambda: CompiledDualHeadNorm(eps, mode="auto" if mode is None else mode),
        None,
    )


def normalized_pair(queries, keys, query_norm, key_norm, mode: Optional[Mode] = None):
    """``(query_norm(queries), key_norm(keys))`` as one call of an object
    built in ``mode``, or None where
    the pair is not what this computes (the caller then runs mlx-lm's own
    ``__call__``). Runs for every engaged layer of every decode step."""
    try:
        normalized = _normalized_pair(queries, keys, query_norm, key_norm, mode)
    except Exception as error:  # anything unexpected runs mlx-lm's own code instead
        log_fallback_once("the q/k norm pair", error)
        return None
    if normalized is not None:
        if STATE.prework_log is not None:  # a tool is recording
            note_prework(NORM_ONLY)
    return normalized


def _normalized_pair(queries, keys, query_norm, key_norm, mode):
    kind_and_epsilon = _kind_and_epsilon(query_norm, key_norm)
    if kind_and_epsilon is None:
        return None
    kind, eps = kind_and_epsilon
    dual_norm = dual_norm_for(eps, mode)
    if dual_norm is None:
        return None
    return dual_norm(queries, keys, kind.weight(query_norm, queries), kind.weight(key_norm, keys))


_stand_in_norms: dict = {}
_stand_in_norms_lock = threading.Lock()


def stand_in_norm(eps) -> nn.RMSNorm:
    """An ``nn.RMSNorm`` of epsilon ``eps``, standing for norms that compute
    ``rms_norm`` with that eps without being one (another weight, or no
    module at all) where the package reads a norm's type and eps only."""
    stand_in = cached_or_built(
        _stand_in_norms, _stand_in_norms_lock, (type(eps), eps), lambda: norm_rope.RMS_NORM(1, eps),
        None,
    )
    return norm_rope.RMS_NORM(1, eps) if stand_in is None else stand_in


def norm_rope_prework(
    place: str, rope, query_norm, key_norm, queries, keys, mode: Optional[Mode] = None
):
    """The prework of a layer whose q/k norms of a known class are followed
    by ``rope``, as :func:`~.cache_update.prework_and_cache_update` takes
    it: the RoPE, the norms (stand-ins of their eps where they are not
    ``nn.RMSNorm``) and the weights each norm passes to ``rms_norm``, read
    now, and ``mode`` to build in; None where the norms are not a known pair, ``rope`` is not one
    the norm + RoPE call computes (``nn.RoPE``, the scaled RoPEs) or
    reading them raises (logged once for ``place``, the caller's kind of
    layer, which then takes its other path)."""
    try:
        if type(rope) is not norm_rope.ROPE and type(rope) not in norm_rope.SCALED_ROPE_CLASSES:
            return None
        kind_and_epsilon = _kind_and_epsilon(query_norm, key_norm)
        if kind_and_epsilon is None:
            return None
        kind, eps = kind_and_epsilon
        weights = kind.weight(query_norm, queries), kind.weight(key_norm, keys)
        if kind is not _PLAIN:
            query_norm = key_norm = stand_in_norm(eps)
        return norm_rope.LayerPrework(rope, query_norm, key_norm, *weights, mode)
    except Exception as error:  # anything unexpected takes the layer's other path
        log_fallback_once(place, error, "takes its other path")
        return None


def normalized_rotated_heads(
    queries, keys, query_norm, key_norm, rope, offset, mode: Optional[Mode] = None
):
    """(B, H, L, D) queries and keys from (B, L, H, D) heads: normalized,
    transposed and rotated by ``rope(x, offset=offset)``, as mlx-lm's
    per-head layers do. Where ``rope`` is one the qwen3 layers' norm + RoPE
    computes (``nn.RoPE``, the scaled RoPEs of ``rope_utils``) and the norms
    are plain ``nn.RMSNorm``, that is ONE call of its cached
    :class:`~mlx_dualnorm.CompiledDualHeadNormRope`; otherwise the norm pair
    in one call, then the layer's own RoPE. None where neither computes the
    layer exactly. The package's objects are built in ``mode``."""
    try:
        if type(rope) is norm_rope.ROPE or type(rope) in norm_rope.SCALED_ROPE_CLASSES:
            layer_call = norm_rope.norm_rope_for(rope, query_norm, key_norm, mode)
            if layer_call is not None:
                rotated = layer_call(
                    queries, keys, query_norm["weight"], key_norm["weight"], offset=offset
                )
                if STATE.prework_log is not None:  # a tool is recording
                    note_prework(NORM_ROPE)
                return rotated
        normalized = _normalized_pair(queries, keys, query_norm, key_norm, mode)
        if normalized is None:
            return None
        if STATE.prework_log is not None:  # a tool is recording
            note_prework(NORM_ONLY)
        normalized_queries, normalized_keys = normalized
        return (
            rope(normalized_queries.transpose(0, 2, 1, 3), offset=offset),
            rope(normalized_keys.transpose(0, 2, 1, 3), offset=offset),
        )
    except Exception as error:  # anything unexpected runs mlx-lm's own code instead
        log_fallback_once("the per-head q/k norm and RoPE", error)
        return None


def rotated_pair(rope, queries, keys, cache):
    """The model's own RoPE of both, called as mlx-lm's layers call it:
    at ``cache.offset`` with a cache, with no offset argument without."""
    if cache is not None:
        return rope(queries, offset=cache.offset), rope(keys, offset=cache.offset)
    return rope(queries), rope(keys)


def clear_dual_norms() -> None:
    """Drops every cached q/k norm pair object."""
    with _dual_norms_lock:
        _dual_norms.clear()
