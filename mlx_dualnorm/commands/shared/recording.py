"""What each layer of a model ran under the patch: the one place the
commands reach past the integration's public names.

The integration's :func:`~mlx_dualnorm.integrations.mlx_lm.report` says
what the patch did for the whole process; per layer (which package call
an engaged layer made, why a layer was left to mlx-lm, which shape of
layer the patch replaces) it has no public name yet. The names below are
written as the integration would offer them (``recording()``,
``LayerEngagement``, ``NORM_ONLY``, ``NORM_ROPE``, ``layer_kinds()``);
once it does, each becomes a re-export from
:mod:`mlx_dualnorm.integrations.mlx_lm`, and no command changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

# Internal modules of the integration, imported here and nowhere else in
# the commands.
from mlx_dualnorm.integrations.mlx_lm import engine, norm_after_transpose, norm_before_transpose
from mlx_dualnorm.integrations.mlx_lm import registry, whole_projection
from mlx_dualnorm.integrations.mlx_lm.engagement import NORM_ONLY, NORM_ROPE, LayerEngagement
from mlx_dualnorm.integrations.mlx_lm.engagement import layer_engagement

__all__ = ["LayerEngagement", "NORM_ONLY", "NORM_ROPE", "Recording", "layer_kinds", "recording"]


@dataclasses.dataclass
class Recording:
    """What :func:`recording` yields: ``engagement(model)``, read while
    patched, is the model's layers of registered attention classes by
    outcome, an engaged layer named by the package call it made while
    recording."""

    prework_of: Callable[[Any], Any]

    def engagement(self, model: Any) -> LayerEngagement:
        return layer_engagement(model, self.prework_of)


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Records, for the block (one thread at a time), which package call
    each engaged layer made."""
    with engine.recording_prework() as record:
        yield Recording(record.prework_of)


def layer_kinds(model: Any) -> dict:
    """How many of the layers this rank runs are gated-delta layers, how
    many are full-attention layers of a class whose q/k norm + RoPE the
    patch makes one call, and how many are attention layers of the other
    shapes whose q/k norm pair, as they are now, it makes one call."""
    norm_pair_modules = {
        module.__name__
        for module in (norm_after_transpose, norm_before_transpose, whole_projection)
    }
    families = registry.families_by_class()
    gated_delta = full_attention = norm_pair = 0
    for layer in model.layers:
        if layer is None:  # another pipeline rank's layer
            continue
        attention = getattr(layer, "self_attn", None)
        family = next(
            (families[cls] for cls in type(attention).__mro__ if cls in families), None
        )
        if getattr(layer, "is_linear", False):
            gated_delta += 1
        elif family is None:
            continue
        elif family.call.__module__ not in norm_pair_modules:
            full_attention += 1
        elif family.engages(attention):
            norm_pair += 1
    return {"gated_delta": gated_delta, "full_attention": full_attention, "norm_pair": norm_pair}
