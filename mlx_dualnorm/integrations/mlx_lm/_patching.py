"""Installing and restoring the patch: which function mlx-lm's modules
hold, which attention classes run the engine's dispatcher, and the state
that :func:`patch` and :func:`unpatch` save and bring back. Each layer
shape (one module here per shape) registers what is installed, the
registry says what must be proven first, and :mod:`.engine` installs it;
this module only points mlx-lm at it."""

from __future__ import annotations

import sys
import threading
from typing import Optional

from mlx_dualnorm._composite import Mode
from mlx_dualnorm.integrations.mlx_lm import engine, gated_delta, registry

# Each shape module registers its attention families when imported.
from mlx_dualnorm.integrations.mlx_lm import qwen3, qwen3_like  # noqa: F401  (isort: skip)
from mlx_dualnorm.integrations.mlx_lm import norm_after_transpose  # noqa: F401
from mlx_dualnorm.integrations.mlx_lm import norm_before_transpose  # noqa: F401
from mlx_dualnorm.integrations.mlx_lm import whole_projection  # noqa: F401
from mlx_dualnorm.integrations.mlx_lm import cache_update, head_norms, norm_rope
from mlx_dualnorm.integrations.mlx_lm._shared import (
    REPLACEMENT_MARKER,
    SUPPORTED_MLX_LM,
    log_fallback_once,
)
from mlx_dualnorm.integrations.mlx_lm.engine import PATCH_OPERATION
from mlx_dualnorm.integrations.mlx_lm.gated_delta import (
    ORIGINAL_NORMALIZE_QK,
    gated_delta_module,
)

MLX_LM_PACKAGE = "mlx_lm"
PATCHED_ATTRIBUTE = "normalize_qk"


def _normalize_qk_is_proven() -> bool:
    return ORIGINAL_NORMALIZE_QK is not None and registry.is_proven_function(
        registry.NORMALIZE_QK_PIECE, ORIGINAL_NORMALIZE_QK
    )


def _unproven_pieces() -> dict[str, str]:
    """Class (or function) name -> what of it is not the recorded code, for
    everything the registry names: what the warning lists. Read after the
    engine's install."""
    unproven = {
        registry.class_name(cls): ", ".join(pieces)
        for cls, pieces in engine.unproven_classes.items()
    }
    for part_class in registry.reproduced_part_classes():
        pieces = registry.unproven_attributes(part_class, ("__call__",))
        if pieces:
            unproven[registry.class_name(part_class)] = ", ".join(pieces)
    for cache_class, (_, methods) in registry.written_cache_classes().items():
        pieces = registry.unproven_attributes(cache_class, methods)
        if pieces:
            unproven[registry.class_name(cache_class)] = ", ".join(pieces)
    for name in engine.replaced_mlx_functions():
        unproven[name] = "not MLX's own function: no attention layer engages"
    if ORIGINAL_NORMALIZE_QK is None:
        if gated_delta_module is not None:
            unproven[registry.NORMALIZE_QK_PIECE] = (
                "absent: gated-delta layers run mlx-lm's code (no fold)"
            )
    elif not _normalize_qk_is_proven():
        unproven[registry.NORMALIZE_QK_PIECE] = "its code: gated-delta layers run it (no fold)"
    return unproven


def _say_what_is_left() -> None:
    """After an install: raises RuntimeError where the patch could change
    nothing at all (no class and no normalize_qk proven), else warns once
    per process what runs its own code."""
    if not engine.patched_classes() and not _normalize_qk_is_proven():
        raise RuntimeError(
            f"[{PATCH_OPERATION}] {engine.installed_mlx_lm()} has none of the code the patch "
            f"was proven on: nothing would change; it supports {SUPPORTED_MLX_LM}: "
            "pip install 'mlx-lm==0.32.2'"
        )
    engine.warn_unproven_once(_unproven_pieces())


def _is_ours_or_original(function) -> bool:
    """mlx-lm's normalize_qk or one of this package's replacements (by
    identity: a user's wrapper made with functools.wraps copies the marker
    too, and stays where the user put it)."""
    if function is ORIGINAL_NORMALIZE_QK or gated_delta.is_replacement(function):
        return True
    try:
        marked = getattr(function, REPLACEMENT_MARKER, False) is True
    except Exception as error:  # an object whose attribute lookup raises: not ours
        log_fallback_once("patch", error, "leaves a module's normalize_qk as it is")
        return False
    # A replacement of another copy of this package (reloaded): marked, and
    # not a wrapper of one.
    return marked and getattr(function, "__wrapped__", None) is ORIGINAL_NORMALIZE_QK


def _point_mlx_lm_at(function) -> None:
    """Sets ``normalize_qk`` in gated_delta and in every loaded mlx-lm module
    that holds the original or one of our replacements (a function the
    user put there stays). Modules imported later copy gated_delta's
    attribute, whichever it is then."""
    for module_name, module in list(sys.modules.items()):
        if module is None or not (
            module is gated_delta_module
            or module_name == MLX_LM_PACKAGE
            or module_name.startswith(MLX_LM_PACKAGE + ".")
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
    # Without normalize_qk (an mlx-lm before 0.32.0) there is nothing to
    # fold; where its code is not the recorded one, it is left as it is.
    if mode is _UNPATCHED:
        if ORIGINAL_NORMALIZE_QK is not None:
            _point_mlx_lm_at(ORIGINAL_NORMALIZE_QK)
        engine.restore()
    else:
        if _normalize_qk_is_proven():
            _point_mlx_lm_at(gated_delta._replacement_for(mode))
        cache_update.forget_cache_proofs()
        engine.install(mode)
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
    """Routes mlx-lm's q/k prework through mlx_dualnorm, now, wherever its
    code is the code the patch was proven on.

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
        RuntimeError: nothing the patch covers has the code it was proven
            on (no attention class, no ``normalize_qk``); the message names
            the supported releases. Where some of it differs (a newer or
            older mlx-lm, a class changed by the program), the rest is
            patched, what differs runs its own code, and one RuntimeWarning
            per process names it.
    """
    if mode is not None:
        _check_mode(mode)
    with _patch_state_lock:
        handle = MlxLmPatch(True, mode, _installed_mode)
        _install(mode)
        try:
            _say_what_is_left()
        except RuntimeError:
            _install(handle._previous_state)
            raise
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
    """Whether the patch is on (what it engaged: :func:`report`)."""
    return _installed_mode is not _UNPATCHED


def report() -> engine.PatchReport:
    """What the patch engaged in this process: per registered attention
    class, whether it is patched or left unproven (and which pieces
    differ), its layers engaged and left (and why), and
    its calls through the package (layers counted as they are decided,
    alive or not); the gated-delta folds built and the patched
    ``normalize_qk``'s calls.
    ``report().summary()`` says it in one line."""
    calls = gated_delta.call_counts
    return engine.PatchReport(
        engine.installed_mlx_lm(), is_patched(), engine.class_reports(), gated_delta.fold_count(),
        calls["calls"], calls["original"],
    )


def clear_cache() -> None:
    """Drops every cached fold (weights and compiled objects), every
    full-attention norm (+ RoPE) object and every q/k norm pair object; the
    next call of each key builds and probes it again."""
    gated_delta.clear_folds()
    norm_rope.clear_norm_ropes()
    head_norms.clear_dual_norms()
