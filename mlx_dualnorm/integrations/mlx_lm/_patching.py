"""Installing and restoring the patch: which function mlx-lm's modules
hold, which ``__call__`` the covered attention classes run, and the state
that :func:`patch` and :func:`unpatch` save and bring back. Each layer
shape (one module here per shape) provides what is installed; this module
only points mlx-lm at it."""

from __future__ import annotations

import sys
import threading
from typing import Optional

from mlx_dualnorm._composite import Mode
from mlx_dualnorm.integrations.mlx_lm import (
    _release_check,
    full_attention,
    gated_delta,
    qwen3_like,
)
# Each shape module registers its attention families when imported.
from mlx_dualnorm.integrations.mlx_lm import head_norms, heads_first, heads_last  # noqa: F401
from mlx_dualnorm.integrations.mlx_lm import whole_projection  # noqa: F401
from mlx_dualnorm.integrations.mlx_lm._shared import (
    REPLACEMENT_MARKER,
    SUPPORTED_MLX_LM,
    log_fallback_once,
)
from mlx_dualnorm.integrations.mlx_lm.gated_delta import (
    GATED_DELTA_MODULE,
    ORIGINAL_NORMALIZE_QK,
    gated_delta_module,
)

PATCH_OPERATION = "mlx_lm.patch"

MLX_LM_PACKAGE = "mlx_lm"
PATCHED_ATTRIBUTE = "normalize_qk"

if ORIGINAL_NORMALIZE_QK is None:
    # An mlx-lm older than the replacements' release line: only attention
    # classes whose code is proven to be what a replacement reproduces are
    # ever patched (see _release_check); the others are never touched.
    _release_check.install_release_filter()


def _check_mlx_lm_supported() -> None:
    """On an mlx-lm without ``gated_delta.normalize_qk`` (0.31.x): warns
    once what the patch leaves there, or raises RuntimeError where it could
    change nothing at all (no attention class whose code it reproduces):
    saying so beats a silent no-op."""
    if ORIGINAL_NORMALIZE_QK is not None:
        return
    installed = _release_check.installed_mlx_lm(MLX_LM_PACKAGE)
    missing = f"{GATED_DELTA_MODULE}.{PATCHED_ATTRIBUTE}"
    engaged = [
        _release_check.class_name(attention_class)
        for attention_class in _release_check.registered_classes()
    ]
    if not engaged:
        raise RuntimeError(
            f"[{PATCH_OPERATION}] {installed} has no {missing}, the function this integration "
            "replaces, and none of its attention classes has the code the patch reproduces; "
            f"it supports {SUPPORTED_MLX_LM}: pip install 'mlx-lm==0.32.2'"
        )
    _release_check.say_what_is_left_once(PATCH_OPERATION, installed, missing, engaged)


def _is_ours_or_original(function) -> bool:
    if function is ORIGINAL_NORMALIZE_QK:
        return True
    try:
        return getattr(function, REPLACEMENT_MARKER, False) is True
    except Exception as error:  # an object whose attribute lookup raises: not ours
        log_fallback_once("patch", error, "leaves a module's normalize_qk as it is")
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
    # Without normalize_qk (an mlx-lm before 0.32.0) there is nothing to fold.
    has_normalize_qk = ORIGINAL_NORMALIZE_QK is not None
    if mode is _UNPATCHED:
        if has_normalize_qk:
            _point_mlx_lm_at(ORIGINAL_NORMALIZE_QK)
        full_attention._restore_full_attention_calls()
    else:
        if has_normalize_qk:
            _point_mlx_lm_at(gated_delta._replacement_for(mode))
        full_attention._install_full_attention_calls(mode)
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
            (releases before 0.32.0) and no attention class whose code the
            patch reproduces; the message names the supported releases. Where
            some classes are proven (mlx-lm 0.31.x), it patches those and
            warns once (RuntimeWarning) what it leaves.
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
        gated_delta._new_dual_head_norm(1e-6, mode).close()
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


def clear_cache() -> None:
    """Drops every cached fold (weights and compiled objects), every
    full-attention norm (+ RoPE) object and every q/k norm pair object; the
    next call of each key builds and probes it again."""
    gated_delta.clear_folds()
    full_attention.clear_norm_ropes()
    head_norms.clear_dual_norms()
