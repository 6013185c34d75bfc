"""The public switch: :func:`patch`, :func:`unpatch`, their blocks, and
which function mlx-lm's modules hold. Each layer shape (one module here
per shape) registers what is installed, the registry says what must be
proven first, and :mod:`.engine` installs it; this module decides when.

:func:`patch` is all or nothing: it reads what it would install and says
what it leaves (raising, or warning, where a warning filter may raise)
before it changes anything, so any exception leaves the process as it
was. Each call is a HOLD of the setting it installs, which remembers the
setting it found: a block's hold ends with the block and brings that back
where it is the newest hold, or hands it to the next newer hold where it
is not. So blocks nest, blocks of several threads overlap (the patch
stays on until the last one ends), and a plain :func:`unpatch` outside any
block turns the patch off for good.
"""

from __future__ import annotations

import sys
import weakref
from typing import Optional

from mlx_dualnorm._composite import _MODES, Mode
from mlx_dualnorm.integrations.mlx_lm import engine, gated_delta, registry

# Each shape module registers its attention families when imported.
from mlx_dualnorm.integrations.mlx_lm import qwen3, qwen3_like  # noqa: F401  (isort: skip)
from mlx_dualnorm.integrations.mlx_lm import norm_after_transpose  # noqa: F401
from mlx_dualnorm.integrations.mlx_lm import norm_before_transpose  # noqa: F401
from mlx_dualnorm.integrations.mlx_lm import whole_projection  # noqa: F401
from mlx_dualnorm.integrations.mlx_lm import rope_only  # noqa: F401
from mlx_dualnorm.integrations.mlx_lm import cache_update, head_norms, norm_rope
from mlx_dualnorm.integrations.mlx_lm import report as reports
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
from mlx_dualnorm.integrations.mlx_lm.state import STATE, Hold

MLX_LM_PACKAGE = "mlx_lm"
PATCHED_ATTRIBUTE = "normalize_qk"


def _normalize_qk_is_proven() -> bool:
    return ORIGINAL_NORMALIZE_QK is not None and registry.is_proven_function(
        registry.NORMALIZE_QK_PIECE, ORIGINAL_NORMALIZE_QK
    )


def _unproven_pieces(install_plan: engine.Plan) -> dict[str, str]:
    """Class, function or module name -> what of it is not the recorded
    code (or why it was left alone), for everything the registry names:
    what the warning lists."""
    unproven = {
        registry.class_name(cls): ", ".join(pieces)
        for cls, pieces in install_plan.unproven.items()
    }
    for part_class in registry.reproduced_part_classes():
        pieces = registry.unproven_attributes(part_class, ("__call__",))
        if pieces:
            unproven[registry.class_name(part_class)] = ", ".join(pieces)
    for name, methods in registry.unproven_cache_methods().items():
        unproven[name] = ", ".join(methods)
    for name in engine.replaced_mlx_functions():
        unproven[name] = "not MLX's own function: no attention layer engages"
    if ORIGINAL_NORMALIZE_QK is None:
        if gated_delta_module is not None:
            unproven[registry.NORMALIZE_QK_PIECE] = (
                "absent: gated-delta layers run mlx-lm's code (no fold)"
            )
    elif not _normalize_qk_is_proven():
        unproven[registry.NORMALIZE_QK_PIECE] = "its code: gated-delta layers run it (no fold)"
    for module_name, error in STATE.import_failures.items():
        unproven[module_name] = f"does not import ({error}): left alone"
    return unproven


def _say_what_is_left(install_plan: engine.Plan) -> None:
    """Before an install: raises RuntimeError where the patch could change
    nothing at all (no class and no normalize_qk proven), else warns once
    per process what runs its own code."""
    if not install_plan.proven and not _normalize_qk_is_proven():
        raise RuntimeError(
            f"[{PATCH_OPERATION}] {reports.installed_mlx_lm()} has none of the code the patch "
            f"was proven on: nothing would change; it supports {SUPPORTED_MLX_LM}: "
            "pip install 'mlx-lm==0.32.2'"
        )
    reports.warn_unproven_once(_unproven_pieces(install_plan))


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


def _modules_to_point(function) -> list:
    """The loaded modules whose ``normalize_qk`` :func:`_point_mlx_lm_at`
    sets: gated_delta and every mlx-lm module that holds the original or one
    of our replacements (a function the user put there stays)."""
    found = []
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
            found.append(module)
    return found


def _point_mlx_lm_at(function) -> None:
    """Sets ``normalize_qk`` where :func:`_modules_to_point` says. Modules
    imported later copy gated_delta's attribute, whichever it is then."""
    for module in _modules_to_point(function):
        setattr(module, PATCHED_ATTRIBUTE, function)


def _install(patched: bool, mode) -> None:
    """Installs what ``(patched, mode)`` says, with every check that can
    fail run first; the caller holds ``STATE.lock``."""
    if not patched:
        if ORIGINAL_NORMALIZE_QK is not None:
            _point_mlx_lm_at(ORIGINAL_NORMALIZE_QK)
        engine.restore()
        STATE.patched, STATE.mode = False, None
        return
    install_plan = engine.plan()
    _say_what_is_left(install_plan)
    replacement = gated_delta._replacement_for(mode) if _normalize_qk_is_proven() else None
    # Nothing past this line raises: the checks are done.
    if replacement is not None:
        _point_mlx_lm_at(replacement)
    cache_update.forget_cache_proofs()
    engine.install(install_plan, mode)
    STATE.patched = True


def _take_hold(hold: Hold) -> None:
    """Installs ``hold``'s setting and adds it as the newest hold; raises
    (nothing changed) where the install does."""
    with STATE.lock:
        previous = (STATE.patched, STATE.mode)
        _install(hold.patched, hold.mode)
        hold.previous = previous
        STATE.holds = _merged(STATE.holds) + [hold]


def _merged(holds: list) -> list:
    """``holds`` with each run of one thread's plain calls (no block can end
    between them) as its newest call, which takes the oldest's
    ``previous``: the list stays as long as the blocks open, twice over."""
    merged: list = []
    for hold in holds:
        last = merged[-1] if merged else None
        if last is not None and last.is_plain() and hold.is_plain() and last.thread == hold.thread:
            hold.previous = last.previous
            merged[-1] = hold
        else:
            merged.append(hold)
    return merged


def _release(hold: Hold) -> None:
    """Ends a block's ``hold``. The plain calls its thread made inside the
    block end with it. Where the newest hold ends, the setting it found
    comes back; where an older one ends (another thread's block is still
    open, or a plain call was made since in another thread), the next newer
    hold takes over what it found, so the last block to end restores it."""
    with STATE.lock:
        holds = STATE.holds
        if not any(held is hold for held in holds):
            return
        start = next(index for index, held in enumerate(holds) if held is hold)
        ending = [hold] + [
            held for held in holds[start + 1:] if held.thread == hold.thread and held.is_plain()
        ]
        target = None
        for held in reversed(ending):
            index = next(index for index, other in enumerate(holds) if other is held)
            if index == len(holds) - 1:
                target = held.previous
            else:
                holds[index + 1].previous = held.previous
            del holds[index]
        if target is not None and target != (STATE.patched, STATE.mode):
            _install(*target)


class MlxLmPatch:
    """What :func:`patch` and :func:`unpatch` return. The change is made
    already; used as a context manager, leaving the block brings back the
    setting from before the call, so nested blocks unwind in order, and of
    blocks that overlap in several threads the last to end restores it."""

    __slots__ = ("patched", "mode", "_hold", "__weakref__")

    def __init__(self, patched: bool, mode: Optional[Mode]) -> None:
        self.patched = patched
        self.mode = mode
        self._hold = Hold(patched, mode, weakref.ref(self))

    def __enter__(self) -> "MlxLmPatch":
        return self

    def __exit__(self, *exc_info: object) -> None:
        _release(self._hold)

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
        use as ``with patch(): ...`` to undo it at the end of the block
        (blocks nest, and overlap across threads: the patch stays on until
        the last one ends). Patching again is harmless; a plain
        :func:`unpatch` undoes every plain patch.

    Raises:
        TypeError: ``mode`` is not a str (or None).
        ValueError: ``mode`` names no mode, or cannot run here.
        RuntimeError: nothing the patch covers has the code it was proven
            on (no attention class, no ``normalize_qk``); the message names
            the supported releases. Where some of it differs (a newer or
            older mlx-lm, a class changed by the program), the rest is
            patched, what differs runs its own code, and one RuntimeWarning
            per process names it.
        Any of these, or the warning raised as an error by a warning
        filter, leaves the process as it was before the call.
    """
    if mode is not None:
        _check_mode(mode)
    handle = MlxLmPatch(True, mode)
    _take_hold(handle._hold)
    return handle


def _check_mode(mode: Mode) -> None:
    names = ", ".join(map(repr, _MODES))
    if not isinstance(mode, str):
        raise TypeError(
            f"[{PATCH_OPERATION}] mode must be None or one of {names}, "
            f"not {type(mode).__name__}"
        )
    if mode not in _MODES:
        raise ValueError(f"[{PATCH_OPERATION}] mode must be None or one of {names}, not {mode!r}")
    try:
        gated_delta._new_dual_head_norm(1e-6, mode).close()
    except (TypeError, ValueError) as error:
        raise ValueError(f"[{PATCH_OPERATION}] mode {mode!r} cannot run here: {error}") from error


def unpatch() -> MlxLmPatch:
    """Puts mlx-lm's own code back everywhere, now; harmless when not
    patched. As ``with unpatch(): ...``, the block runs mlx-lm's code and
    the setting in force before it comes back after it."""
    handle = MlxLmPatch(False, None)
    _take_hold(handle._hold)
    return handle


def is_patched() -> bool:
    """Whether the patch is on (what it engaged: :func:`report`)."""
    return STATE.patched


def report() -> reports.PatchReport:
    """What the patch engaged in this process: per registered attention
    class, whether it is patched or left unproven (and which pieces
    differ), its layers engaged and left (and why), and
    its calls through the package (layers counted as they are decided,
    alive or not); the gated-delta folds built and the patched
    ``normalize_qk``'s calls.
    ``report().summary()`` says it in one line."""
    calls = gated_delta.call_counts
    return reports.PatchReport(
        reports.installed_mlx_lm(), is_patched(), reports.class_reports(),
        gated_delta.fold_count(), calls["calls"], calls["original"],
    )


def clear_cache() -> None:
    """Drops every cached fold (weights and compiled objects), every
    full-attention norm (+ RoPE) object and every q/k norm pair object; the
    next call of each key builds and probes it again."""
    gated_delta.clear_folds()
    norm_rope.clear_norm_ropes()
    head_norms.clear_dual_norms()
