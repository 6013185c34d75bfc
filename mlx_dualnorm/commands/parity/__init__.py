"""``python -m mlx_dualnorm parity``: the dual head norm paths of ``shared.paths`` against two
``mx.fast.rms_norm`` calls, and the norm + RoPE against its composed path, over the cases of
:mod:`.matrices`: same shape, dtype and bits (``--values``: values). Here: the comparison, the
report, running, the command line."""

from __future__ import annotations

import argparse
import functools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import mlx.core as mx

from mlx_dualnorm import composed_dual_head_norm
from mlx_dualnorm.bits import count_bit_differences, count_value_differences
from mlx_dualnorm.commands.shared import command, paths as compared_paths
from mlx_dualnorm.commands.parity import matrices
from mlx_dualnorm.commands.parity.cases import (
    DEFAULT_PARITY_SEED, Outputs, ParityCase, PathCalls, build_case_inputs,
)
from mlx_dualnorm.commands.parity.matrices import (
    FAMILY_NAMES, Case, RopeParityCase, build_full_parity_matrix, build_quick_parity_matrix,
)
from mlx_dualnorm.commands.shared.paths import (
    PATH_REGISTRY, REFERENCE_PATH, DualNormPath, DualNormPathFactory, PathSelection, build_path,
    describe_paths, refuse_unavailable, routinely_checked_paths, unavailable_paths,
)

PATH_FACTORIES: dict[str, DualNormPathFactory] = routinely_checked_paths()
"""The paths checked when none is named: every mode this build and device
can run, and Python's mx.compile for comparison."""
PROGRESS_INTERVAL_SECONDS = 5.0
MISMATCHES_LISTED_PER_REPORT = 20


@dataclass(frozen=True)
class OutputDifference:
    """How one output of a path differs from the reference's."""

    output_name: str  # "normalized queries" or "normalized keys"
    reason: str  # "shape", "dtype", "values" or "bit patterns"
    differing_elements: int
    element_count: int
    detail: str = ""

    def describe(self) -> str:
        suffix = f" ({self.detail})" if self.detail else ""
        return (f"{self.output_name}: {self.reason} differ, "
                f"{self.differing_elements}/{self.element_count} elements{suffix}")


def compare_dual_outputs(
    actual: Outputs, expected: Outputs, *, bitwise: bool = False,
) -> tuple[OutputDifference, ...]:
    """The contract, output by output: same shape, same dtype, equal values with NaN matching
    NaN (and with ``bitwise``, the same bits). Empty when the path agrees."""
    if not isinstance(actual, (tuple, list)) or len(actual) != 2:
        raise TypeError(f"a dual norm path must return two arrays, got {type(actual).__name__}")
    differences = []
    for name, output, reference in zip(("normalized queries", "normalized keys"), actual, expected):
        if output.shape != reference.shape:
            differences.append(OutputDifference(
                name, "shape", max(output.size, reference.size), reference.size,
                f"{tuple(output.shape)} instead of {tuple(reference.shape)}"))
        elif output.dtype != reference.dtype:
            differences.append(OutputDifference(
                name, "dtype", count_value_differences(output, reference), reference.size,
                f"{output.dtype} instead of {reference.dtype}"))
        elif differing := count_value_differences(output, reference):
            differences.append(OutputDifference(name, "values", differing, reference.size))
        elif bitwise and (differing := count_bit_differences(output, reference)):
            differences.append(OutputDifference(name, "bit patterns", differing, reference.size,
                                                "signed zeros or NaN signs/payloads"))
    return tuple(differences)


@dataclass(frozen=True)
class ParityMismatch:
    """A case where the path broke the contract, or raised."""

    case: ParityCase | RopeParityCase
    differences: tuple[OutputDifference, ...] = ()
    error: Optional[str] = None

    @property
    def differing_elements(self) -> int:
        return sum(difference.differing_elements for difference in self.differences)

    def describe(self) -> str:
        what = (f"raised {self.error}" if self.error is not None
                else "; ".join(difference.describe() for difference in self.differences))
        return f"[{self.case.family}] {self.case.describe()}: {what}"


@dataclass
class ParityReport:
    """What one path did over one matrix."""

    path_name: str
    matrix_name: str
    seed: int
    bitwise: bool = False
    mismatches: list[ParityMismatch] = field(default_factory=list)
    cases_per_family: Counter = field(default_factory=Counter)
    elapsed_seconds: float = 0.0  # in the path
    reference_description: str = f"{REFERENCE_PATH!r} (2 x mx.fast.rms_norm)"
    path_description: str = ""  # "name: what it is"; empty: the registered path's

    @property
    def cases_run(self) -> int:
        return sum(self.cases_per_family.values())

    @property
    def mismatched_cases_per_family(self) -> Counter:
        return Counter(mismatch.case.family for mismatch in self.mismatches)

    @property
    def mismatched_families(self) -> set[str]:
        return set(self.mismatched_cases_per_family)

    @property
    def passed(self) -> bool:
        return self.cases_run > 0 and not self.mismatches


def format_parity_report(report: ParityReport) -> str:
    """A short table of cases and mismatched cases per family, then the first mismatches."""
    contract = "bit patterns" if report.bitwise else "values (array_equal, NaN equal to NaN)"
    lines = [
        f"parity of {report.path_name!r} against {report.reference_description}, "
        f"{report.matrix_name} matrix, seed {report.seed}: dtype + shape + {contract}",
        f"  {report.path_description or describe_paths([report.path_name])[0]}",
        f"  {'family':<20} {'cases':>6} {'mismatched':>11}",
    ]
    families = [family for family in FAMILY_NAMES if family in report.cases_per_family]
    mismatched = report.mismatched_cases_per_family
    for family in families + sorted(set(report.cases_per_family) - set(FAMILY_NAMES)):
        lines.append(f"  {family:<20} {report.cases_per_family[family]:>6} "
                     f"{mismatched[family]:>11}")
    lines.append(f"  {'total':<20} {report.cases_run:>6} {len(report.mismatches):>11}"
                 f"   {report.elapsed_seconds:.2f} s in the path")
    lines += [f"  MISMATCH {mismatch.describe()}"
              for mismatch in report.mismatches[:MISMATCHES_LISTED_PER_REPORT]]
    if len(report.mismatches) > MISMATCHES_LISTED_PER_REPORT:
        unlisted = len(report.mismatches) - MISMATCHES_LISTED_PER_REPORT
        lines.append(f"  ... and {unlisted} more mismatched cases")
    lines.append("  PASS" if report.passed else "  FAIL")
    return "\n".join(lines)


def parity_verdict(reports: Sequence[ParityReport]) -> str:
    """The line a parity run ends with: every path identical, or which mismatched."""
    contract = "bit-identical" if all(report.bitwise for report in reports) else "value-identical"
    failed = [report.path_name for report in reports if not report.passed]
    if not failed:
        return f"parity: all {len(reports)} path{'s' if len(reports) != 1 else ''} {contract}"
    return (f"parity: MISMATCH in {', '.join(failed)} "
            f"({len(reports) - len(failed)} of {len(reports)} paths {contract})")


def run_cases(
    reports: dict[str, ParityReport], cases: Sequence[Case],
    prepare: Callable[[Case], tuple[Outputs, PathCalls]], bitwise: bool,
    case_done: Optional[Callable[[Case], None]] = None,
) -> dict[str, ParityReport]:
    """Each case against its reference, for each path of ``reports``: ``prepare(case)`` gives
    the reference's outputs and a path's call on the case's inputs, by name. A raising call is a
    broken contract, recorded, not a harness crash."""
    for case in cases:
        expected, path_call = prepare(case)
        mx.eval(expected)
        for path_name, report in reports.items():
            started = time.perf_counter()
            call = path_call(path_name)
            try:
                actual = call()
                mx.eval(actual)
                differences = compare_dual_outputs(actual, expected, bitwise=bitwise)
                mismatch = ParityMismatch(case, differences) if differences else None
            except Exception as error:
                mismatch = ParityMismatch(case, error=f"{type(error).__name__}: {error}")
            report.cases_per_family[case.family] += 1
            report.elapsed_seconds += time.perf_counter() - started
            if mismatch is not None:
                report.mismatches.append(mismatch)
        if case_done is not None:
            case_done(case)
    return reports


def run_parity_matrix(
    path_factories: Mapping[str, DualNormPathFactory], cases: Sequence[ParityCase], *,
    seed: int = DEFAULT_PARITY_SEED, matrix_name: str = "custom", bitwise: bool = False,
    reports: Optional[dict[str, ParityReport]] = None,
    case_done: Optional[Callable[[ParityCase], None]] = None,
) -> dict[str, ParityReport]:
    """Every path over every case; each factory is called once per epsilon, so compiled paths
    are reused across cases as in a model. A given (empty) ``reports`` fills as the cases run, so
    an interrupted caller still holds what ran. A factory's PathUnavailable names the path."""
    reports = {} if reports is None else reports
    run_reports = {name: ParityReport(name, matrix_name, seed, bitwise) for name in path_factories}
    reports.update(run_reports)

    @functools.cache
    def path(name: str, eps: float) -> DualNormPath:
        return build_path(name, path_factories[name], eps)

    def prepare(case: ParityCase) -> tuple[Outputs, PathCalls]:
        inputs = build_case_inputs(case, seed)
        return (composed_dual_head_norm(*inputs, case.eps),
                lambda name: functools.partial(path(name, case.eps), *inputs))

    run_cases(run_reports, cases, prepare, bitwise, case_done)
    return reports


def run_rope_parity_matrix(
    path_names: Sequence[str], cases: Sequence[RopeParityCase], *, seed: int, matrix_name: str,
    bitwise: bool = True,
) -> dict[str, ParityReport]:
    """Every rope path over every case, against the composed norm + RoPE."""
    descriptions = matrices.ROPE_PATH_DESCRIPTIONS
    reports = {
        name: ParityReport(
            name, matrix_name, seed, bitwise,
            reference_description=matrices.ROPE_REFERENCE_DESCRIPTION,
            path_description=f"{name}: {descriptions[name]}" if name in descriptions else "",
        )
        for name in path_names
    }
    return run_cases(reports, cases, lambda case: matrices.prepare_rope_case(case, seed), bitwise)


def _matrix(quick: bool, seed: int, families: Optional[Sequence[str]]) -> list[ParityCase]:
    cases = build_quick_parity_matrix(seed) if quick else build_full_parity_matrix(seed)
    return matrices.of_families(cases, families)


def check_path_parity(
    path_factory: DualNormPathFactory, *, quick: bool = False, seed: int = DEFAULT_PARITY_SEED,
    path_name: str = "path under test", bitwise: bool = False,
    families: Optional[Sequence[str]] = None,
) -> ParityReport:
    """One path over the full (or quick) matrix, optionally only some families."""
    unknown_families = set(families or ()) - set(FAMILY_NAMES)
    if unknown_families:
        raise ValueError(f"unknown parity families: {sorted(unknown_families)}")
    return run_parity_matrix(
        {path_name: path_factory}, _matrix(quick, seed, families), seed=seed,
        matrix_name="quick" if quick else "full", bitwise=bitwise,
    )[path_name]


def check_paths(
    path_factories: Mapping[str, DualNormPathFactory], rope_path_names: Sequence[str], *,
    quick: bool, seed: int = DEFAULT_PARITY_SEED, families: Optional[Sequence[str]] = None,
    bitwise: bool = True,
) -> list[ParityReport]:
    """The dual norm paths over their matrix, then the norm + RoPE paths over theirs, each report
    printed; progress on stderr. On Ctrl-C, the reports of the cases that ran are printed, said
    to be partial, and the interrupt goes on."""
    cases = _matrix(quick, seed, families)
    rope_cases = matrices.of_families(matrices.build_rope_parity_matrix(quick=quick), families)
    matrix_name = "quick" if quick else "full"
    progress = command.StepProgress(f"parity, {matrix_name} matrix, cases", len(cases),
                                    min_interval_s=PROGRESS_INTERVAL_SECONDS)
    reports: dict[str, ParityReport] = {}
    try:
        if path_factories and cases:
            run_parity_matrix(path_factories, cases, seed=seed, matrix_name=matrix_name,
                              bitwise=bitwise, reports=reports,
                              case_done=lambda case: progress.step(f"[{case.family}]"))
        if rope_path_names and rope_cases:
            reports.update(run_rope_parity_matrix(rope_path_names, rope_cases, seed=seed,
                                                  matrix_name=matrix_name, bitwise=bitwise))
    except KeyboardInterrupt:
        for report in reports.values():
            print(format_parity_report(report))
        print(f"parity: INTERRUPTED after {progress.done} of {len(cases)} cases; "
              "the reports above cover only the cases that ran", flush=True)
        raise
    for report in reports.values():
        print(format_parity_report(report))
    return list(reports.values())


def skipped_path_lines(skipped: Mapping[str, str]) -> list[str]:
    return compared_paths.skipped_path_lines("parity", dict(skipped))


def _path_selection(path_factories: Optional[Mapping[str, DualNormPathFactory]]) -> PathSelection:
    return PathSelection.of(
        path_factories, PATH_FACTORIES, extra_names=list(matrices.ROPE_PATH_DESCRIPTIONS),
        extra_default_names=matrices.available_rope_paths(),
    )


def build_parser(selection: Optional[PathSelection] = None) -> argparse.ArgumentParser:
    """The command line's parser, by default over the registered paths."""
    selection = selection or _path_selection(None)
    parser = command.tool_parser(
        "parity",
        "Check dual head norm paths against two mx.fast.rms_norm calls, and the dual head norm + "
        "RoPE against composed_dual_head_norm_rope: same shape, same dtype, the same bits (with "
        "--values: equal values, NaN matching NaN). Exit status 0 all identical, 1 a mismatch, "
        "2 bad usage or a path that cannot run here, 130 interrupted.",
    )
    selection.add_path_argument(parser, "check")
    parser.add_argument(
        "--quick", action="store_true",
        help=f"run the quick matrix ({len(build_quick_parity_matrix())} dual norm cases and "
        f"{len(matrices.build_rope_parity_matrix(quick=True))} norm + RoPE cases)",
    )
    parser.add_argument("--seed", type=command.seed, default=DEFAULT_PARITY_SEED,
                        help="seed of the matrix and its values")
    parser.add_argument("--family", dest="families", action="append",
                        choices=[*FAMILY_NAMES, matrices.ROPE_FAMILY, matrices.ROPE_ONLY_FAMILY],
                        help="only this family of cases (repeatable; default: all)")
    parser.add_argument("--values", dest="bitwise", action="store_false",
                        help="compare values (NaN equal to NaN, -0 equal to +0) instead of bits")
    # Bits are the default; --bitwise stays accepted for command lines that say so.
    parser.add_argument("--bitwise", action="store_true", help=argparse.SUPPRESS)
    command.add_device_argument(parser)
    return parser


def main(
    argv: Optional[Sequence[str]] = None, *,
    path_factories: Optional[Mapping[str, DualNormPathFactory]] = None,
) -> int:
    """Prints one report per path and a verdict line; exits 1 when any path mismatches, 2 when a
    path named cannot run here. ``path_factories`` replaces the registered paths (a test's
    deliberately broken path, say), the norm + RoPE left out."""
    selection = _path_selection(path_factories)

    def run(arguments: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        command.select_device(arguments.device, parser)
        named = selection.named(arguments)
        rope_names = [name for name in named if name in selection.extra_names]
        refuse_unavailable(matrices.unavailable_rope_paths(rope_names))
        reports = check_paths(
            selection.factories_named(named), rope_names, quick=arguments.quick,
            seed=arguments.seed, families=arguments.families, bitwise=arguments.bitwise,
        )
        if not arguments.path_names:  # say what the default run left out, and why
            skipped = unavailable_paths(list(selection.factories))
            for name in selection.factories:
                path = PATH_REGISTRY.get(name)
                if name not in skipped and path is not None and not path.routinely_checked:
                    skipped[name] = f"not checked by default (it retraces per shape; --path {name})"
            skipped.update(matrices.unavailable_rope_paths(selection.extra_names))
            for line in skipped_path_lines(skipped):
                print(line)
        print(parity_verdict(reports))
        passed = all(report.passed for report in reports)
        return command.EXIT_OK if passed else command.EXIT_MISMATCH

    return command.run_tool(build_parser(selection), run, argv)
