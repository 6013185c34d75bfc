"""Routes mlx-lm's gated-delta q/k normalization through mlx_dualnorm.

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
That was measured, not only argued: 0 of 162,540 cases differ on CPU (3
dtypes x 14 widths x 5 eps x 8 inv_scales x shapes x value ranges incl.
inf/NaN/zeros x 6 memory layouts), bit patterns compared (docs/mlx-lm.md).

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

Full-attention layers (``qwen3``, ``qwen3_moe`` and ``qwen3_next``'s
attention): their q/k prework is ``rms_norm`` by ``q_norm`` / ``k_norm``, a
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

    >>> from mlx_dualnorm.integrations import mlx_lm as dualnorm_mlx_lm
    >>> dualnorm_mlx_lm.patch()            # for the rest of the process
    >>> with dualnorm_mlx_lm.patch(): ...  # or for one block

Importing this module imports mlx-lm; ``import mlx_dualnorm`` does not.
"""

from __future__ import annotations

import importlib
import logging
import math
import sys
import threading
import warnings
import weakref
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dualnorm._bits import same_bits
from mlx_dualnorm.dual_head_norm import CompiledDualHeadNorm, Mode
from mlx_dualnorm.dual_head_norm_rope import CompiledDualHeadNormRope

_LOGGER = logging.getLogger(__name__)

GATED_DELTA_MODULE = "mlx_lm.models.gated_delta"
# mlx-lm gained gated_delta.normalize_qk in 0.32.0 (0.31.x normalizes q and k
# inside each model); the integration is tested on 0.32.2, the mlx-lm extra.
SUPPORTED_MLX_LM = "mlx-lm 0.32.0 to 0.32.2 (tested on 0.32.2, which the mlx-lm extra installs)"

try:
    import mlx_lm.models.gated_delta as gated_delta_module
except ModuleNotFoundError as missing:  # an mlx-lm from before gated-delta layers
    if missing.name != GATED_DELTA_MODULE:
        raise
    gated_delta_module = None

__all__ = [
    "MlxLmPatch",
    "ORIGINAL_NORMALIZE_QK",
    "clear_cache",
    "is_patched",
    "normalize_qk",
    "patch",
    "unpatch",
]

# The labels of this integration's errors and warnings, ``[label] message``.
PATCH_OPERATION = "mlx_lm.patch"
NORMALIZE_QK_OPERATION = "mlx_lm.normalize_qk"

MLX_LM_PACKAGE = "mlx_lm"
PATCHED_ATTRIBUTE = "normalize_qk"
# Marks our replacements, so a reloaded copy of this module still knows them.
REPLACEMENT_MARKER = "_mlx_dualnorm_replacement"

FOLDABLE_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
MIN_FOLDABLE_WIDTH = 2
PLAIN_SCALAR_TYPES = (float, int)
# Keys are model constants (a few per model); past this, new keys run the
# original instead of growing the cache.
MAX_CACHED_FOLDS = 256
PROBE_ROWS = 3

def _unwrap_replacement(function):
    while getattr(function, REPLACEMENT_MARKER, False) is True:
        function = function.__wrapped__
    return function


ORIGINAL_NORMALIZE_QK = _unwrap_replacement(getattr(gated_delta_module, "normalize_qk", None))
"""mlx-lm's own ``normalize_qk``, the function every fallback runs (None on
an mlx-lm without it, where :func:`patch` raises)."""


def _check_mlx_lm_supported() -> None:
    """Raises RuntimeError on an mlx-lm without ``gated_delta.normalize_qk``:
    there the patch would change nothing, and saying so beats a silent no-op."""
    if ORIGINAL_NORMALIZE_QK is not None:
        return
    try:
        import mlx_lm

        installed = f"mlx-lm {mlx_lm.__version__}"
    except Exception:
        installed = "the installed mlx-lm"
    raise RuntimeError(
        f"[{PATCH_OPERATION}] {installed} has no {GATED_DELTA_MODULE}.{PATCHED_ATTRIBUTE}, "
        f"the function this integration replaces; it supports {SUPPORTED_MLX_LM}: "
        "pip install 'mlx-lm==0.32.2'"
    )


# ---- The folded normalization ---------------------------------------------


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


def _cached_or_built(cache: dict, lock, key, build: Callable[[], object], when_full):
    """``cache[key]``, built once under ``lock`` on a miss, or ``when_full``
    (nothing built) once the cache holds MAX_CACHED_FOLDS entries. A hit
    takes no lock: it runs for every layer of every decode step."""
    value = cache.get(key)
    if value is not None:
        return value
    with lock:
        value = cache.get(key)
        if value is None:
            if len(cache) >= MAX_CACHED_FOLDS:
                return when_full
            value = build()
            cache[key] = value
        return value


def _folded_norm_for(fold_key: tuple):
    """The cached fold for a key (built on a miss), or ``_UNFOLDABLE``."""
    return _cached_or_built(
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
    except Exception:  # the original will raise, or run, as it always did
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


def _normalize_qk(queries, keys, inv_scale, eps, mode):
    try:
        fold_key = _fold_key(queries, keys, inv_scale, eps, mode)
        if fold_key is not None:
            folded = _folded_norm_for(fold_key)
            if folded is not _UNFOLDABLE:
                return folded(queries, keys)
    except Exception:  # any failure runs the original, never a guess
        pass
    return _fall_back(queries, keys, inv_scale, eps)


def normalize_qk(
    q: mx.array, k: mx.array, *, inv_scale: float, eps: float
) -> tuple[mx.array, mx.array]:
    """Drop-in for ``mlx_lm.models.gated_delta.normalize_qk``, bit-identical.

    Returns ``(inv_scale**2 * rms_norm(q, None, eps * inv_scale**2),
    inv_scale * rms_norm(k, None, eps * inv_scale**2))`` from one call of
    the package's best path (the default mode of
    :class:`~mlx_dualnorm.CompiledDualHeadNorm`), or from mlx-lm's function
    itself for inputs that do not fold (see the module doc).
    """
    return _normalize_qk(q, k, inv_scale, eps, None)


def clear_cache() -> None:
    """Drops every cached fold (weights and compiled objects) and every
    full-attention norm + RoPE object; the next call of each key builds and
    probes it again."""
    with _folded_norms_lock:
        _folded_norms.clear()
    with _norm_ropes_lock:
        _norm_ropes.clear()


# ---- Patching -------------------------------------------------------------


def _mark_replacement(function, mode: Optional[Mode]):
    function.__wrapped__ = ORIGINAL_NORMALIZE_QK
    setattr(function, REPLACEMENT_MARKER, True)
    function.mlx_dualnorm_mode = mode
    return function


_replacements: dict[Optional[Mode], Callable[..., tuple[mx.array, mx.array]]] = {
    None: _mark_replacement(normalize_qk, None)
}


def _replacement_for(mode: Optional[Mode]):
    """One replacement function per mode, so patching twice installs the
    same object."""
    replacement = _replacements.get(mode)
    if replacement is None:

        def normalize_qk(
            q: mx.array, k: mx.array, *, inv_scale: float, eps: float
        ) -> tuple[mx.array, mx.array]:
            return _normalize_qk(q, k, inv_scale, eps, mode)

        normalize_qk.__doc__ = (
            f"mlx-lm's normalize_qk through mlx_dualnorm (mode {mode!r}), bit-identical."
        )
        normalize_qk.__module__ = __name__
        normalize_qk.__qualname__ = "normalize_qk"
        replacement = _replacements[mode] = _mark_replacement(normalize_qk, mode)
    return replacement


def _is_ours_or_original(function) -> bool:
    if function is ORIGINAL_NORMALIZE_QK:
        return True
    try:
        return getattr(function, REPLACEMENT_MARKER, False) is True
    except Exception:
        return False


def _point_mlx_lm_at(function) -> None:
    """Sets ``normalize_qk`` in gated_delta and in every loaded mlx-lm module
    that holds the original or one of our replacements. Modules imported
    later copy gated_delta's attribute, whichever it is then."""
    gated_delta_module.normalize_qk = function
    for module_name, module in list(sys.modules.items()):
        if module is None or not (
            module_name == MLX_LM_PACKAGE or module_name.startswith(MLX_LM_PACKAGE + ".")
        ):
            continue
        try:
            current = vars(module).get(PATCHED_ATTRIBUTE)
        except TypeError:  # an entry without a __dict__
            continue
        if current is not function and _is_ours_or_original(current):
            setattr(module, PATCHED_ATTRIBUTE, function)


_UNPATCHED = object()  # the installed state when mlx-lm runs its own function
_patch_state_lock = threading.RLock()
_installed_mode = _UNPATCHED


def _install(mode) -> None:
    """Installs ``mode``'s replacements, or the originals for ``_UNPATCHED``;
    the caller holds ``_patch_state_lock``."""
    global _installed_mode
    if ORIGINAL_NORMALIZE_QK is None:  # nothing to point at: patch() has raised
        return
    if mode is _UNPATCHED:
        _point_mlx_lm_at(ORIGINAL_NORMALIZE_QK)
        _restore_full_attention_calls()
    else:
        _point_mlx_lm_at(_replacement_for(mode))
        _install_full_attention_calls(mode)
    _installed_mode = mode


class MlxLmPatch:
    """What :func:`patch` and :func:`unpatch` return. The change is made
    already; used as a context manager, leaving the block restores the state
    from before the call, so nested blocks unwind in order."""

    __slots__ = ("patched", "mode", "_previous_state", "_restored")

    def __init__(self, patched: bool, mode: Optional[Mode], previous_state: object) -> None:
        self.patched = patched
        self.mode = mode
        self._previous_state = previous_state
        self._restored = False

    def __enter__(self) -> "MlxLmPatch":
        return self

    def __exit__(self, *exc_info: object) -> None:
        with _patch_state_lock:
            if not self._restored:
                self._restored = True
                _install(self._previous_state)

    def __repr__(self) -> str:
        if not self.patched:
            return "MlxLmPatch(patched=False)"
        return f"MlxLmPatch(patched=True, mode={self.mode!r})"


def patch(mode: Optional[Mode] = None) -> MlxLmPatch:
    """Routes mlx-lm's ``normalize_qk`` through mlx_dualnorm, now.

    Args:
        mode: passed to :class:`~mlx_dualnorm.CompiledDualHeadNorm`; None
            takes its default (the best path on this machine). A mode that
            cannot run here raises at once.

    Returns:
        An :class:`MlxLmPatch`: keep calling for the rest of the process, or
        use as ``with patch(): ...`` to undo it at the end of the block.
        Patching again is harmless; :func:`unpatch` undoes every patch.

    Raises:
        ValueError: ``mode`` cannot run here.
        RuntimeError: the installed mlx-lm has no ``gated_delta.normalize_qk``
            (releases before 0.32.0); the message names the supported ones.
    """
    _check_mlx_lm_supported()
    if mode is not None:
        _check_mode(mode)
    with _patch_state_lock:
        handle = MlxLmPatch(True, mode, _installed_mode)
        _install(mode)
    return handle


def _check_mode(mode: Mode) -> None:
    try:
        _new_dual_head_norm(1e-6, mode).close()
    except (TypeError, ValueError) as error:
        raise ValueError(f"[{PATCH_OPERATION}] mode {mode!r} cannot run here: {error}") from error


def unpatch() -> MlxLmPatch:
    """Puts mlx-lm's own ``normalize_qk`` back everywhere, now; harmless when
    not patched. As ``with unpatch(): ...``, the block runs mlx-lm's function
    and the previous state comes back after it."""
    with _patch_state_lock:
        handle = MlxLmPatch(False, None, _installed_mode)
        _install(_UNPATCHED)
    return handle


def is_patched() -> bool:
    """Whether mlx-lm's gated-delta and full-attention layers now run
    through mlx_dualnorm."""
    return _installed_mode is not _UNPATCHED


# ---- Full-attention layers: q/k norm + RoPE in one call ------------------------

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
    return _cached_or_built(
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


def _rotated_queries_and_keys(attention, queries, keys, cache):
    """(B, H, L, D) queries and keys, normalized and rotated in one call, or
    None (the caller then runs the class's own __call__)."""
    try:
        item = _module_item
        rope, query_norm = item(attention, "rope"), item(attention, "q_norm")
        key_norm = item(attention, "k_norm")
        if rope is None or query_norm is None or key_norm is None:  # not kept as items
            rope, query_norm, key_norm = attention.rope, attention.q_norm, attention.k_norm
        norm_rope = _norm_rope_for(rope, query_norm, key_norm)
        if norm_rope is None:
            return None
        query_weight, key_weight = item(query_norm, "weight"), item(key_norm, "weight")
        if query_weight is None or key_weight is None:
            query_weight, key_weight = query_norm.weight, key_norm.weight
        return norm_rope(
            queries, keys, query_weight, key_weight, offset=0 if cache is None else cache.offset
        )
    except Exception:  # anything unexpected runs mlx-lm's own code instead
        return None


def _attention_output(attention, queries, keys, values, cache, mask, batch, length):
    """The cache update and attention of mlx-lm's layers, as (B, L, H*D)."""
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    # The model module's own name, looked up at each call as its code does.
    attend = sys.modules[type(attention).__module__].scaled_dot_product_attention
    attended = attend(queries, keys, values, cache=cache, scale=attention.scale, mask=mask)
    return attended.transpose(0, 2, 1, 3).reshape(batch, length, -1)


def _qwen3_attention_call(self, x, mask=None, cache=None):
    """Qwen3 / Qwen3-MoE attention with the q/k prework in one call."""
    batch, length, _ = x.shape
    head_queries = self.q_proj(x).reshape(batch, length, self.n_heads, -1)
    head_keys = self.k_proj(x).reshape(batch, length, self.n_kv_heads, -1)
    rotated = _rotated_queries_and_keys(self, head_queries, head_keys, cache)
    if rotated is None:
        return type(self).mlx_dualnorm_original_call(self, x, mask, cache)
    values = self.v_proj(x).reshape(batch, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    output = _attention_output(self, *rotated, values, cache, mask, batch, length)
    return self.o_proj(output)


def _qwen3_next_attention_call(self, x, mask=None, cache=None):
    """Qwen3-Next's gated full attention with the q/k prework in one call."""
    batch, length, _ = x.shape
    projected = self.q_proj(x).reshape(batch, length, self.num_attention_heads, -1)
    head_queries, gate = mx.split(projected, 2, axis=-1)
    head_keys = self.k_proj(x).reshape(batch, length, self.num_key_value_heads, -1)
    rotated = _rotated_queries_and_keys(self, head_queries, head_keys, cache)
    if rotated is None:
        return type(self).mlx_dualnorm_original_call(self, x, mask, cache)
    values = self.v_proj(x).reshape(batch, length, self.num_key_value_heads, -1)
    values = values.transpose(0, 2, 1, 3)
    output = _attention_output(self, *rotated, values, cache, mask, batch, length)
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
_decided_layers: dict = {}
_decided_layers_lock = threading.Lock()


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
            _log_fallback_once(attention_class, "its norms or RoPE are not plain nn.RMSNorm / nn.RoPE")
        decided = _decided_class(attention_class, replacement, engaged)
        with _decided_layers_lock:
            object.__setattr__(self, "__class__", decided)
            _decided_layers[id(self)] = weakref.ref(self, _forget_layer(id(self)))
        return decided.__call__(self, x, mask, cache)

    setattr(first_call, REPLACEMENT_MARKER, True)
    first_call.__wrapped__ = _original_attention_calls[attention_class]
    return first_call


def _forget_layer(layer_id: int):
    def forget(_reference) -> None:
        with _decided_layers_lock:
            _decided_layers.pop(layer_id, None)

    return forget


_logged_fallbacks: set = set()


def _log_fallback_once(attention_class, reason: str) -> None:
    key = (attention_class, reason)
    if key not in _logged_fallbacks:
        _logged_fallbacks.add(key)
        _LOGGER.debug(
            "%s.%s runs mlx-lm's own code: %s",
            attention_class.__module__, attention_class.__qualname__, reason,
        )


def _install_full_attention_calls(mode: Optional[Mode]) -> None:
    global _full_attention_mode
    _full_attention_mode = mode
    for attention_class, replacement in _full_attention_classes():
        current = attention_class.__dict__["__call__"]
        if getattr(current, REPLACEMENT_MARKER, False) is not True:
            _original_attention_calls[attention_class] = current
        attention_class.__call__ = _deciding_call(attention_class, replacement)


def _restore_full_attention_calls() -> None:
    for attention_class, original in _original_attention_calls.items():
        attention_class.__call__ = original
    with _decided_layers_lock:
        for reference in list(_decided_layers.values()):
            layer = reference()
            if layer is not None:
                object.__setattr__(layer, "__class__", type(layer).__mro__[1])
        _decided_layers.clear()
