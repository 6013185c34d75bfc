"""The paths the tools compare (``PATH_REGISTRY``): factories ``make_path(eps)``
of ``path(queries, keys, query_weight, key_weight) -> (queries, keys)``
normalized, raising :class:`PathUnavailable` where the path cannot run here."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable, Mapping, Optional, Sequence

import mlx.core as mx

from mlx_dualnorm import CompiledDualHeadNorm, Mode, available_modes, composed_dual_head_norm

DualNormPath = Callable[[mx.array, mx.array, Optional[mx.array], Optional[mx.array]],
                        tuple[mx.array, mx.array]]
DualNormPathFactory = Callable[[float], DualNormPath]  # called once per epsilon per run

REFERENCE_PATH = "composed"
ROPE_BASE = 10000.0  # the RoPE base of the norm + RoPE paths' parity inputs and replay model


class PathUnavailable(RuntimeError):
    """The path cannot run here (its mode is not built, it takes no weights)."""


@dataclasses.dataclass(frozen=True)
class RegisteredPath:
    """One way of computing ``(rms_norm(q, wq, eps), rms_norm(k, wk, eps))``."""

    name: str
    factory: DualNormPathFactory
    description: str
    # Whether parity and replay check it when no path is named: a path that
    # retraces per shape would compile once per parity case (minutes on a CPU).
    routinely_checked: bool = True
    available: Callable[[], bool] = lambda: True  # whether this build and device run it


PATH_REGISTRY: dict[str, RegisteredPath] = {}  # every path, in the order the tools print them


def register_path(name: str, factory: DualNormPathFactory, description: str = "", *,
                  routinely_checked: bool = True,
                  available: Callable[[], bool] = lambda: True) -> None:
    """Adds (or replaces) a path. If the callable ``factory(eps)`` returns
    has a ``close()`` method, the benchmark calls it when done."""
    PATH_REGISTRY[name] = RegisteredPath(name, factory, description, routinely_checked, available)


def make_composed_path(eps: float) -> DualNormPath:
    """The reference: two ``mx.fast.rms_norm`` calls, nothing compiled."""

    def composed_path(queries: mx.array, keys: mx.array, query_weight: Optional[mx.array],
                      key_weight: Optional[mx.array]) -> tuple[mx.array, mx.array]:
        return composed_dual_head_norm(queries, keys, query_weight, key_weight, eps)

    return composed_path


def make_mx_compile_path(eps: float) -> DualNormPath:
    # MLX keys its trace on which weights are None: one function serves all four weightings.
    return mx.compile(make_composed_path(eps), shapeless=True)


def package_mode_factory(mode: Mode) -> DualNormPathFactory:
    """``CompiledDualHeadNorm(eps, mode=mode)``; PathUnavailable where it cannot run."""

    def factory(eps: float) -> DualNormPath:
        if mode not in available_modes():
            raise PathUnavailable(
                f"mode {mode!r} is not available here (available: {', '.join(available_modes())})"
            )
        return CompiledDualHeadNorm(eps, mode=mode)

    return factory


make_compiled_path = package_mode_factory("compiled")

register_path(REFERENCE_PATH, make_composed_path,
              "the reference: two mx.fast.rms_norm calls, nothing compiled")
register_path(
    "compiled", make_compiled_path,
    "mlx_dualnorm.CompiledDualHeadNorm(mode='compiled'): one graph compiled in C, traced per shape",
    available=lambda: "compiled" in available_modes(),
)
register_path(
    "fused", package_mode_factory("fused"),
    "mlx_dualnorm.CompiledDualHeadNorm(mode='fused'): one kernel for both inputs (CUDA)",
    available=lambda: "fused" in available_modes(),
)
register_path("mx_compile", make_mx_compile_path,
              "Python mx.compile(shapeless=True) of the two mx.fast.rms_norm calls")
register_path("mx_compile_shaped", lambda eps: mx.compile(make_composed_path(eps)),
              "Python mx.compile of the two calls, traced again for every new input shape",
              routinely_checked=False)


def routinely_checked_paths() -> dict[str, DualNormPathFactory]:
    """What parity and replay check by default: the routinely checked paths that run here."""
    return {
        name: path.factory for name, path in PATH_REGISTRY.items()
        if name != REFERENCE_PATH and path.routinely_checked and path.available()
    }


def describe_paths(names: Sequence[str]) -> list[str]:
    """``name: description`` lines (names not registered are listed bare)."""
    descriptions = {name: path.description for name, path in PATH_REGISTRY.items()}
    return [f"{name}: {descriptions[name]}" if descriptions.get(name) else name for name in names]


def unavailable_paths(names: Sequence[str], eps: float = 1e-6) -> dict[str, str]:
    """The registered paths named that cannot run here, with the reason."""
    reasons = {}
    for name in names:
        path = PATH_REGISTRY.get(name)
        if path is None or path.available():
            continue
        try:
            built = path.factory(eps)
        except PathUnavailable as unavailable:
            reasons[name] = str(unavailable)
            continue
        close = getattr(built, "close", None)
        if callable(close):
            close()
        reasons[name] = "not available on this build or device"
    return reasons


def unavailable_modes(modes_by_name: Mapping[str, str]) -> dict[str, str]:
    """Of the paths named, each with the package mode it runs in, those this build or
    device cannot run, with the reason."""
    available = available_modes()
    return {name: f"mode {mode!r} is not available here"
            for name, mode in modes_by_name.items() if mode not in available}


def skipped_path_lines(tool_name: str, skipped: Mapping[str, str]) -> list[str]:
    return [f"{tool_name}: {name} skipped: {reason}" for name, reason in skipped.items()]


def build_path(name: str, factory: DualNormPathFactory, eps: float) -> DualNormPath:
    """``factory(eps)``; its PathUnavailable names the path."""
    try:
        return factory(eps)
    except PathUnavailable as unavailable:
        raise PathUnavailable(f"path {name!r}: {unavailable}") from unavailable


def refuse_unavailable(reasons: Mapping[str, str]) -> None:
    """PathUnavailable for the first path named: exit 2 before running any."""
    for name, reason in reasons.items():
        raise PathUnavailable(f"path {name!r}: {reason}")


@dataclasses.dataclass(frozen=True)
class PathSelection:
    """What ``--path`` accepts (``factories``, and ``extra_names`` that are no dual
    norm paths), what runs without it, and whether these are the registered paths."""

    factories: dict[str, DualNormPathFactory]
    default_names: list[str]
    extra_names: list[str] = dataclasses.field(default_factory=list)
    registered: bool = True

    @classmethod
    def of(cls, path_factories: Optional[Mapping[str, DualNormPathFactory]],
           default_factories: Mapping[str, DualNormPathFactory], *, extra_names: Sequence[str] = (),
           extra_default_names: Sequence[str] = ()) -> "PathSelection":
        """The registered paths but the reference, ``default_factories`` and
        ``extra_default_names`` by default; or ``path_factories``, all by default."""
        if path_factories is not None:
            return cls(dict(path_factories), list(path_factories), registered=False)
        return cls(
            {name: path.factory for name, path in PATH_REGISTRY.items() if name != REFERENCE_PATH},
            [*default_factories, *extra_default_names],
            list(extra_names),
        )

    def add_path_argument(self, parser: argparse.ArgumentParser, verb: str) -> None:
        parser.add_argument(
            "--path", dest="path_names", action="append",
            choices=[*self.factories, *self.extra_names],
            help=f"path to {verb} (repeatable; default: {', '.join(self.default_names)})",
        )

    def named(self, arguments: argparse.Namespace) -> list[str]:
        """The paths ``--path`` named, each once, or the default ones."""
        return list(dict.fromkeys(arguments.path_names or ())) or self.default_names

    def factories_named(self, names: Sequence[str]) -> dict[str, DualNormPathFactory]:
        """The dual norm paths among ``names`` (extra names left out)."""
        return {name: self.factories[name] for name in names if name in self.factories}
