"""What a parity run finds: how a path's outputs are compared with the
reference's, what a mismatch records, a path's report and how it prints.

An output agrees when its shape and dtype match the reference's and
``mx.array_equal(actual, expected, equal_nan=True)`` holds; ``bitwise=True``
additionally demands identical bit patterns (signed zeros, NaN signs and
payloads). The dual head norm's parity (:mod:`mlx_dualnorm.commands.parity`)
and the norm + RoPE's (:mod:`mlx_dualnorm.commands.parity.rope`) both report
through this module.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

import mlx.core as mx

from mlx_dualnorm.bits import count_bit_differences, count_value_differences
from mlx_dualnorm.commands.parity.matrix import FAMILY_NAMES
from mlx_dualnorm.commands.shared.paths import REFERENCE_PATH, describe_paths

__all__ = [
    "DescribedCase", "OutputDifference", "ParityMismatch", "ParityReport", "compare_call",
    "compare_dual_outputs", "format_parity_report", "parity_verdict",
]

@dataclass(frozen=True)
class OutputDifference:
    """How one output of a path differs from the composed path's."""

    output_name: str  # "normalized queries" or "normalized keys"
    reason: str  # "shape", "dtype", "values" or "bit patterns"
    differing_elements: int
    element_count: int
    detail: str = ""

    def describe(self) -> str:
        counted = f"{self.differing_elements}/{self.element_count} elements"
        suffix = f" ({self.detail})" if self.detail else ""
        return f"{self.output_name}: {self.reason} differ, {counted}{suffix}"


def _compare_output(
    output_name: str, actual: mx.array, expected: mx.array, bitwise: bool
) -> Optional[OutputDifference]:
    if actual.shape != expected.shape:
        return OutputDifference(
            output_name,
            "shape",
            max(actual.size, expected.size),
            expected.size,
            f"{tuple(actual.shape)} instead of {tuple(expected.shape)}",
        )
    if actual.dtype != expected.dtype:
        return OutputDifference(
            output_name,
            "dtype",
            count_value_differences(actual, expected),
            expected.size,
            f"{actual.dtype} instead of {expected.dtype}",
        )
    differing_values = count_value_differences(actual, expected)
    if differing_values:
        return OutputDifference(output_name, "values", differing_values, expected.size)
    if bitwise:
        differing_bits = count_bit_differences(actual, expected)
        if differing_bits:
            return OutputDifference(
                output_name,
                "bit patterns",
                differing_bits,
                expected.size,
                "signed zeros or NaN signs/payloads",
            )
    return None


def compare_dual_outputs(
    actual: tuple[mx.array, mx.array],
    expected: tuple[mx.array, mx.array],
    *,
    bitwise: bool = False,
) -> tuple[OutputDifference, ...]:
    """The contract, output by output: same shape, same dtype, equal values
    with NaN matching NaN (and with ``bitwise``, the same bits). Empty when
    the path agrees."""
    if not isinstance(actual, (tuple, list)) or len(actual) != 2:
        raise TypeError(f"a dual norm path must return two arrays, got {type(actual).__name__}")
    differences = []
    for output_name, actual_output, expected_output in zip(
        ("normalized queries", "normalized keys"), actual, expected
    ):
        difference = _compare_output(output_name, actual_output, expected_output, bitwise)
        if difference is not None:
            differences.append(difference)
    return tuple(differences)


# ---- What a run records ------------------------------------------------------------


class DescribedCase(Protocol):
    """What a report needs of a case: its family and a description that
    reproduces it (a dual norm ``ParityCase``, a norm + RoPE case)."""

    @property
    def family(self) -> str: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class ParityMismatch:
    """A case where the path broke the contract, or raised."""

    case: DescribedCase
    differences: tuple[OutputDifference, ...] = ()
    error: Optional[str] = None

    @property
    def case_description(self) -> str:
        return self.case.describe()

    @property
    def differing_elements(self) -> int:
        return sum(difference.differing_elements for difference in self.differences)

    def describe(self) -> str:
        if self.error is not None:
            what = f"raised {self.error}"
        else:
            what = "; ".join(difference.describe() for difference in self.differences)
        return f"[{self.case.family}] {self.case_description}: {what}"


@dataclass
class ParityReport:
    """What one path did over one matrix."""

    path_name: str
    matrix_name: str
    seed: int
    bitwise: bool = False
    cases_run: int = 0
    mismatches: list[ParityMismatch] = field(default_factory=list)
    cases_per_family: Counter = field(default_factory=Counter)
    mismatched_cases_per_family: Counter = field(default_factory=Counter)
    elapsed_seconds: float = 0.0
    reference_description: str = f"{REFERENCE_PATH!r} (2 x mx.fast.rms_norm)"
    path_description: str = ""  # "name: what it is"; empty: the registered path's

    @property
    def passed(self) -> bool:
        return self.cases_run > 0 and not self.mismatches

    def record(self, family: str, mismatch: Optional[ParityMismatch], seconds: float) -> None:
        """One case ran (``mismatch`` None when the path agreed), taking
        ``seconds`` in the path."""
        self.cases_run += 1
        self.cases_per_family[family] += 1
        self.elapsed_seconds += seconds
        if mismatch is not None:
            self.mismatches.append(mismatch)
            self.mismatched_cases_per_family[family] += 1

    @property
    def mismatched_families(self) -> set[str]:
        return {family for family, count in self.mismatched_cases_per_family.items() if count}


def compare_call(
    case: DescribedCase,
    call: Callable[[], "tuple[mx.array, mx.array]"],
    expected: tuple[mx.array, mx.array],
    bitwise: bool,
) -> Optional[ParityMismatch]:
    """Runs ``call`` (a path on one case's inputs) and compares its outputs
    with ``expected``: None when the path agrees, else the mismatch. A
    raising path is a broken contract, recorded, not a harness crash."""
    try:
        actual = call()
        mx.eval(actual)
        differences = compare_dual_outputs(actual, expected, bitwise=bitwise)
    except Exception as error:
        return ParityMismatch(case, error=f"{type(error).__name__}: {error}")
    return ParityMismatch(case, differences) if differences else None


# ---- Printing ------------------------------------------------------------------------

MISMATCHES_LISTED_PER_REPORT = 20


def format_parity_report(report: ParityReport) -> str:
    """A short table: cases and mismatched cases per family, then the first
    mismatches with their case descriptions."""
    contract = "bit patterns" if report.bitwise else "values (array_equal, NaN equal to NaN)"
    lines = [
        f"parity of {report.path_name!r} against {report.reference_description}, "
        f"{report.matrix_name} matrix, seed {report.seed}: dtype + shape + {contract}",
        f"  {report.path_description or describe_paths([report.path_name])[0]}",
        f"  {'family':<20} {'cases':>6} {'mismatched':>11}",
    ]
    families = [family for family in FAMILY_NAMES if family in report.cases_per_family]
    families += sorted(set(report.cases_per_family) - set(FAMILY_NAMES))
    for family in families:
        lines.append(
            f"  {family:<20} {report.cases_per_family[family]:>6} "
            f"{report.mismatched_cases_per_family[family]:>11}"
        )
    lines.append(
        f"  {'total':<20} {report.cases_run:>6} {len(report.mismatches):>11}"
        f"   {report.elapsed_seconds:.2f} s in the path"
    )
    for mismatch in report.mismatches[:MISMATCHES_LISTED_PER_REPORT]:
        lines.append(f"  MISMATCH {mismatch.describe()}")
    unlisted = len(report.mismatches) - MISMATCHES_LISTED_PER_REPORT
    if unlisted > 0:
        lines.append(f"  ... and {unlisted} more mismatched cases")
    lines.append("  PASS" if report.passed else "  FAIL")
    return "\n".join(lines)


def parity_verdict(reports: Sequence[ParityReport]) -> str:
    """The one line a parity run ends with: every path identical, or which
    paths mismatched."""
    contract = "bit-identical" if all(report.bitwise for report in reports) else "value-identical"
    failed = [report.path_name for report in reports if not report.passed]
    if not failed:
        return f"parity: all {len(reports)} path{'s' if len(reports) != 1 else ''} {contract}"
    return (
        f"parity: MISMATCH in {', '.join(failed)} "
        f"({len(reports) - len(failed)} of {len(reports)} paths {contract})"
    )
