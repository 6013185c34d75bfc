"""The engine: which attention classes are patched, and one decision per
layer that holds only while what it relied on is as it was.

:func:`plan` says, without changing anything, which registered attention
classes have every piece proven (:mod:`.registry`); :func:`install` then
sets each such class's ``__call__`` to a DISPATCHER (a class with any piece
unproven is left exactly as it is). The dispatcher decides for a layer at
its first call whether it engages (its family's ``engages``, a proven
``__call__`` for each part the replacement computes itself, MLX's own
``mx.fast`` functions) and records that, keyed by the layer's id (with a
weak reference, so a new object at a reused id is decided afresh). At every
call it then tests, by identity, what the decision relied on: the
functions ``mx.fast.rms_norm`` and ``mx.fast.rope``, each part class's
``__call__``, and the layer's submodules themselves (a part swapped for an
instance of another class is decided on that class); where one differs
the layer is decided again at that call.
An engaged layer's switches (attributes its class's code reads at every
call, such as ``use_qk_norm``) are tested at every call too; where one
differs that call runs the class's own code. Proof itself (fingerprints)
is taken once per function object, in the registry.

Nothing is stored on the layers and no class is generated, so a model
patched, deep-copied or pickled is the same object graph as unpatched:
a copy is decided at its own first call (or runs mlx-lm's code once
unpatched), and a pickle names mlx-lm's classes. ``restore()`` puts each
class's own ``__call__`` back, unless the user has replaced the
dispatcher since: then the user's stays.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_dualnorm._composite import Mode
from mlx_dualnorm.integrations.mlx_lm import registry
from mlx_dualnorm.integrations.mlx_lm._shared import (
    REPLACEMENT_MARKER,
    is_mlx_function,
    log_fallback_once,
)
from mlx_dualnorm.integrations.mlx_lm.fingerprints import live_function
from mlx_dualnorm.integrations.mlx_lm.gated_delta import ORIGINAL_NORMALIZE_QK
from mlx_dualnorm.integrations.mlx_lm.prework_log import recorded_call
from mlx_dualnorm.integrations.mlx_lm.state import STATE, Decision, Installed, Tally

PATCH_OPERATION = "mlx_lm.patch"

SUBCLASS = "a subclass of mlx-lm's class, which keeps its own code"
MLX_FUNCTION_REPLACED = "mlx.core.fast.{name} is not MLX's own function"
PART_UNPROVEN = "its {attribute} ({part}) runs code the patch was not proven on"
UNSTABLE = "its {attribute} ({part}) resolves __call__ to a new object at each lookup"

# MLX's functions the package computes itself instead of calling them: a
# program that replaces one (a profiler's wrapper, say) changes what
# mlx-lm's norms and RoPEs compute, so no layer engages then.
MLX_FAST_FUNCTIONS = ("rms_norm", "rope")

# Submodules a decision does not hold by: MLX's projections, which every
# replacement calls through their own code (as mlx-lm does), so a swapped
# one changes nothing the decision relied on. One identity test a call less each.
PROJECTIONS = frozenset({nn.Linear, nn.QuantizedLinear})


def replaced_mlx_functions() -> list[str]:
    """The names of :data:`MLX_FAST_FUNCTIONS` the program has replaced."""
    return [
        f"mlx.core.fast.{name}" for name in MLX_FAST_FUNCTIONS
        if not is_mlx_function(name, getattr(mx.fast, name, None))
    ]


def unpatched_function(owner: type, attribute: str) -> object:
    """What ``owner`` resolves ``attribute`` to, with the patch's own
    dispatchers replaced by the functions they stand for."""
    function = live_function(owner, attribute)
    if attribute == "__call__" and getattr(function, REPLACEMENT_MARKER, False) is True:
        for cls in owner.__mro__:
            installed = STATE.installed.get(cls)
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
        original = STATE.originals.get(cls)
        if original is not None:
            installed = STATE.installed.get(cls)
            if installed is not None:
                installed.tally.fallbacks += 1
            return original(layer, *args, **kwargs)
    return type(layer).__call__(layer, *args, **kwargs)  # never patched: its own


def _dispatcher(attention_class: type, installed_original: Callable):
    decisions = STATE.decisions
    installed_classes = STATE.installed
    item = dict.get  # a module's submodule, read without Module.__getattr__

    def dispatch(self, *args, **kwargs):
        # The decode path: a dict lookup, a weak reference and a few
        # identity tests per call.
        decision = decisions.get(id(self))
        if decision is not None and decision.layer() is self:
            for owner, attribute, value in decision.checks:
                if getattr(owner, attribute, None) is not value:
                    decision = None
                    break
            else:
                for name, part in decision.parts:
                    if item(self, name) is not part:
                        decision = None
                        break
        else:
            decision = None
        if decision is None:
            if attention_class not in installed_classes:  # put back after an unpatch
                return installed_original(self, *args, **kwargs)
            decision = _decide(self, attention_class)
        if decision.engaged:
            for attribute, value in decision.switches:
                if getattr(self, attribute, None) is not value:
                    return original_call(self, *args, **kwargs)
            decision.tally.calls += 1
            if STATE.prework_log is not None:
                return recorded_call(self, decision.function, (decision.mode, *args), kwargs)
            return decision.function(self, decision.mode, *args, **kwargs)
        return decision.function(self, *args, **kwargs)

    setattr(dispatch, REPLACEMENT_MARKER, True)
    dispatch.__wrapped__ = installed_original  # type: ignore[attr-defined]
    dispatch.__qualname__ = f"{attention_class.__qualname__}.__call__"
    dispatch.__module__ = __name__
    return dispatch


# ---- Deciding ---------------------------------------------------------------------


def _decide(layer: Any, attention_class: type) -> Decision:
    """Decides for ``layer`` (again, where something its decision relied on
    has changed since) and records the outcome."""
    with STATE.lock:
        installed = STATE.installed.get(attention_class)
        original = STATE.originals[attention_class]
        if installed is None:  # restored meanwhile: the class's own code
            return Decision(weakref.ref(layer), original, False, None, Tally())
        previous = STATE.decisions.get(id(layer))
        if previous is not None and previous.layer() is layer:
            if previous.holds():
                return previous  # another thread decided it first
            previous.uncount()
        family = installed.family
        reason, checks, parts = _live_checks(layer)
        if type(layer) is not attention_class:
            reason = SUBCLASS
        elif reason is None and not _family_engages(family, layer):
            reason = family.refusal
        if reason is not None:
            log_fallback_once(family.name, reason)
        engaged = reason is None
        decision = Decision(
            weakref.ref(layer), family.call if engaged else original, engaged, reason,
            installed.tally, checks, parts, family.switches if engaged else (),
            installed.mode,
        )
        if engaged:
            installed.tally.engaged_layers += 1
        else:
            installed.tally.left_layers[reason] += 1
        with STATE.decisions_lock:
            STATE.decisions[id(layer)] = decision
            _prune_decisions()
        return decision


def _family_engages(family: registry.AttentionFamily, layer: Any) -> bool:
    """``family.engages(layer)``; a predicate that raises leaves the layer
    to mlx-lm's code."""
    try:
        return family.engages(layer) is True
    except Exception as error:  # anything unexpected runs mlx-lm's own code instead
        log_fallback_once(family.name, error)
        return False


def _live_checks(layer: Any) -> tuple[Optional[str], tuple, tuple]:
    """(why the layer may not engage, or None; the identity checks its
    decision holds by; its submodules as ``(name, module)``, which the
    decision holds by too: a part swapped for an instance of a class none
    of the checks covers, one whose ``__call__`` was replaced, say, is
    decided again): MLX's fast functions must be MLX's own, and every
    part whose class is one the replacements compute (one of
    :data:`.registry.REPRODUCED_PART_CLASSES`, as its module defines it) must
    resolve ``__call__`` to proven code (any other class, a subclass or a
    class bound to the name since included, is refused by the replacements'
    exact type tests). The checks hold what each resolves to now, whatever the
    verdict, so a change either way is followed at the next call."""
    checks: list[tuple[object, str, object]] = []
    reason: Optional[str] = None
    for name in MLX_FAST_FUNCTIONS:
        function = getattr(mx.fast, name, None)
        checks.append((mx.fast, name, function))
        if reason is None and not is_mlx_function(name, function):
            reason = MLX_FUNCTION_REPLACED.format(name=name)
    part_classes = registry.reproduced_part_class_set()
    items = layer.items() if isinstance(layer, dict) else ()
    parts = tuple(
        (name, item) for name, item in items
        if isinstance(item, nn.Module) and type(item) not in PROJECTIONS
    )
    for attribute, part in parts:
        part_class = type(part)
        if part_class not in part_classes:
            continue
        call = getattr(part_class, "__call__", None)
        check = (part_class, "__call__", call)
        if check in checks:
            continue
        if getattr(part_class, "__call__", None) is not call:
            reason = reason or UNSTABLE.format(
                attribute=attribute, part=registry.class_name(part_class)
            )
            continue
        checks.append(check)
        code = getattr(call, "__code__", None)
        if code is not None:  # a reloader swaps the code of the same function
            checks.append((call, "__code__", code))
        function = live_function(part_class, "__call__")
        piece = registry.piece_name(part_class, "__call__")
        if reason is None and not (
            function is call and registry.is_proven_function(piece, function)
        ):
            reason = PART_UNPROVEN.format(attribute=attribute, part=registry.class_name(part_class))
    return reason, tuple(checks), parts


def _prune_decisions() -> None:
    """Drops the entries of collected layers once the table has doubled;
    the caller holds the decisions' lock."""
    decisions = STATE.decisions
    if len(decisions) < 2 * STATE.decisions_pruned_size:
        return
    for layer_id, decision in list(decisions.items()):
        if decision.layer() is None:
            del decisions[layer_id]
    STATE.decisions_pruned_size = max(64, len(decisions))


def decision_of(layer: Any) -> Optional[tuple[bool, Optional[str]]]:
    """(engaged, reason left) for a layer the patch has decided (a subclass
    of a patched class included), else None."""
    decision = STATE.decisions.get(id(layer))
    if decision is None or decision.layer() is not layer:
        return None
    return decision.engaged, decision.reason


# ---- Installing -------------------------------------------------------------------


def is_installed(attention_class: type) -> bool:
    """Whether ``attention_class`` runs the patch's dispatcher now."""
    installed = STATE.installed.get(attention_class)
    return installed is not None and attention_class.__dict__.get("__call__") is installed.dispatcher


@dataclasses.dataclass(frozen=True)
class Plan:
    """What :func:`install` will do: the registered classes whose pieces
    are all proven, and those left with the pieces that differ."""

    proven: tuple[tuple[type, registry.AttentionFamily], ...]
    unproven: dict


def plan() -> Plan:
    """Reads which registered classes :func:`install` would patch; changes
    nothing (but imports the registered modules)."""
    with STATE.lock:
        proven, unproven = [], {}
        for attention_class, family in registry.families_by_class().items():
            pieces = registry.unproven_attributes(
                attention_class, family.pieces, unpatched_function
            )
            if pieces:
                unproven[attention_class] = pieces
            else:
                proven.append((attention_class, family))
        return Plan(tuple(proven), unproven)


def install(install_plan: Plan, new_mode: Optional[Mode]) -> None:
    """Patches the plan's proven classes and leaves its unproven ones; the
    caller holds ``STATE.lock``. Cannot fail past its first assignment.
    Classes installed already keep their dispatchers; where ``new_mode``
    is not the mode in force, their layers are decided again at their next
    call, so every engaged layer runs in the mode of the install in force."""
    if new_mode != STATE.mode:
        STATE.forget_decisions()
    STATE.mode = new_mode
    STATE.unproven_classes = dict(install_plan.unproven)
    for attention_class in install_plan.unproven:
        installed = STATE.installed.get(attention_class)
        if installed is not None:
            _uninstall(attention_class, installed)
    for attention_class, family in install_plan.proven:
        installed = STATE.installed.get(attention_class)
        if installed is not None and not is_installed(attention_class):
            del STATE.installed[attention_class]  # the user replaced our dispatcher
            installed = None
        if installed is not None:
            installed.mode = new_mode
            continue  # already patched: its layers keep their decisions (mode above)
        original = unpatched_function(attention_class, "__call__")
        inherited = "__call__" not in attention_class.__dict__
        dispatcher = _dispatcher(attention_class, original)  # type: ignore[arg-type]
        STATE.installed[attention_class] = Installed(
            family, original, inherited, dispatcher, Tally(), new_mode  # type: ignore[arg-type]
        )
        STATE.originals[attention_class] = original  # type: ignore[assignment]
        attention_class.__call__ = dispatcher  # type: ignore[method-assign]


def _uninstall(attention_class: type, installed: Installed) -> None:
    if attention_class.__dict__.get("__call__") is installed.dispatcher:
        if installed.inherited:
            del attention_class.__call__  # type: ignore[method-assign]
        else:
            attention_class.__call__ = installed.original  # type: ignore[method-assign]
    del STATE.installed[attention_class]


def restore() -> None:
    """Every patched class back to its own ``__call__`` (a class whose
    dispatcher the user has replaced keeps the user's), every decision
    dropped: layers decide again at their next patched call."""
    with STATE.lock:
        for attention_class, installed in list(STATE.installed.items()):
            _uninstall(attention_class, installed)
        with STATE.decisions_lock:
            STATE.decisions.clear()


def patched_classes() -> list[type]:
    """The classes that run the dispatcher now."""
    with STATE.lock:
        return [cls for cls in STATE.installed if is_installed(cls)]


def registered_pieces() -> list[tuple[str, object]]:
    """``(piece, live function)`` of every piece the registry names that
    this install has: the families' classes (their ``__call__`` as mlx-lm
    gives it, the patch's own left out), the part classes, mlx-lm's cache
    classes and ``normalize_qk``. What the fingerprint test records."""
    pieces: list[tuple[str, object]] = []
    for attention_class, family in registry.families_by_class().items():
        for attribute in family.pieces:
            pieces.append(
                (registry.piece_name(attention_class, attribute),
                 unpatched_function(attention_class, attribute))
            )
    for part_class in registry.reproduced_part_classes():
        pieces.append(
            (registry.piece_name(part_class, "__call__"), live_function(part_class, "__call__"))
        )
    for name, (_, methods) in registry.WRITTEN_CACHES.items():
        cache_class = registry.class_of(registry.CACHE_MODULE, name)
        if cache_class is None:
            continue
        for method in methods:
            pieces.append(
                (f"{registry.CACHE_MODULE}.{name}.{method}", live_function(cache_class, method))
            )
    if ORIGINAL_NORMALIZE_QK is not None:
        pieces.append((registry.NORMALIZE_QK_PIECE, ORIGINAL_NORMALIZE_QK))
    return pieces
