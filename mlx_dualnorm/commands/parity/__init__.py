"""The parity contract: any dual head norm path against the composed path.

The package's one promise is that ``CompiledDualHeadNorm(eps)(q, k, wq, wk)``
returns exactly what two ``mx.fast.rms_norm`` calls return. This module
checks that promise for ANY callable with the signature
``path(queries, keys, query_weight, key_weight) -> (normalized_queries,
normalized_keys)``, built per epsilon by a factory ``make_path(eps)``, over
the designed matrix of :mod:`mlx_dualnorm.commands.parity.matrix`, on inputs
built by :mod:`mlx_dualnorm.commands.parity.inputs`, compared and reported by
:mod:`mlx_dualnorm.commands.parity.report` (same shape, dtype and values;
with ``bitwise=True`` the same bits). Bits are the promise, so the command
line compares bits unless ``--values`` asks for values only. It also checks
the dual head norm + RoPE (:mod:`mlx_dualnorm.commands.parity.rope`), and ends
with a one-line verdict, after a line for each path it left out and why.

The paths are those of :mod:`mlx_dualnorm.commands.shared.paths`, by the names every
tool uses; another path joins by ``register_path``, or by passing a mapping
of factories to :func:`run_parity_matrix` or :func:`main`. The names in
``__all__`` that this module does not define are the parity check's API,
re-exported from the modules that define them.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable, Mapping, Optional, Sequence

import mlx.core as mx

from mlx_dualnorm import composed_dual_head_norm
from mlx_dualnorm.commands.shared import command, paths as compared_paths
from mlx_dualnorm.commands.parity import rope as rope_parity
from mlx_dualnorm.commands.parity.inputs import (
    DEFAULT_PARITY_SEED, DtypeConfiguration, DualNormInputs, HeadCounts, InputLayout,
    ParityCase, ValueProfile, WeightLayout, Weighting, build_case_inputs,
    generate_head_values,
)
from mlx_dualnorm.commands.parity.matrix import (
    FAMILY_NAMES,
    build_full_parity_matrix,
    build_quick_parity_matrix,
)
from mlx_dualnorm.commands.parity.report import (
    OutputDifference, ParityMismatch, ParityReport, compare_call, compare_dual_outputs,
    format_parity_report, parity_verdict,
)
from mlx_dualnorm.commands.shared.paths import (
    PATH_REGISTRY, DualNormPath, DualNormPathFactory, PathSelection, build_path,
    make_compiled_path, make_composed_path, make_mx_compile_path, refuse_unavailable,
    routinely_checked_paths, unavailable_paths,
)

__all__ = [
    "DEFAULT_PARITY_SEED", "DualNormInputs", "DualNormPath", "DualNormPathFactory",
    "DtypeConfiguration", "HeadCounts", "InputLayout", "OutputDifference", "PATH_FACTORIES",
    "ParityCase", "ParityMismatch", "ParityReport", "ValueProfile", "WeightLayout",
    "Weighting", "build_case_inputs", "build_full_parity_matrix", "build_parser",
    "build_quick_parity_matrix", "check_path_parity", "check_paths", "compare_dual_outputs",
    "format_parity_report", "generate_head_values", "main", "parity_verdict",
    "skipped_path_lines", "make_compiled_path", "make_composed_path",
    "make_mx_compile_path", "run_parity_matrix",
]

PATH_FACTORIES: dict[str, DualNormPathFactory] = routinely_checked_paths()
"""The paths checked when none is named: every mode this build and device
can run, and Python's mx.compile for comparison (see tools.compared_paths)."""


# ---- Running ----------------------------------------------------------------------


def run_parity_matrix(
    path_factories: Mapping[str, DualNormPathFactory],
    cases: Sequence[ParityCase],
    *,
    seed: int = DEFAULT_PARITY_SEED,
    matrix_name: str = "custom",
    bitwise: bool = False,
    reports: Optional[dict[str, ParityReport]] = None,
    case_done: Optional[Callable[[ParityCase], None]] = None,
) -> dict[str, ParityReport]:
    """Runs every path over every case. Inputs and the composed outputs are
    built once per case and shared by the paths; each factory is called once
    per epsilon, so compiled paths are reused across cases as in a model.

    ``reports``, if given (empty), is filled as the cases run, so a caller
    interrupted part way still holds what ran; ``case_done`` is called
    after each case (progress). A factory's PathUnavailable propagates,
    naming the path."""
    if reports is None:
        reports = {}
    reports.update(
        (path_name, ParityReport(path_name, matrix_name, seed, bitwise))
        for path_name in path_factories
    )
    paths_by_name_and_eps: dict[tuple[str, float], DualNormPath] = {}
    for case in cases:
        inputs = build_case_inputs(case, seed)
        expected = composed_dual_head_norm(
            inputs.queries, inputs.keys, inputs.query_weight, inputs.key_weight, case.eps
        )
        mx.eval(expected)
        for path_name, path_factory in path_factories.items():
            started = time.perf_counter()
            path_key = (path_name, case.eps)
            if path_key not in paths_by_name_and_eps:
                paths_by_name_and_eps[path_key] = build_path(path_name, path_factory, case.eps)
            path = paths_by_name_and_eps[path_key]
            mismatch = compare_call(
                case,
                lambda: path(inputs.queries, inputs.keys, inputs.query_weight, inputs.key_weight),
                expected,
                bitwise,
            )
            reports[path_name].record(case.family, mismatch, time.perf_counter() - started)
        if case_done is not None:
            case_done(case)
    return reports


def check_path_parity(
    path_factory: DualNormPathFactory,
    *,
    quick: bool = False,
    seed: int = DEFAULT_PARITY_SEED,
    path_name: str = "path under test",
    bitwise: bool = False,
    families: Optional[Sequence[str]] = None,
) -> ParityReport:
    """One path over the full (or quick) matrix, optionally only some
    families."""
    cases = build_quick_parity_matrix(seed) if quick else build_full_parity_matrix(seed)
    if families is not None:
        unknown_families = set(families) - set(FAMILY_NAMES)
        if unknown_families:
            raise ValueError(f"unknown parity families: {sorted(unknown_families)}")
        cases = [case for case in cases if case.family in families]
    return run_parity_matrix(
        {path_name: path_factory},
        cases,
        seed=seed,
        matrix_name="quick" if quick else "full",
        bitwise=bitwise,
    )[path_name]


# ---- The command line ---------------------------------------------------------------


def skipped_path_lines(skipped: Mapping[str, str]) -> list[str]:
    return compared_paths.skipped_path_lines("parity", dict(skipped))


def _parity_parser(selection: PathSelection) -> argparse.ArgumentParser:
    parser = command.tool_parser(
        "parity",
        "Check dual head norm paths against two mx.fast.rms_norm calls, and the "
        "dual head norm + RoPE against composed_dual_head_norm_rope: same shape, "
        "same dtype, the same bits (with --values: equal values, NaN matching NaN). "
        "Exit status 0 all identical, 1 a mismatch, 2 bad usage or a path that "
        "cannot run here, 130 interrupted.",
    )
    selection.add_path_argument(parser, "check")
    parser.add_argument(
        "--quick", action="store_true",
        help=f"run the quick matrix ({len(build_quick_parity_matrix())} dual norm cases and "
        f"{len(rope_parity.build_rope_parity_matrix(quick=True))} norm + RoPE cases)",
    )
    parser.add_argument(
        "--seed", type=command.seed, default=DEFAULT_PARITY_SEED,
        help="seed of the matrix and its values",
    )
    parser.add_argument(
        "--family",
        dest="families",
        action="append",
        choices=[*FAMILY_NAMES, rope_parity.ROPE_FAMILY, rope_parity.ROPE_ONLY_FAMILY],
        help="only this family of cases (repeatable; default: all)",
    )
    parser.add_argument(
        "--values",
        dest="bitwise",
        action="store_false",
        help="compare values (NaN equal to NaN, -0 equal to +0) instead of bits",
    )
    # Bits are the default; --bitwise stays accepted for command lines that say so.
    parser.add_argument("--bitwise", action="store_true", help=argparse.SUPPRESS)
    command.add_device_argument(parser)
    return parser


PROGRESS_INTERVAL_SECONDS = 5.0


def _skipped_by_default(selection: PathSelection) -> dict[str, str]:
    """The paths a run without --path leaves out, and why."""
    skipped = unavailable_paths(list(selection.factories))
    for name in selection.factories:
        path = PATH_REGISTRY.get(name)
        if name not in skipped and path is not None and not path.routinely_checked:
            skipped[name] = f"not checked by default (it retraces per shape; --path {name})"
    skipped.update(rope_parity.unavailable_rope_paths(selection.extra_names))
    return skipped


def check_paths(
    path_factories: Mapping[str, DualNormPathFactory],
    rope_path_names: Sequence[str],
    *,
    quick: bool,
    seed: int = DEFAULT_PARITY_SEED,
    families: Optional[Sequence[str]] = None,
    bitwise: bool = True,
) -> list[ParityReport]:
    """The dual norm paths over the (quick or full) matrix, then the norm +
    RoPE paths over theirs, each report printed; progress on stderr. On
    Ctrl-C, the reports of the cases that ran are printed, said to be
    partial, and the interrupt goes on."""
    cases = build_quick_parity_matrix(seed) if quick else build_full_parity_matrix(seed)
    if families:
        cases = [case for case in cases if case.family in families]
    rope_cases = [
        case for case in rope_parity.build_rope_parity_matrix(quick=quick)
        if not families or case.family in families
    ]
    matrix_name = "quick" if quick else "full"
    progress = command.StepProgress(
        f"parity, {matrix_name} matrix, cases",
        len(cases) if path_factories else 0,
        min_interval_s=PROGRESS_INTERVAL_SECONDS,
    )
    reports: dict[str, ParityReport] = {}
    try:
        if path_factories and cases:
            run_parity_matrix(
                path_factories,
                cases,
                seed=seed,
                matrix_name=matrix_name,
                bitwise=bitwise,
                reports=reports,
                case_done=lambda case: progress.step(f"[{case.family}]"),
            )
        if rope_path_names and rope_cases:
            reports.update(
                rope_parity.run_rope_parity_matrix(
                    rope_path_names, rope_cases, seed=seed, matrix_name=matrix_name,
                    bitwise=bitwise,
                )
            )
    except KeyboardInterrupt:
        for report in reports.values():
            print(format_parity_report(report))
        print(
            f"parity: INTERRUPTED after {progress.done} of {len(cases)} cases; "
            "the reports above cover only the cases that ran",
            flush=True,
        )
        raise
    for report in reports.values():
        print(format_parity_report(report))
    return list(reports.values())


def _path_selection(
    path_factories: Optional[Mapping[str, DualNormPathFactory]]
) -> PathSelection:
    return PathSelection.of(
        path_factories,
        PATH_FACTORIES,
        extra_names=list(rope_parity.ROPE_PATH_DESCRIPTIONS),
        extra_default_names=rope_parity.available_rope_paths(),
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser, over the registered paths."""
    return _parity_parser(_path_selection(None))


def main(
    argv: Optional[Sequence[str]] = None,
    *,
    path_factories: Optional[Mapping[str, DualNormPathFactory]] = None,
) -> int:
    """``python -m mlx_dualnorm parity``: prints one report per path and a
    verdict line; exits 1 when any path mismatches anywhere, 2 when a path
    named cannot run here. ``path_factories`` replaces the registered paths
    (a test's deliberately broken path, say), the norm + RoPE left out."""
    selection = _path_selection(path_factories)

    def run(arguments: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        command.select_device(arguments.device, parser)
        named = selection.named(arguments)
        rope_names = [name for name in named if name in selection.extra_names]
        refuse_unavailable(rope_parity.unavailable_rope_paths(rope_names))
        reports = check_paths(
            selection.factories_named(named),
            rope_names,
            quick=arguments.quick,
            seed=arguments.seed,
            families=arguments.families,
            bitwise=arguments.bitwise,
        )
        if not arguments.path_names:
            for line in skipped_path_lines(_skipped_by_default(selection)):
                print(line)
        print(parity_verdict(reports))
        passed = all(report.passed for report in reports)
        return command.EXIT_OK if passed else command.EXIT_MISMATCH

    return command.run_tool(_parity_parser(selection), run, argv)
