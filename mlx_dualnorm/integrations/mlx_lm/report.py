"""What the patch did, per attention class and in one line, and the one
warning per process that says what it left to mlx-lm's own code."""

from __future__ import annotations

import collections
import dataclasses
import sys
import warnings

from mlx_dualnorm.integrations.mlx_lm import registry
from mlx_dualnorm.integrations.mlx_lm.engine import PATCH_OPERATION, is_installed
from mlx_dualnorm.integrations.mlx_lm.state import STATE


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


def _counted(count: int, singular: str, plural: str = "") -> str:
    return f"{count} {singular if count == 1 else (plural or singular + 's')}"


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
        """Calls of engaged attention layers that went through the package."""
        return sum(entry.calls - entry.fallbacks for entry in self.classes)

    @property
    def folded_calls(self) -> int:
        """``normalize_qk`` calls that ran the fold (one package call each)."""
        return self.normalize_qk_calls - self.normalize_qk_original

    def summary(self) -> str:
        """One line: attention layers engaged (by class) and left since the
        patch, the calls that went through the package (attention layers'
        and folded ``normalize_qk`` calls), and the classes left unproven."""
        if not self.patched:
            return f"mlx_dualnorm: not patched ({self.mlx_lm})"
        engaged: collections.Counter = collections.Counter()
        for entry in self.classes:
            if entry.engaged_layers:
                engaged[entry.name.removeprefix("mlx_lm.models.")] += entry.engaged_layers
        by_class = ", ".join(f"{name} {count}" for name, count in sorted(engaged.items()))
        package_calls = self.calls + self.folded_calls
        parts = [
            f"mlx_dualnorm: {_counted(self.engaged_layers, 'attention layer')} engaged"
            + (f" ({by_class})" if by_class else ""),
            f"{self.left_layers} left to mlx-lm",
            f"{_counted(package_calls, 'package call')} "
            f"({_counted(self.calls, 'attention call')}, "
            f"{_counted(self.folded_calls, 'folded normalize_qk call')})",
        ]
        fallbacks = sum(entry.fallbacks for entry in self.classes)
        if fallbacks:
            parts.append(f"{_counted(fallbacks, 'call')} ran mlx-lm's code")
        if self.folds:
            parts.append(_counted(self.folds, "gated-delta fold") + " built")
        unproven = [entry.name for entry in self.classes if entry.unproven]
        if unproven:
            parts.append(f"{_counted(len(unproven), 'class', 'classes')} left unproven on "
                         f"{self.mlx_lm}")
        return "; ".join(parts)


def class_reports() -> tuple[ClassReport, ...]:
    """One :class:`ClassReport` per patched or unproven class."""
    with STATE.lock:
        entries = []
        for attention_class, installed in STATE.installed.items():
            tally = installed.tally
            entries.append(ClassReport(
                registry.class_name(attention_class), is_installed(attention_class), (),
                tally.engaged_layers, dict(tally.left_layers), tally.calls, tally.fallbacks,
            ))
        for attention_class, pieces in STATE.unproven_classes.items():
            entries.append(ClassReport(
                registry.class_name(attention_class), False, tuple(pieces), 0, {}, 0, 0,
            ))
        return tuple(sorted(entries, key=lambda entry: entry.name))


def installed_mlx_lm() -> str:
    version = getattr(sys.modules.get("mlx_lm"), "__version__", None)
    return f"mlx-lm {version}" if isinstance(version, str) else "the installed mlx-lm"


def warn_unproven_once(unproven: dict[str, str]) -> None:
    """One RuntimeWarning per process: the release, and one short line per
    class (or function) left to its own code, saying what differs. Marked
    as given only once the warning returned (a filter that raises it as an
    error leaves it to be given again)."""
    if STATE.warned_unproven or not unproven:
        return
    count = len(unproven)
    lines = [
        f"[{PATCH_OPERATION}] {installed_mlx_lm()}: {count} of the classes and functions "
        f"the patch covers {'runs its' if count == 1 else 'run their'} own code, "
        "which is not the code the patch was proven on; the rest is patched (all of it is "
        "proven on mlx-lm 0.32.2):"
    ]
    lines += [f"  {name}: {what}" for name, what in sorted(unproven.items())]
    warnings.warn("\n".join(lines), RuntimeWarning, stacklevel=6)  # the caller of patch()
    STATE.warned_unproven = True
