"""What each layer of a model ran under the patch: the one place the
commands reach past the integration's public names.

The integration's :func:`~mlx_dualnorm.integrations.mlx_lm.report` says
what the patch did for the whole process; per layer (which package call
an engaged layer made, why a layer was left to mlx-lm) it has no public
name yet. The names below are written as the integration would offer them
(``recording()``, ``LayerEngagement``, ``NORM_ONLY``, ``NORM_ROPE``);
once it does, each becomes a re-export from
:mod:`mlx_dualnorm.integrations.mlx_lm`, and no command changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

# Internal modules of the integration, imported here and nowhere else in
# the commands.
from mlx_dualnorm.integrations.mlx_lm import engine
from mlx_dualnorm.integrations.mlx_lm.engagement import NORM_ONLY, NORM_ROPE, LayerEngagement
from mlx_dualnorm.integrations.mlx_lm.engagement import layer_engagement

__all__ = ["LayerEngagement", "NORM_ONLY", "NORM_ROPE", "Recording", "recording"]


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
