"""What the package computed in each engaged layer, while a tool records.

``STATE.prework_log`` is None but while :func:`recording_prework` runs:
then id(layer) -> the kinds of package call (:data:`NORM_ROPE`,
:data:`NORM_ONLY`, :data:`ROPE_ONLY`) its engaged calls made. The replacements' call sites
say what they computed (:func:`note_prework`, called only where they find
the log set), the dispatcher which layer is calling. For tools, not for
concurrent use; nothing of it runs on the decode path while no tool
records but the dispatcher's one test of the log."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Optional

from mlx_dualnorm.integrations.mlx_lm.state import STATE

# What an engaged layer's package call computed (note_prework).
NORM_ROPE = "norm + RoPE"
NORM_ONLY = "norm"
ROPE_ONLY = "RoPE"  # attention without q/k norms


def note_prework(kind: str) -> None:
    """Called where a replacement's package call succeeded, while
    ``STATE.prework_log`` is set: ``kind`` is what it computed."""
    if STATE.prework_log is not None and STATE.calling_layer is not None:
        STATE.prework_log.setdefault(STATE.calling_layer, set()).add(kind)


def recorded_call(layer: Any, function: Callable, args: tuple, kwargs: dict) -> Any:
    """``function(layer, *args, **kwargs)`` with ``layer`` as the calling layer."""
    outer, STATE.calling_layer = STATE.calling_layer, id(layer)
    try:
        return function(layer, *args, **kwargs)
    finally:
        STATE.calling_layer = outer


@dataclasses.dataclass
class PreworkRecord:
    """What :func:`recording_prework` yields: ``prework_of(layer)`` names
    the package calls an engaged layer made while recording (``"norm +
    RoPE"``, ``"norm"``, ``"RoPE"``, or several joined by ``and``), None for
    a layer that made none. Read it while the layers are alive (it keys on their ids)."""

    by_layer: dict[int, set[str]] = dataclasses.field(default_factory=dict)

    def prework_of(self, layer: object) -> Optional[str]:
        kinds = self.by_layer.get(id(layer))
        return " and ".join(sorted(kinds)) if kinds else None


@contextlib.contextmanager
def recording_prework() -> Iterator[PreworkRecord]:
    """Records, per engaged layer, which package call its prework made, for
    the block (one thread at a time). For tools that say what ran where."""
    record = PreworkRecord()
    outer, STATE.prework_log = STATE.prework_log, record.by_layer
    try:
        yield record
    finally:
        STATE.prework_log = outer
