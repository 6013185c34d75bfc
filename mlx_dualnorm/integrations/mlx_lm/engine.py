"""The engine: which attention classes are patched, one decision per layer,
and what the patch did.

``install(mode)`` patches each registered attention class whose pieces are
all proven (:mod:`.registry`) by setting its ``__call__`` to a DISPATCHER;
a class with any piece unproven is left exactly as it is, and one warning
per process names it. The dispatcher decides once per layer, at its first
call, whether the layer engages (its family's ``engages``, and a proven
``__call__`` for each part the replacement computes itself), records that
in a table keyed by the layer's id (with a weak reference, so a new object
at a reused id is decided afresh), and from then on runs the decided
function: the replacement, or the class's own ``__call__``. Each
``install()`` (each ``patch()``) re-checks what the engaged decisions
relied on (the parts' code, MLX's fast functions) and drops those that
changed, so those layers decide again.

Nothing is stored on the layers and no class is generated, so a model
patched, deep-copied or pickled is the same object graph as unpatched:
a copy is decided at its own first call (or runs mlx-lm's code once
unpatched), and a pickle names mlx-lm's classes. ``restore()`` puts each
class's own ``__call__`` back, unless the user has replaced the
dispatcher since: then the user's stays.

``report()`` says what the patch engaged, per class: layers engaged,
layers left and why, calls through the package and calls that ran the
class's own code.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx

from mlx_dualnorm._composite import Mode
from mlx_dualnorm.integrations.mlx_lm import registry
from mlx_dualnorm.integrations.mlx_lm._shared import REPLACEMENT_MARKER, log_fallback_once
from mlx_dualnorm.integrations.mlx_lm.fingerprints import live_function

PATCH_OPERATION = "mlx_lm.patch"

SUBCLASS = "a subclass of mlx-lm's class, which keeps its own code"
MLX_FUNCTION_REPLACED = "mlx.core.fast.{name} is not MLX's own function"
# What an engaged layer's package call computed (note_prework).
NORM_ROPE = "norm + RoPE"
NORM_ONLY = "norm"
PART_UNPROVEN = "its {attribute} ({part}) runs code the patch was not proven on"

# The mode the installed replacements build their objects with (None: each
# object's default).
mode: Optional[Mode] = None


@dataclasses.dataclass
class _Tally:
    """One patched class since it was installed: its layers decided (alive
    or not: a command's model may be gone by the time it reports), and the
    calls of engaged layers, through the package and those that ran the
    class's own code."""

    engaged_layers: int = 0
    left_layers: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    calls: int = 0
    fallbacks: int = 0


@dataclasses.dataclass
class _Installed:
    family: registry.AttentionFamily
    original: Callable  # the class's own __call__, as it resolved before the patch
    inherited: bool  # the class had no __call__ of its own: restoring deletes ours
    dispatcher: Callable
    tally: _Tally


class _Decision(tuple):
    """(weak reference to the layer, the function it runs, engaged, reason
    left or None, its class's tally, the checks that keep it proven): one
    per decided layer. The checks are ``(owner, attribute, function,
    code)``: what ``owner.attribute`` resolved to when the layer was
    decided, and its code object (None for MLX's own functions)."""

    __slots__ = ()


# MLX's functions the package computes itself instead of calling them: a
# program that replaces one (a profiler's wrapper, say) changes what
# mlx-lm's norms and RoPEs compute, so no layer engages then.
MLX_FAST_FUNCTIONS = ("rms_norm", "rope")


def _mlx_function(name: str) -> object:
    """``mx.fast.NAME`` where it is MLX's own (a nanobind function of that
    name in ``mlx.core.fast``), else None."""
    function = getattr(mx.fast, name, None)
    is_mlx_s = (
        type(function).__name__ == "nb_func"
        and getattr(function, "__module__", None) == "mlx.core.fast"
        and getattr(function, "__name__", None) == name
    )
    return function if is_mlx_s else None


def replaced_mlx_functions() -> list[str]:
    """The names of :data:`MLX_FAST_FUNCTIONS` the program has replaced."""
    return [f"mlx.core.fast.{name}" for name in MLX_FAST_FUNCTIONS if _mlx_function(name) is None]


def _still_proven(checks: tuple) -> bool:
    """Whether everything a decision relied on still resolves as it did
    (read at each ``patch()``, so a norm, RoPE or MLX function changed
    after a layer's first call is followed from the next ``patch()``)."""
    for owner, attribute, function, code in checks:
        live = getattr(owner, attribute, None)
        if live is not function or (code is not None and live.__code__ is not code):
            return False
    return True


_state_lock = threading.RLock()
_installed: dict[type, _Installed] = {}
# class -> its own __call__, kept after restore() so a replacement still
# running (another thread) can reach it.
_originals: dict[type, Callable] = {}
# Registered classes this mlx-lm has whose pieces are not all proven:
# class -> the pieces that differ, at the last install.
unproven_classes: dict[type, list[str]] = {}

# id(layer) -> _Decision. Modules are dicts (unhashable), hence ids. No
# weakref callbacks (one could run inside the lock); dead entries are
# pruned whenever the table has doubled since the last pruning.
_decisions: dict[int, _Decision] = {}
_decisions_lock = threading.Lock()
_decisions_pruned_size = 64


def unpatched_function(owner: type, attribute: str) -> object:
    """What ``owner`` resolves ``attribute`` to, with the patch's own
    dispatchers replaced by the functions they stand for."""
    function = live_function(owner, attribute)
    if attribute == "__call__" and getattr(function, REPLACEMENT_MARKER, False) is True:
        for cls in owner.__mro__:
            installed = _installed.get(cls)
            if installed is not None and installed.dispatcher is function:
                return installed.original
        # A dispatcher of an earlier install that the program put back
        # (saved, then restored): the function it stands for.
        return getattr(function, "__wrapped__", function)
    return function


def original_call(layer: Any, *args: Any, **kwargs: Any) -> Any:
    """The class's own ``__call__`` for an engaged layer whose call cannot
    take the package's path (counted in the report)."""
    for cls in type(layer).__mro__:
        original = _originals.get(cls)
        if original is not None:
            installed = _installed.get(cls)
            if installed is not None:
                installed.tally.fallbacks += 1
            return original(layer, *args, **kwargs)
    return type(layer).__call__(layer, *args, **kwargs)  # never patched: its own


def _dispatcher(attention_class: type, installed_original: Callable):
    decisions = _decisions

    def dispatch(self, *args, **kwargs):
        # The decode path: one dict lookup and a weak reference per call.
        decision = decisions.get(id(self))
        if decision is None or decision[0]() is not self:
            if attention_class not in _installed:  # put back after an unpatch: its function
                return installed_original(self, *args, **kwargs)
            decision = _decide(self, attention_class)
        if decision[2]:
            decision[4].calls += 1
            if prework_log is not None:
                return _recorded_call(self, decision[1], args, kwargs)
        return decision[1](self, *args, **kwargs)

    setattr(dispatch, REPLACEMENT_MARKER, True)
    dispatch.__wrapped__ = installed_original  # type: ignore[attr-defined]
    dispatch.__qualname__ = f"{attention_class.__qualname__}.__call__"
    dispatch.__module__ = __name__
    return dispatch


# ---- What the package computed in each layer, while recording ---------------------
#
# Off (None) but while a tool records: then id(layer) -> the kinds of
# package call (NORM_ROPE, NORM_ONLY) its engaged calls made. The replacements'
# call sites say what they computed (note_prework), the dispatcher which
# layer is calling. For tools, not for concurrent use.
prework_log: Optional[dict[int, set[str]]] = None
_calling_layer: Optional[int] = None


def note_prework(kind: str) -> None:
    """Called where a replacement's package call succeeded, while
    :data:`prework_log` is set (the call sites test it first, so nothing
    is called when no tool records): ``kind`` is what it computed."""
    if prework_log is not None and _calling_layer is not None:
        prework_log.setdefault(_calling_layer, set()).add(kind)


def _recorded_call(layer: Any, function: Callable, args: tuple, kwargs: dict) -> Any:
    global _calling_layer
    outer, _calling_layer = _calling_layer, id(layer)
    try:
        return function(layer, *args, **kwargs)
    finally:
        _calling_layer = outer


@dataclasses.dataclass
class PreworkRecord:
    """What :func:`recording_prework` yields: ``prework_of(layer)`` names
    the package calls an engaged layer made while recording (``"norm +
    RoPE"``, ``"norm"``, or both joined by ``and``), None for a layer that
    made none. Read it while the layers are alive (it keys on their ids)."""

    by_layer: dict[int, set[str]] = dataclasses.field(default_factory=dict)

    def prework_of(self, layer: object) -> Optional[str]:
        kinds = self.by_layer.get(id(layer))
        return " and ".join(sorted(kinds)) if kinds else None


@contextlib.contextmanager
def recording_prework() -> Iterator[PreworkRecord]:
    """Records, per engaged layer, which package call its prework made, for
    the block (one thread at a time). For tools that say what ran where."""
    global prework_log
    record = PreworkRecord()
    outer, prework_log = prework_log, record.by_layer
    try:
        yield record
    finally:
        prework_log = outer


def _decide(layer: Any, attention_class: type) -> _Decision:
    """Decides for ``layer`` (again, where something its decision relied on
    has changed since) and records the outcome."""
    with _state_lock:
        installed = _installed.get(attention_class)
        original = _originals[attention_class]
        if installed is None:  # restored meanwhile: the class's own code
            return _Decision((weakref.ref(layer), original, False, None, _Tally(), ()))
        previous = _decisions.get(id(layer))
        if previous is not None and previous[0]() is layer:
            return previous  # another thread decided it first
        family = installed.family
        checks: tuple = ()
        reason: Optional[str] = None
        if type(layer) is not attention_class:
            reason = SUBCLASS
        else:
            reason, checks = _proven_parts(layer)
            if reason is None and not _family_engages(family, layer):
                reason = family.refusal
        if reason is not None:
            log_fallback_once(family.name, reason)
        engaged = reason is None
        decision = _Decision((
            weakref.ref(layer), family.call if engaged else original, engaged, reason,
            installed.tally, checks if engaged else (),
        ))
        if engaged:
            installed.tally.engaged_layers += 1
        else:
            installed.tally.left_layers[reason] += 1
        with _decisions_lock:
            _decisions[id(layer)] = decision
            _prune_decisions()
        return decision


def _uncount(decision: _Decision) -> None:
    """Takes a decision that is being replaced out of its class's tally."""
    tally = decision[4]
    if decision[2]:
        tally.engaged_layers -= 1
    else:
        tally.left_layers[decision[3]] -= 1
        if tally.left_layers[decision[3]] <= 0:
            del tally.left_layers[decision[3]]


def _family_engages(family: registry.AttentionFamily, layer: Any) -> bool:
    """``family.engages(layer)``; a predicate that raises leaves the layer
    to mlx-lm's code."""
    try:
        return family.engages(layer) is True
    except Exception as error:  # anything unexpected runs mlx-lm's own code instead
        log_fallback_once(family.name, error)
        return False


def _proven_parts(layer: Any) -> tuple[Optional[str], tuple]:
    """(why the layer may not engage, or None; the checks that keep it
    proven): every part the replacement computes itself (a norm or RoPE of
    :data:`.registry.REPRODUCED_PART_CLASSES`) must have a proven
    ``__call__``, and MLX's fast functions must be MLX's own."""
    checks: list[tuple[object, str, object, object]] = []
    for name in MLX_FAST_FUNCTIONS:
        function = _mlx_function(name)
        if function is None:
            return MLX_FUNCTION_REPLACED.format(name=name), ()
        checks.append((mx.fast, name, function, None))
    part_classes = _part_classes()
    items = layer.items() if isinstance(layer, dict) else ()
    for attribute, part in items:
        part_class = type(part)
        if part_class not in part_classes:
            continue
        function = live_function(part_class, "__call__")
        if not registry.is_proven_function(registry.piece_name(part_class, "__call__"), function):
            return PART_UNPROVEN.format(attribute=attribute, part=registry.class_name(part_class)), ()
        checks.append((part_class, "__call__", function, getattr(function, "__code__", None)))
    return None, tuple(dict.fromkeys(checks))


_part_class_set: Optional[frozenset] = None


def _part_classes() -> frozenset:
    global _part_class_set
    if _part_class_set is None:
        _part_class_set = frozenset(registry.reproduced_part_classes())
    return _part_class_set


def _prune_decisions() -> None:
    """Drops the entries of collected layers once the table has doubled;
    the caller holds _decisions_lock."""
    global _decisions_pruned_size
    if len(_decisions) < 2 * _decisions_pruned_size:
        return
    for layer_id, decision in list(_decisions.items()):
        if decision[0]() is None:
            del _decisions[layer_id]
    _decisions_pruned_size = max(64, len(_decisions))


def decision_of(layer: Any) -> Optional[tuple[bool, Optional[str]]]:
    """(engaged, reason left) for a layer the patch has decided (a subclass
    of a patched class included), else None."""
    decision = _decisions.get(id(layer))
    if decision is None or decision[0]() is not layer:
        return None
    return decision[2], decision[3]


def is_installed(attention_class: type) -> bool:
    """Whether ``attention_class`` runs the patch's dispatcher now."""
    installed = _installed.get(attention_class)
    return installed is not None and attention_class.__dict__.get("__call__") is installed.dispatcher


def install(new_mode: Optional[Mode]) -> None:
    """Patches every registered class whose pieces are proven; the caller
    holds the patch's state lock."""
    global mode
    with _state_lock:
        mode = new_mode
        unproven_classes.clear()
        for attention_class, family in registry.families_by_class().items():
            installed = _installed.get(attention_class)
            if installed is not None and not is_installed(attention_class):
                del _installed[attention_class]  # the user replaced our dispatcher
                installed = None
            unproven = registry.unproven_attributes(
                attention_class, family.pieces, unpatched_function
            )
            if unproven:
                unproven_classes[attention_class] = unproven
                if installed is not None:
                    _uninstall(attention_class, installed)
                continue
            if installed is not None:
                continue  # already patched: its layers keep their decisions (but see below)
            original = unpatched_function(attention_class, "__call__")
            inherited = "__call__" not in attention_class.__dict__
            dispatcher = _dispatcher(attention_class, original)  # type: ignore[arg-type]
            _installed[attention_class] = _Installed(
                family, original, inherited, dispatcher, _Tally()  # type: ignore[arg-type]
            )
            _originals[attention_class] = original  # type: ignore[assignment]
            attention_class.__call__ = dispatcher  # type: ignore[method-assign]
        _forget_changed_decisions()


def _forget_changed_decisions() -> None:
    """Drops the decisions whose norms, RoPEs or MLX functions no longer
    resolve as they did (the layers decide again at their next call)."""
    with _decisions_lock:
        changed = [
            layer_id for layer_id, decision in _decisions.items()
            if decision[2] and not _still_proven(decision[5])
        ]
        for layer_id in changed:
            _uncount(_decisions.pop(layer_id))


def _uninstall(attention_class: type, installed: _Installed) -> None:
    if attention_class.__dict__.get("__call__") is installed.dispatcher:
        if installed.inherited:
            del attention_class.__call__  # type: ignore[method-assign]
        else:
            attention_class.__call__ = installed.original  # type: ignore[method-assign]
    del _installed[attention_class]


def restore() -> None:
    """Every patched class back to its own ``__call__`` (a class whose
    dispatcher the user has replaced keeps the user's), every decision
    dropped: layers decide again at their next patched call."""
    with _state_lock:
        for attention_class, installed in list(_installed.items()):
            _uninstall(attention_class, installed)
        with _decisions_lock:
            _decisions.clear()


def patched_classes() -> list[type]:
    """The classes that run the dispatcher now."""
    with _state_lock:
        return [cls for cls in _installed if is_installed(cls)]


# ---- What the patch did --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ClassReport:
    """One registered attention class: ``patched`` (its pieces proven and
    the dispatcher installed), or ``unproven`` naming the pieces whose code
    differs; since it was patched, the layers decided (``engaged_layers``,
    and ``left_layers``: reason -> layers; subclasses of it count as left),
    ``calls`` through the package and ``fallbacks`` (calls of engaged
    layers that ran the class's own code)."""

    name: str
    patched: bool
    unproven: tuple[str, ...]
    engaged_layers: int
    left_layers: dict[str, int]
    calls: int
    fallbacks: int


@dataclasses.dataclass(frozen=True)
class PatchReport:
    """What :func:`report` returns: the mlx-lm release, whether the patch is
    on, one :class:`ClassReport` per class it patched or left unproven, the
    gated-delta folds built, and the patched ``normalize_qk``'s calls in
    this process (``normalize_qk_calls``, of which ``normalize_qk_original``
    ran mlx-lm's function)."""

    mlx_lm: str
    patched: bool
    classes: tuple[ClassReport, ...]
    folds: int
    normalize_qk_calls: int = 0
    normalize_qk_original: int = 0

    @property
    def engaged_layers(self) -> int:
        return sum(entry.engaged_layers for entry in self.classes)

    @property
    def left_layers(self) -> int:
        return sum(sum(entry.left_layers.values()) for entry in self.classes)

    @property
    def calls(self) -> int:
        return sum(entry.calls - entry.fallbacks for entry in self.classes)

    def summary(self) -> str:
        """One line: layers engaged (by class) and left since the patch,
        package calls, and the classes left unproven."""
        if not self.patched:
            return f"mlx_dualnorm: not patched ({self.mlx_lm})"
        engaged: collections.Counter = collections.Counter()
        for entry in self.classes:
            if entry.engaged_layers:
                engaged[entry.name.removeprefix("mlx_lm.models.")] += entry.engaged_layers
        parts = [
            f"mlx_dualnorm: {self.engaged_layers} attention layers engaged"
            + (f" ({', '.join(f'{name} {count}' for name, count in sorted(engaged.items()))})"
               if engaged else ""),
            f"{self.left_layers} left to mlx-lm",
            f"{self.calls} package calls",
        ]
        fallbacks = sum(entry.fallbacks for entry in self.classes)
        if fallbacks:
            parts.append(f"{fallbacks} calls ran mlx-lm's code")
        if self.folds:
            parts.append(f"{self.folds} gated-delta folds")
        unproven = [entry.name for entry in self.classes if entry.unproven]
        if unproven:
            parts.append(f"{len(unproven)} classes left unproven on {self.mlx_lm}")
        return "; ".join(parts)


def class_reports() -> tuple[ClassReport, ...]:
    """One :class:`ClassReport` per patched or unproven class."""
    with _state_lock:
        entries = []
        for attention_class, installed in _installed.items():
            tally = installed.tally
            entries.append(ClassReport(
                registry.class_name(attention_class), is_installed(attention_class), (),
                tally.engaged_layers, dict(tally.left_layers), tally.calls, tally.fallbacks,
            ))
        for attention_class, pieces in unproven_classes.items():
            entries.append(ClassReport(
                registry.class_name(attention_class), False, tuple(pieces), 0, {}, 0, 0,
            ))
        return tuple(sorted(entries, key=lambda entry: entry.name))


def installed_mlx_lm() -> str:
    version = getattr(sys.modules.get("mlx_lm"), "__version__", None)
    return f"mlx-lm {version}" if isinstance(version, str) else "the installed mlx-lm"


_warned_unproven = False


def warn_unproven_once(unproven: dict[str, str]) -> None:
    """One RuntimeWarning per process: the release, and one short line per
    class (or function) left to its own code, saying what differs."""
    global _warned_unproven
    if _warned_unproven or not unproven:
        return
    _warned_unproven = True
    count = len(unproven)
    lines = [
        f"[{PATCH_OPERATION}] {installed_mlx_lm()}: {count} of the classes and functions the "
        f"patch covers {'runs its' if count == 1 else 'run their'} own code, which is not the "
        "code the patch was proven on; the rest is patched (all of it is proven on mlx-lm "
        "0.32.2):"
    ]
    lines += [f"  {name}: {what}" for name, what in sorted(unproven.items())]
    warnings.warn("\n".join(lines), RuntimeWarning, stacklevel=4)  # the caller of patch()
