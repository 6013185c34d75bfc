"""The paths the tools compare, named once: the dual head norm's implementations
(the reference, each of the package's modes, and Python mx.compile peers).

Every tool (parity, replay, bench, the main job) speaks of the same paths by
the same names, and prints the same one-line description of each:

* ``composed``: the reference, two ``mx.fast.rms_norm`` calls;
* ``compiled``: the package, ``CompiledDualHeadNorm(eps, mode="compiled")``;
* ``fused``: the package's one-kernel mode, where this build and device run it;
* ``mx_compile``: Python ``mx.compile(shapeless=True)`` of the two calls, the
  baseline the C core replaces;
* ``mx_compile_shaped``: Python ``mx.compile`` of the two calls, specialized
  to each input shape (it retraces for every new shape).

A path is a factory ``make_path(eps)`` returning a callable
``path(queries, keys, query_weight, key_weight) -> (normalized_queries,
normalized_keys)``, weights possibly None. A factory (or a call, for one
shape) raises :class:`PathUnavailable` where the path cannot run here; the
tools then skip it and say why. :func:`register_path` adds a path.

A command that checks paths (parity, replay) chooses them through
:class:`PathSelection`: what ``--path`` accepts, what runs when no path is
named; a path named that cannot run here stops the command before it runs
anything (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable, Mapping, Optional, Sequence

import mlx.core as mx

from mlx_dualnorm import (
    CompiledDualHeadNorm,
    Mode,
    available_modes,
    composed_dual_head_norm,
)

__all__ = [
    "COMPILED_PATH", "DualNormPath", "DualNormPathFactory", "FUSED_PATH", "PATH_REGISTRY",
    "PYTHON_COMPILE_PATH", "PYTHON_COMPILE_SHAPED_PATH", "PathSelection", "PathUnavailable",
    "REFERENCE_PATH", "RegisteredPath", "build_path", "describe_paths",
    "make_compiled_path", "make_composed_path", "make_fused_path", "make_mx_compile_path",
    "make_mx_compile_shaped_path", "package_mode_factory", "refuse_unavailable",
    "register_path", "routinely_checked_paths", "skipped_path_lines", "unavailable_paths",
]

DualNormPath = Callable[
    [mx.array, mx.array, Optional[mx.array], Optional[mx.array]],
    tuple[mx.array, mx.array],
]
"""``path(queries, keys, query_weight, key_weight) -> (normalized_queries,
normalized_keys)``; the weights may be None."""

DualNormPathFactory = Callable[[float], DualNormPath]
"""Builds the path for one RMS epsilon; called once per epsilon per run."""

REFERENCE_PATH = "composed"
COMPILED_PATH = "compiled"
FUSED_PATH = "fused"
PYTHON_COMPILE_PATH = "mx_compile"
PYTHON_COMPILE_SHAPED_PATH = "mx_compile_shaped"


class PathUnavailable(RuntimeError):
    """Raised by a path factory (or by a path's call, for one shape) when the
    path cannot run here: its mode is not built, it takes no weights. The
    tools record the reason and skip the path."""


@dataclasses.dataclass(frozen=True)
class RegisteredPath:
    """One way of computing ``(rms_norm(q, wq, eps), rms_norm(k, wk, eps))``.

    ``routinely_checked``: whether parity and replay check it when no path
    is named (a path that retraces per shape would compile once per parity
    case, minutes on a CPU, and checks nothing ``mx_compile`` does not)."""

    name: str
    factory: DualNormPathFactory
    description: str
    routinely_checked: bool = True
    available: Callable[[], bool] = lambda: True  # whether this build and device run it


PATH_REGISTRY: dict[str, RegisteredPath] = {}
"""Every path, by name, in the order the tools print them."""


def register_path(
    name: str,
    factory: DualNormPathFactory,
    description: str = "",
    *,
    routinely_checked: bool = True,
    available: Callable[[], bool] = lambda: True,
) -> None:
    """Adds (or replaces) a path. If the callable ``factory(eps)`` returns
    has a ``close()`` method, the benchmark calls it when done."""
    PATH_REGISTRY[name] = RegisteredPath(name, factory, description, routinely_checked, available)


def make_composed_path(eps: float) -> DualNormPath:
    """The reference: two ``mx.fast.rms_norm`` calls, nothing compiled."""

    def composed_path(
        queries: mx.array,
        keys: mx.array,
        query_weight: Optional[mx.array],
        key_weight: Optional[mx.array],
    ) -> tuple[mx.array, mx.array]:
        return composed_dual_head_norm(queries, keys, query_weight, key_weight, eps)

    return composed_path


def _python_compile_path(shapeless: bool) -> DualNormPathFactory:
    """MLX keys its trace on which weights are None, so one compiled
    function serves all four weightings."""

    def factory(eps: float) -> DualNormPath:
        return mx.compile(make_composed_path(eps), shapeless=shapeless)

    return factory


def package_mode_factory(mode: Mode) -> DualNormPathFactory:
    """``CompiledDualHeadNorm(eps, mode=mode)``, or PathUnavailable where
    this build or device lacks the mode."""

    def factory(eps: float) -> DualNormPath:
        if mode not in available_modes():
            raise PathUnavailable(
                f"mode {mode!r} is not available here (available: {', '.join(available_modes())})"
            )
        return CompiledDualHeadNorm(eps, mode=mode)

    return factory


make_compiled_path = package_mode_factory("compiled")
make_fused_path = package_mode_factory("fused")
make_mx_compile_path = _python_compile_path(shapeless=True)
make_mx_compile_shaped_path = _python_compile_path(shapeless=False)

register_path(
    REFERENCE_PATH,
    make_composed_path,
    "the reference: two mx.fast.rms_norm calls, nothing compiled",
)
register_path(
    COMPILED_PATH,
    make_compiled_path,
    "mlx_dualnorm.CompiledDualHeadNorm(mode='compiled'): one graph compiled in C, traced per shape",
    available=lambda: "compiled" in available_modes(),
)
register_path(
    FUSED_PATH,
    make_fused_path,
    "mlx_dualnorm.CompiledDualHeadNorm(mode='fused'): one kernel for both inputs (CUDA)",
    available=lambda: "fused" in available_modes(),
)
register_path(
    PYTHON_COMPILE_PATH,
    make_mx_compile_path,
    "Python mx.compile(shapeless=True) of the two mx.fast.rms_norm calls",
)
register_path(
    PYTHON_COMPILE_SHAPED_PATH,
    make_mx_compile_shaped_path,
    "Python mx.compile of the two calls, traced again for every new input shape",
    routinely_checked=False,
)


def routinely_checked_paths() -> dict[str, DualNormPathFactory]:
    """The paths parity and replay check by default: every routinely checked
    path but the reference, less those this build or device cannot run."""
    return {
        name: path.factory
        for name, path in PATH_REGISTRY.items()
        if name != REFERENCE_PATH and path.routinely_checked and path.available()
    }


def describe_paths(names: "list[str] | tuple[str, ...]") -> list[str]:
    """``name: description`` lines for the paths named (unknown names, such
    as a test's own path, are listed bare)."""
    lines = []
    for name in names:
        path = PATH_REGISTRY.get(name)
        lines.append(f"{name}: {path.description}" if path and path.description else name)
    return lines


def unavailable_paths(names: "list[str] | tuple[str, ...]", eps: float = 1e-6) -> dict[str, str]:
    """Of the registered paths named, those this build or device cannot
    run, each with the reason its factory gives: what a tool prints when
    it leaves a path out, so a skipped path is never silent."""
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


def skipped_path_lines(tool_name: str, skipped: "dict[str, str]") -> list[str]:
    """One line per path a tool left out, with the reason: a skip is never
    silent."""
    return [f"{tool_name}: {name} skipped: {reason}" for name, reason in skipped.items()]


def build_path(name: str, factory: DualNormPathFactory, eps: float) -> DualNormPath:
    """``factory(eps)``; its PathUnavailable names the path."""
    try:
        return factory(eps)
    except PathUnavailable as unavailable:
        raise PathUnavailable(f"path {name!r}: {unavailable}") from unavailable


def refuse_unavailable(reasons: Mapping[str, str]) -> None:
    """Raises PathUnavailable for the first of the paths named (with the
    reason each cannot run here), so the command exits 2 before running
    any path."""
    for name, reason in reasons.items():
        raise PathUnavailable(f"path {name!r}: {reason}")


@dataclasses.dataclass(frozen=True)
class PathSelection:
    """The paths a command may be asked for with ``--path``, and those it
    runs when none is named.

    ``factories``: the dual norm paths ``--path`` accepts (every registered
    path but the reference, or a caller's own); ``extra_names``: names it
    accepts that are not dual norm paths (parity's norm + RoPE paths);
    ``default_names``: what runs without ``--path``; ``registered``: whether
    these are the registered paths rather than a caller's own (a test's)."""

    factories: dict[str, DualNormPathFactory]
    default_names: list[str]
    extra_names: list[str] = dataclasses.field(default_factory=list)
    registered: bool = True

    @classmethod
    def of(
        cls,
        path_factories: Optional[Mapping[str, DualNormPathFactory]],
        default_factories: Mapping[str, DualNormPathFactory],
        *,
        extra_names: Sequence[str] = (),
        extra_default_names: Sequence[str] = (),
    ) -> "PathSelection":
        """The registered paths, ``default_factories`` (and
        ``extra_default_names``) running by default; or, when
        ``path_factories`` is given, those alone, all by default, with no
        extra names."""
        if path_factories is not None:
            return cls(dict(path_factories), list(path_factories), registered=False)
        return cls(
            {name: path.factory for name, path in PATH_REGISTRY.items() if name != REFERENCE_PATH},
            [*default_factories, *extra_default_names],
            list(extra_names),
        )

    def add_path_argument(self, parser: argparse.ArgumentParser, verb: str) -> None:
        parser.add_argument(
            "--path",
            dest="path_names",
            action="append",
            choices=[*self.factories, *self.extra_names],
            help=f"path to {verb} (repeatable; default: {', '.join(self.default_names)})",
        )

    def named(self, arguments: argparse.Namespace) -> list[str]:
        """The paths ``--path`` named (each once, however often named), or
        the default ones."""
        return list(dict.fromkeys(arguments.path_names or ())) or self.default_names

    def factories_named(self, names: Sequence[str]) -> dict[str, DualNormPathFactory]:
        """The dual norm paths among ``names`` (extra names left out)."""
        return {name: self.factories[name] for name in names if name in self.factories}
