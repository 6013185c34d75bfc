"""Gated-delta layers: mlx-lm's ``normalize_qk`` as one dual head norm call.

mlx-lm 0.32.x normalizes the queries and keys of every gated-delta layer
(qwen3_next, qwen3_5, kimi_linear, kimi_k3, olmo_hybrid, bailing_moe_v3)
with ``mlx_lm.models.gated_delta.normalize_qk(q, k, *, inv_scale, eps)``::

    rms_eps = eps * inv_scale**2
    q = (inv_scale**2) * mx.fast.rms_norm(q, None, rms_eps)
    k = inv_scale * mx.fast.rms_norm(k, None, rms_eps)

two rms_norm graph builds and two scalar multiplies per layer and token.

What is fused: ``rms_norm(x, w, eps)`` ends with ``normalized.astype(T) *
w``, a multiply done in the input dtype ``T``; ``python_float * array_of_T``
converts the float to ``T`` (MLX's weak scalar promotion) and multiplies in
``T`` as well. So each scale folds into a constant weight vector of width
``D``, built by that very expression (``inv_scale**2 * ones(D, T)`` and
``inv_scale * ones(D, T)``): every element holds the ``T`` value the scalar
becomes, both paths do one correctly rounded ``T`` multiply of the same
operands, and ``rms_eps`` is the same Python float, made float32 the same
way. The whole prework is then ONE call of
:class:`~mlx_dualnorm.CompiledDualHeadNorm`, bit-identical to the original.
That was measured, not only argued: a sweep over dtypes, widths, eps,
inv_scales, shapes, value ranges (inf, NaN and zeros included) and memory
layouts finds no differing bit (docs/mlx-lm.md has the counts).

What is rejected, running the original function instead, never an
approximation: q and k of different dtypes or widths; dtypes other than
float32 / float16 / bfloat16; widths below 2 (no model has them, and the
core would only build the composed graph for them anyway);
an ``inv_scale`` or ``eps`` that is not a plain ``float`` / ``int`` (an
``mx.array`` or numpy scale promotes differently); ``inv_scale`` not finite
and > 0 or ``eps`` not finite and >= 0; a case whose one-time probe against
the original is not bit-identical (it warns); and any call that raises.

Each (mode, dtype, width, ranks, eps, inv_scale, device type) gets its weight
vectors and compiled object once, under a lock taken on cache misses only,
and a probe run of both paths that must agree bit for bit.
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import Callable, Optional

import mlx.core as mx

from mlx_dualnorm.bits import same_bits
from mlx_dualnorm._composite import Mode
from mlx_dualnorm.dual_head_norm import CompiledDualHeadNorm
from mlx_dualnorm.integrations.mlx_lm._shared import (
    PLAIN_SCALAR_TYPES,
    REPLACEMENT_MARKER,
    cached_or_built,
    is_mlx_function,
    log_fallback_once,
)
from mlx_dualnorm.integrations.mlx_lm.state import STATE

GATED_DELTA_MODULE = "mlx_lm.models.gated_delta"

try:
    import mlx_lm.models.gated_delta as gated_delta_module
except ModuleNotFoundError as missing:  # an mlx-lm from before gated-delta layers
    if missing.name != GATED_DELTA_MODULE:
        raise
    gated_delta_module = None

NORMALIZE_QK_OPERATION = "mlx_lm.normalize_qk"

FOLDABLE_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
MIN_FOLDABLE_WIDTH = 2
PROBE_ROWS = 3


def _unwrap_replacement(function):
    while getattr(function, REPLACEMENT_MARKER, False) is True:
        function = function.__wrapped__
    return function


ORIGINAL_NORMALIZE_QK = _unwrap_replacement(getattr(gated_delta_module, "normalize_qk", None))
"""mlx-lm's own ``normalize_qk``, the function every fallback runs (None on
an mlx-lm without it, where :func:`patch` raises)."""


class _FoldedScaleNorm:
    """``normalize_qk`` for one cache key: the scales folded into constant
    weights of the input dtype, both sides in one dual call.

    The fold changes the expression, not only its evaluation: its forward
    is ``rms_norm(x, scale * ones)``, whose bits equal ``scale *
    rms_norm(x)``, but MLX differentiates the two differently (on CUDA,
    rms_norm's weighted vjp multiplies the cotangent by the weight in
    float32 inside its kernel, where the original multiplies it by the
    scalar in the input dtype first). So the call is a custom function:
    its forward is the folded call, and its vjp, jvp and vmap are those of
    mlx-lm's own ``normalize_qk`` with the same constants. Gradients, and
    anything else a transform computes, are then the original's bits on
    every backend.
    """

    __slots__ = ("dual_head_norm", "query_scale_weight", "key_scale_weight", "_transformed")

    def __init__(
        self,
        dual_head_norm: CompiledDualHeadNorm,
        query_scale_weight: mx.array,
        key_scale_weight: mx.array,
        inv_scale: float,
        eps: float,
    ) -> None:
        self.dual_head_norm = dual_head_norm
        self.query_scale_weight = query_scale_weight
        self.key_scale_weight = key_scale_weight
        self._transformed = _with_original_transforms(self._forward, inv_scale, eps)

    def _forward(self, queries: mx.array, keys: mx.array) -> tuple[mx.array, mx.array]:
        return self.dual_head_norm(
            queries, keys, self.query_scale_weight, self.key_scale_weight
        )

    def __call__(self, queries: mx.array, keys: mx.array) -> tuple[mx.array, mx.array]:
        return self._transformed(queries, keys)


def _with_original_transforms(forward, inv_scale: float, eps: float):
    """``forward`` as an ``mx.custom_function`` whose vjp, jvp and vmap are
    mlx-lm's ``normalize_qk`` at ``inv_scale`` and ``eps``: MLX's own
    transforms of the original expression, so their bits are the
    original's."""

    def original(queries: mx.array, keys: mx.array) -> tuple[mx.array, mx.array]:
        return ORIGINAL_NORMALIZE_QK(queries, keys, inv_scale=inv_scale, eps=eps)

    transformed = mx.custom_function(forward)

    @transformed.vjp
    def _vjp(primals, cotangents, outputs):
        del outputs  # the original's vjp recomputes what it needs
        return mx.vjp(original, list(primals), list(cotangents))[1]

    @transformed.jvp
    def _jvp(primals, tangents):
        return mx.jvp(original, list(primals), list(tangents))[1]

    @transformed.vmap
    def _vmap(inputs, axes):
        batched = mx.vmap(original, in_axes=tuple(axes))(*inputs)
        return batched, (0, 0)

    return transformed


_UNFOLDABLE = object()  # cached for keys that always run the original
_folded_norms: dict = {}
# Reentrant: a build runs the original, which must not deadlock even if it
# were some wrapper that calls back into gated_delta.normalize_qk.
_folded_norms_lock = threading.RLock()


def _fold_key(queries, keys, inv_scale, eps, mode) -> Optional[tuple]:
    """The cache key of a call, or None where the call cannot fold."""
    if type(inv_scale) not in PLAIN_SCALAR_TYPES or type(eps) not in PLAIN_SCALAR_TYPES:
        return None
    if not (inv_scale > 0 and eps >= 0):  # also keeps NaN, never equal to itself, out of keys
        return None
    if not (isinstance(queries, mx.array) and isinstance(keys, mx.array)):
        return None
    dtype = queries.dtype
    query_rank = queries.ndim
    key_rank = keys.ndim
    if keys.dtype != dtype or query_rank == 0 or key_rank == 0:
        return None
    width = queries.shape[-1]
    if keys.shape[-1] != width:
        return None
    # Device objects hash by identity, their type by value.
    return (mode, dtype, width, query_rank, key_rank, eps, inv_scale, mx.default_device().type)


def _folded_norm_for(fold_key: tuple):
    """The cached fold for a key (built on a miss), or ``_UNFOLDABLE``."""
    return cached_or_built(
        _folded_norms, _folded_norms_lock, fold_key, lambda: _build_folded_norm(*fold_key),
        _UNFOLDABLE,
    )


def _build_folded_norm(mode, dtype, width, query_rank, key_rank, eps, inv_scale, device_type):
    """Weights, compiled object and probe for one key, or ``_UNFOLDABLE``.
    Runs on the default device, of the key's ``device_type``."""
    del device_type  # part of the key only: the build runs on the default device
    if dtype not in FOLDABLE_DTYPES or width < MIN_FOLDABLE_WIDTH:
        return _UNFOLDABLE
    try:
        if not (math.isfinite(inv_scale) and inv_scale > 0):
            return _UNFOLDABLE
        if not (math.isfinite(eps) and eps >= 0):
            return _UNFOLDABLE
        # The original's own expressions, so every rounding is the same.
        rms_eps = eps * inv_scale**2
        query_scale_weight = (inv_scale**2) * mx.ones((width,), dtype=dtype)
        key_scale_weight = inv_scale * mx.ones((width,), dtype=dtype)
        if query_scale_weight.dtype != dtype or key_scale_weight.dtype != dtype:
            return _UNFOLDABLE
        mx.eval(query_scale_weight, key_scale_weight)
        folded = _FoldedScaleNorm(
            _new_dual_head_norm(rms_eps, mode), query_scale_weight, key_scale_weight,
            inv_scale, eps,
        )
        probe_matches = _probe_matches_original(
            folded, dtype, width, query_rank, key_rank, eps, inv_scale
        )
    except Exception as error:  # the original will raise, or run, as it always did
        log_fallback_once("the gated-delta fold's build", error)
        return _UNFOLDABLE
    if not probe_matches:
        warnings.warn(
            f"[{NORMALIZE_QK_OPERATION}] not bit-identical to mlx-lm's normalize_qk for "
            f"dtype {dtype}, width {width}, eps {eps!r}, inv_scale {inv_scale!r} "
            f"(mode {mode!r}); those calls run mlx-lm's own function",
            RuntimeWarning,
            stacklevel=5,  # the caller of normalize_qk
        )
        return _UNFOLDABLE
    return folded


def _new_dual_head_norm(rms_eps: float, mode: Optional[Mode]) -> CompiledDualHeadNorm:
    if mode is None:
        return CompiledDualHeadNorm(rms_eps)
    return CompiledDualHeadNorm(rms_eps, mode=mode)


def _probe_shape(rank: int, width: int) -> tuple[int, ...]:
    return (width,) if rank == 1 else (PROBE_ROWS,) + (1,) * (rank - 2) + (width,)


def _probe_matches_original(folded, dtype, width, query_rank, key_rank, eps, inv_scale) -> bool:
    """Runs both paths once on deterministic inputs of the key's ranks (so
    the probe replays the very graph later calls use) and compares bits."""
    query_positions = mx.arange(math.prod(_probe_shape(query_rank, width)), dtype=mx.float32)
    key_positions = mx.arange(math.prod(_probe_shape(key_rank, width)), dtype=mx.float32)
    # Magnitudes spread over 2**-6 .. 2**6, signs mixed.
    probe_queries = mx.sin(query_positions * 0.37 + 0.1) * mx.power(
        mx.array(2.0), query_positions % 13 - 6
    )
    probe_keys = mx.cos(key_positions * 0.61) * 3.0
    probe_queries = probe_queries.astype(dtype).reshape(_probe_shape(query_rank, width))
    probe_keys = probe_keys.astype(dtype).reshape(_probe_shape(key_rank, width))
    expected = ORIGINAL_NORMALIZE_QK(probe_queries, probe_keys, inv_scale=inv_scale, eps=eps)
    actual = folded(probe_queries, probe_keys)
    mx.eval(expected, actual)
    return all(same_bits(a, e) for a, e in zip(actual, expected))


def _fall_back(queries, keys, inv_scale, eps):
    """mlx-lm's own normalize_qk: every call that does not fold."""
    return ORIGINAL_NORMALIZE_QK(queries, keys, inv_scale=inv_scale, eps=eps)


# Calls of the patched normalize_qk in this process: all of them, and those
# that ran mlx-lm's function (read by the patch's report).
call_counts = {"calls": 0, "original": 0}


# MLX's own mx.fast.rms_norm, the function the original calls and the fold
# computes: where the program has replaced it (a profiler's wrapper, say),
# every call runs the original, which calls the program's function.
_mlx_rms_norm = None


def _rms_norm_is_mlx_s() -> bool:
    """Whether ``mx.fast.rms_norm`` is MLX's own now (remembered by identity)."""
    global _mlx_rms_norm
    function = mx.fast.rms_norm
    if function is _mlx_rms_norm:
        return True
    if is_mlx_function("rms_norm", function):
        _mlx_rms_norm = function
        return True
    return False


def _normalize_qk(queries, keys, inv_scale, eps, mode):
    call_counts["calls"] += 1
    if mx.fast.rms_norm is _mlx_rms_norm or _rms_norm_is_mlx_s():
        try:
            fold_key = _fold_key(queries, keys, inv_scale, eps, mode)
            if fold_key is not None:
                folded = _folded_norm_for(fold_key)
                if folded is not _UNFOLDABLE:
                    return folded(queries, keys)
        except Exception as error:  # any failure runs the original, never a guess
            log_fallback_once("normalize_qk", error)
    call_counts["original"] += 1
    return _fall_back(queries, keys, inv_scale, eps)


def normalize_qk(
    q: mx.array, k: mx.array, *, inv_scale: float, eps: float
) -> tuple[mx.array, mx.array]:
    """Drop-in for ``mlx_lm.models.gated_delta.normalize_qk``, bit-identical,
    that folds whether or not the patch is on (the function :func:`patch`
    installs in mlx-lm is another, which runs mlx-lm's own once unpatched).

    Returns ``(inv_scale**2 * rms_norm(q, None, eps * inv_scale**2),
    inv_scale * rms_norm(k, None, eps * inv_scale**2))`` from one call of
    the package's best path (the default mode of
    :class:`~mlx_dualnorm.CompiledDualHeadNorm`), or from mlx-lm's function
    itself for inputs that do not fold (see
    :mod:`mlx_dualnorm.integrations.mlx_lm.gated_delta`).
    """
    return _normalize_qk(q, k, inv_scale, eps, None)


def fold_count() -> int:
    """Folds built in this process (one per dtype, width, eps, scale and
    mode the model's calls had), not counting the keys that run mlx-lm's
    function."""
    return sum(folded is not _UNFOLDABLE for folded in list(_folded_norms.values()))


def clear_folds() -> None:
    """Drops every cached fold (weights and compiled objects)."""
    with _folded_norms_lock:
        _folded_norms.clear()


def _mark_replacement(function, mode: Optional[Mode]):
    function.__wrapped__ = ORIGINAL_NORMALIZE_QK
    setattr(function, REPLACEMENT_MARKER, True)
    function.mlx_dualnorm_mode = mode
    return function


_mark_replacement(normalize_qk, None)
# mode -> the function patch() installs for it.
_replacements: dict[Optional[Mode], Callable[..., tuple[mx.array, mx.array]]] = {}


def is_replacement(function: object) -> bool:
    """Whether ``function`` is one of this module's replacements (by
    identity, not by its marker)."""
    return function is normalize_qk or any(
        function is replacement for replacement in list(_replacements.values())
    )


def _replacement_for(mode: Optional[Mode]):
    """The function :func:`patch` installs for ``mode``, one per mode, so
    patching twice installs the same object. It reads the patch's state at
    every call: a reference to it that outlives the patch (a ``from
    mlx_lm.models.gated_delta import normalize_qk`` made while patched)
    runs mlx-lm's own function once unpatched."""
    replacement = _replacements.get(mode)
    if replacement is None:

        def normalize_qk(
            q: mx.array, k: mx.array, *, inv_scale: float, eps: float
        ) -> tuple[mx.array, mx.array]:
            if STATE.patched:
                return _normalize_qk(q, k, inv_scale, eps, mode)
            return ORIGINAL_NORMALIZE_QK(q, k, inv_scale=inv_scale, eps=eps)

        normalize_qk.__doc__ = (
            f"mlx-lm's normalize_qk through mlx_dualnorm (mode {mode!r}) while the patch is "
            "on, bit-identical; mlx-lm's own function once it is off."
        )
        normalize_qk.__module__ = "mlx_dualnorm.integrations.mlx_lm"
        normalize_qk.__qualname__ = "normalize_qk"
        replacement = _replacements[mode] = _mark_replacement(normalize_qk, mode)
    return replacement

