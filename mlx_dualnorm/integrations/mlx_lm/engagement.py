"""What the patch engaged in one model: its attention layers by class and
outcome, read from the engine's decisions.

    >>> from mlx_dualnorm.integrations.mlx_lm.engagement import layer_engagement
    >>> engagement = layer_engagement(model)   # while patched, after a call
    >>> engagement.engaged_layers, engagement.left_layers

(:func:`~mlx_dualnorm.integrations.mlx_lm.report` says the same for the
whole process, with call counts.) Each layer of a registered attention
class is in exactly one place:

* engaged, by the prework it runs: ``prework_of(layer)`` where the caller
  recorded it (``"norm + RoPE"``, ``"RoPE"`` without q/k norms, or
  ``"norm"``, the q/k norm pair alone:
  :func:`recording`), else ``"q/k prework"``;
* left to mlx-lm's code, with the reason: decided against (its family's
  ``refusal``, or a part whose code is not proven; the layer's own norm
  and RoPE types are named), its class's code not proven on this mlx-lm
  (the pieces that differ are named), a subclass of mlx-lm's class, not
  called yet while patched, or not patched at all.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Optional

import mlx.nn as nn

from mlx_dualnorm.integrations.mlx_lm import engine, registry
from mlx_dualnorm.integrations.mlx_lm.gated_delta import fold_count
from mlx_dualnorm.integrations.mlx_lm.prework_log import (
    NORM_ONLY,
    NORM_ROPE,
    ROPE_ONLY,
    PreworkRecord,
    recording_prework,
)
from mlx_dualnorm.integrations.mlx_lm.state import STATE

__all__ = [
    "LayerEngagement", "NORM_ONLY", "NORM_ROPE", "ROPE_ONLY", "Recording", "UNNAMED_PREWORK",
    "fold_count", "is_engaged_layer", "layer_engagement", "recording",
]

UNNAMED_PREWORK = "q/k prework"

NOT_CALLED = "not called yet while patched (the patch decides at a layer's first call)"
NOT_PATCHED = "not patched"
NOT_PLAIN = registry.AttentionFamily.refusal  # the families' default refusal
SUBCLASS = engine.SUBCLASS
UNPROVEN = "its code differs from the code the patch was proven on ({pieces})"
# The attributes whose types a decided-against layer is described by.
DESCRIBED_ATTRIBUTES = ("rope", "q_norm", "k_norm")


@dataclasses.dataclass
class LayerEngagement:
    """Layers of registered attention classes: ``engaged[(class, prework)]``
    and ``left[(class, reason)]`` count layers; classes are named
    ``module.Class``."""

    engaged: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    left: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def engaged_layers(self) -> int:
        return sum(self.engaged.values())

    @property
    def left_layers(self) -> int:
        return sum(self.left.values())

    def engaged_by_prework(self) -> dict[str, int]:
        """Layers engaged per prework kind (``"norm + RoPE"``, ``"norm"``)."""
        totals: collections.Counter = collections.Counter()
        for (_, prework), layers in self.engaged.items():
            totals[prework] += layers
        return dict(sorted(totals.items()))


def _described(layer: nn.Module) -> str:
    parts = []
    for attribute in DESCRIBED_ATTRIBUTES:
        value = layer.get(attribute) if isinstance(layer, dict) else None
        if value is not None:
            parts.append(f"{attribute} {type(value).__name__}")
    return f" ({', '.join(parts)})" if parts else ""


def is_engaged_layer(layer: object) -> bool:
    """Whether ``layer`` is an attention layer the patch decided to engage."""
    decision = engine.decision_of(layer)
    return decision is not None and decision[0]


def _place(
    layer: nn.Module, registered: dict,
    prework_of: Optional[Callable[[nn.Module], Optional[str]]],
) -> Iterator[tuple[bool, str, str]]:
    """(engaged, class name, prework or reason) for a registered layer;
    nothing for other modules."""
    layer_class = type(layer)
    decision = engine.decision_of(layer)
    if decision is not None:
        engaged, reason = decision
        if engaged:
            measured = prework_of(layer) if prework_of is not None else None
            yield True, registry.class_name(layer_class), measured or UNNAMED_PREWORK
        else:
            described = _described(layer) if reason != SUBCLASS else ""
            yield False, registry.class_name(layer_class), (reason or NOT_PATCHED) + described
        return
    if layer_class in registered:
        name = registry.class_name(layer_class)
        if layer_class in STATE.unproven_classes:
            yield False, name, UNPROVEN.format(pieces=", ".join(STATE.unproven_classes[layer_class]))
        elif engine.is_installed(layer_class):
            yield False, name, NOT_CALLED
        else:
            yield False, name, NOT_PATCHED
        return
    for registered_class in registered:
        if isinstance(layer, registered_class):
            yield False, registry.class_name(layer_class), SUBCLASS
            return


def layer_engagement(
    model: nn.Module, prework_of: Optional[Callable[[nn.Module], Optional[str]]] = None
) -> LayerEngagement:
    """The model's layers of registered attention classes, by outcome.
    Call while patched: unpatching drops every decision. ``prework_of(layer)``,
    where given, names an engaged layer's prework as measured (None: not
    measured)."""
    registered = registry.families_by_class()
    engagement = LayerEngagement()
    for _, module in model.named_modules():
        for engaged, name, detail in _place(module, registered, prework_of):
            (engagement.engaged if engaged else engagement.left)[(name, detail)] += 1
    return engagement


@dataclasses.dataclass
class Recording:
    """What :func:`recording` yields: ``prework_of(layer)``, the package
    calls an engaged layer made while recording (None for none), and
    ``engagement(model)``, the model's layers by outcome with each engaged
    layer named so; read them while patched and the layers alive."""

    _record: PreworkRecord

    def prework_of(self, layer: object) -> Optional[str]:
        return self._record.prework_of(layer)

    def engagement(self, model: Any) -> LayerEngagement:
        return layer_engagement(model, self._record.prework_of)


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Records, for the block (one thread at a time), which package call
    each engaged layer made: what a tool reads to say what ran where.
    Outside such a block the decode path only tests that none is open."""
    with recording_prework() as record:
        yield Recording(record)

