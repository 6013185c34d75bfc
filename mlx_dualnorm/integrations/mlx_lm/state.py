"""The integration's state, in one place: what is installed, in which
mode, the holds of :func:`~.patch` and :func:`~.unpatch` that decide it,
the decisions per layer and what was recorded for the report.

One object, :data:`STATE`. :mod:`._patching` writes the setting and the
holds, :mod:`.engine` what is installed and decided, :mod:`.registry` the
modules that failed to import, :mod:`.report` that the warning was given
and :mod:`.prework_log` what a tool records; the layer shapes only read it
(whether a tool records, whether the patch is on); the mode reaches
them as an argument, from the layer's decision. This module imports nothing of the integration.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Callable, Optional

from mlx_dualnorm._composite import Mode


@dataclasses.dataclass
class Tally:
    """One patched class since it was installed: its layers decided (alive
    or not: a command's model may be gone by the time it reports), and the
    calls of engaged layers, through the package and those that ran the
    class's own code."""

    engaged_layers: int = 0
    left_layers: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    calls: int = 0
    fallbacks: int = 0


class Decision:
    """What the dispatcher decided for one layer.

    ``layer``: a weak reference to it (a new object at a reused id is
    decided afresh); ``function``: what its calls run (the family's
    replacement, or the class's own ``__call__``); ``engaged``; ``reason``
    it was left (None where engaged); ``tally``: its class's; ``checks``:
    ``(owner, attribute, value)`` for everything the decision relied on
    (MLX's fast functions, its parts' classes' ``__call__``), tested by
    identity at every call, the layer decided again where one differs;
    ``parts``: ``(name, module)`` of the layer's submodules as it held
    them, tested by identity at every call (a part swapped for an instance
    of another class, whose ``__call__`` no check covers, is decided
    again); ``switches``: ``(attribute, value)`` of the layer that its
    original reads at every call, tested at every call of an engaged layer,
    which runs the class's own code where one differs; ``mode``: the mode
    of the install it was decided under, which the dispatcher passes to an
    engaged layer's replacement (after ``self``) at every call."""

    __slots__ = (
        "layer", "function", "engaged", "reason", "tally", "checks", "parts", "switches", "mode"
    )

    def __init__(
        self, layer, function, engaged, reason, tally, checks=(), parts=(), switches=(),
        mode: Optional[Mode] = None,
    ):
        self.layer = layer
        self.function = function
        self.engaged = engaged
        self.reason = reason
        self.tally = tally
        self.checks = checks
        self.parts = parts
        self.switches = switches
        self.mode = mode

    def uncount(self) -> None:
        """Takes the decision, being replaced or dropped, out of its class's tally."""
        tally = self.tally
        if self.engaged:
            tally.engaged_layers -= 1
        else:
            tally.left_layers[self.reason] -= 1
            if tally.left_layers[self.reason] <= 0:
                del tally.left_layers[self.reason]

    def holds(self) -> bool:
        """Whether everything the decision relied on is as it was."""
        for owner, attribute, value in self.checks:
            if getattr(owner, attribute, None) is not value:
                return False
        layer = self.layer()
        if layer is None:
            return False
        for name, part in self.parts:
            if dict.get(layer, name) is not part:
                return False
        return True


@dataclasses.dataclass
class Installed:
    """One attention class running the dispatcher."""

    family: Any  # registry.AttentionFamily
    original: Callable  # the class's own __call__, as it resolved before the patch
    inherited: bool  # the class had no __call__ of its own: restoring deletes ours
    dispatcher: Callable
    tally: Tally
    mode: Optional[Mode] = None  # what its layers are decided with


class Hold:
    """One :func:`~.patch` or :func:`~.unpatch` call: the setting it
    installed (``patched``, ``mode``), the setting it found (``previous``),
    the thread that made it, and a weak reference to the call's handle (a
    plain call's is gone once its result is dropped; a block's lives until
    the block ends)."""

    __slots__ = ("patched", "mode", "previous", "thread", "handle")

    def __init__(self, patched: bool, mode, handle) -> None:
        self.patched = patched
        self.mode = mode
        self.previous: tuple = (False, None)
        self.thread = threading.get_ident()
        self.handle = handle

    def is_plain(self) -> bool:
        return self.handle() is None


class PatchState:
    """The integration's whole state (see the module's docstring)."""

    def __init__(self) -> None:
        # Held by patch(), unpatch(), a block's end and every decision.
        self.lock = threading.RLock()
        self.patched = False
        # The mode of the install in force: each decision holds its own copy,
        # which its layer's replacement is passed at every call.
        self.mode: Optional[Mode] = None
        # The holds in force, oldest first: the newest one's setting is installed.
        self.holds: list[Hold] = []
        self.installed: dict[type, Installed] = {}
        # class -> its own __call__, kept after restore() so a replacement
        # still running (another thread) can reach it.
        self.originals: dict[type, Callable] = {}
        # Registered classes this mlx-lm has whose pieces are not all proven:
        # class -> the pieces that differ, at the last install.
        self.unproven_classes: dict[type, list[str]] = {}
        # Modules of mlx-lm that raised on import: name -> the error, in one line.
        self.import_failures: dict[str, str] = {}
        # id(layer) -> Decision. Modules are dicts (unhashable), hence ids.
        # No weakref callbacks (one could run inside the lock); dead entries
        # are pruned whenever the table has doubled since the last pruning.
        self.decisions: dict[int, Decision] = {}
        self.decisions_lock = threading.Lock()
        self.decisions_pruned_size = 64
        self.warned_unproven = False
        # While a tool records: id(layer) -> kinds of package call it made.
        self.prework_log: Optional[dict[int, set[str]]] = None
        self.calling_layer: Optional[int] = None

    def forget_decisions(self) -> None:
        """Drops every decision, each taken out of its class's tally: the
        layers are decided again at their next call."""
        with self.decisions_lock:
            for decision in self.decisions.values():
                if decision.layer() is not None:
                    decision.uncount()
            self.decisions.clear()


STATE = PatchState()
