"""What the patch engaged in a model: its attention layers by class and
outcome, read from the patch's own bookkeeping, and the gated-delta folds.

    >>> from mlx_dualnorm.integrations.mlx_lm.engagement import layer_engagement
    >>> engagement = layer_engagement(model)   # while patched, after a call
    >>> engagement.engaged_layers, engagement.left_layers

Each layer of a registered attention class is in exactly one place:

* engaged, by the prework it runs: ``prework_of(layer)`` where the caller
  measured it (``mlx-lm-check`` records which package call ran inside each
  layer: ``"norm + RoPE"`` or ``"norm"``, the q/k norm pair alone), else
  what the replacement names in its ``mlx_dualnorm_prework`` attribute (or
  its family in a ``prework`` field), else ``"q/k prework"``. The patch
  decided at the layer's first call and moved it to its engaged subclass;
* left to mlx-lm's code, with the reason: decided against (its family's
  ``refusal``, else: its norms or RoPE are not what the package computes;
  the layer's own norm and RoPE types are named),
  its class's code not proven on this mlx-lm release, a subclass of
  mlx-lm's class, not called yet while patched, or not patched at all.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Iterator, Optional

import mlx.nn as nn

from mlx_dualnorm.integrations.mlx_lm import _release_check, gated_delta
from mlx_dualnorm.integrations.mlx_lm._shared import REPLACEMENT_MARKER

__all__ = [
    "LayerEngagement", "NORM_ONLY", "NORM_ROPE", "UNNAMED_PREWORK", "fold_count",
    "is_engaged_layer", "layer_engagement",
]

NORM_ROPE = "norm + RoPE"
NORM_ONLY = "norm"
UNNAMED_PREWORK = "q/k prework"
PREWORK_ATTRIBUTE = "mlx_dualnorm_prework"
REASON_ATTRIBUTE = "refusal"  # of a registered family

NOT_PLAIN = "its norms or RoPE are not plain nn.RMSNorm / nn.RoPE"
NOT_CALLED = "not called yet while patched (the patch decides at a layer's first call)"
NOT_PATCHED = "not patched"
SUBCLASS = "a subclass of mlx-lm's class, which keeps its own code"
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


def _registered() -> dict:
    """Every registered attention class this mlx-lm has -> how it is
    replaced (None for those this release's check kept from the patch)."""
    registered: dict = dict.fromkeys(_release_check.unproven_classes)
    registered.update((entry[0], entry[1]) for entry in _release_check.registered_entries())
    return registered


def _prework(replacement, family) -> str:
    named = getattr(replacement, PREWORK_ATTRIBUTE, None) or getattr(family, "prework", None)
    return named if isinstance(named, str) else UNNAMED_PREWORK


def _described(layer: nn.Module) -> str:
    parts = []
    for attribute in DESCRIBED_ATTRIBUTES:
        value = layer.get(attribute) if isinstance(layer, dict) else None
        if value is not None:
            parts.append(f"{attribute} {type(value).__name__}")
    return f" ({', '.join(parts)})" if parts else ""


def is_engaged_layer(layer: object) -> bool:
    """Whether ``layer`` is an attention layer the patch engaged (moved to
    its engaged subclass)."""
    return type(layer).__dict__.get("mlx_dualnorm_engaged") is True


def _mlx_lm_class(module_class: type) -> type:
    """The mlx-lm class of a layer the patch moved to a decided subclass."""
    return module_class.__mro__[1]


def _place(
    layer: nn.Module, registered: dict, prework_of: Optional[Callable[[nn.Module], Optional[str]]]
) -> Iterator[tuple[bool, str, str]]:
    """(engaged, class name, prework or reason) for a registered layer;
    nothing for other modules."""
    layer_class = type(layer)
    engaged = layer_class.__dict__.get("mlx_dualnorm_engaged")
    if engaged is not None:  # one of the patch's decided subclasses
        mlx_lm_class = _mlx_lm_class(layer_class)
        name = _release_check.class_name(mlx_lm_class)
        family = registered.get(mlx_lm_class)
        if engaged:
            measured = prework_of(layer) if prework_of is not None else None
            yield True, name, measured or _prework(layer_class.__dict__["__call__"], family)
        else:
            reason = getattr(family, REASON_ATTRIBUTE, None) or NOT_PLAIN
            yield False, name, reason + _described(layer)
        return
    if layer_class in registered:
        name = _release_check.class_name(layer_class)
        if layer_class in _release_check.unproven_classes:
            yield False, name, _release_check.unproven_classes[layer_class]
        elif _is_patched_class(layer_class):
            yield False, name, NOT_CALLED
        else:
            yield False, name, NOT_PATCHED
        return
    for registered_class in registered:
        if isinstance(layer, registered_class):
            yield False, _release_check.class_name(layer_class), SUBCLASS
            return


def _is_patched_class(attention_class: type) -> bool:
    installed = attention_class.__dict__.get("__call__")
    return getattr(installed, REPLACEMENT_MARKER, False) is True


def layer_engagement(
    model: nn.Module, prework_of: Optional[Callable[[nn.Module], Optional[str]]] = None
) -> LayerEngagement:
    """The model's layers of registered attention classes, by outcome.
    Call while patched: unpatching gives every layer its class back.
    ``prework_of(layer)``, where given, names an engaged layer's prework
    as measured (None: not measured)."""
    registered = _registered()
    engagement = LayerEngagement()
    for _, module in model.named_modules():
        for engaged, name, detail in _place(module, registered, prework_of):
            (engagement.engaged if engaged else engagement.left)[(name, detail)] += 1
    return engagement


def fold_count() -> int:
    """Gated-delta folds built in this process (one per dtype, width, eps,
    scale and mode the model's calls had), not counting the keys that run
    mlx-lm's function."""
    return sum(
        folded is not gated_delta._UNFOLDABLE for folded in list(gated_delta._folded_norms.values())
    )
