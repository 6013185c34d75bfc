"""What a parity run finds (the comparison, a path's report, how it prints), and
the parity of the dual head norm + RoPE: ``CompiledDualHeadNormRope`` against
``composed_dual_head_norm_rope`` over a small matrix of its own (it takes RoPE's
parameters and an offset), one path ``rope_MODE`` per mode but the reference."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, TypeVar, Union, cast

import mlx.core as mx

from mlx_dualnorm import (
    CompiledDualHeadNormRope, Mode, available_modes, composed_dual_head_norm_rope,
)
from mlx_dualnorm.bits import count_bit_differences, count_value_differences
from mlx_dualnorm.commands.parity.matrix import (
    FAMILY_NAMES, DualNormInputs, ParityCase, case_key,
)
from mlx_dualnorm.commands.shared.paths import REFERENCE_PATH, describe_paths

# ---- What a run records ------------------------------------------------------------


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
    actual: tuple[mx.array, mx.array], expected: tuple[mx.array, mx.array], *,
    bitwise: bool = False,
) -> tuple[OutputDifference, ...]:
    """The contract, output by output: same shape, same dtype, equal values
    with NaN matching NaN (and with ``bitwise``, the same bits). Empty when
    the path agrees."""
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

    case: "ParityCase | RopeParityCase"
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

    @property
    def mismatched_families(self) -> set[str]:
        return {family for family, count in self.mismatched_cases_per_family.items() if count}

    def record(self, family: str, mismatch: Optional[ParityMismatch], seconds: float) -> None:
        """One case ran (``mismatch`` None when the path agreed), taking
        ``seconds`` in the path."""
        self.cases_run += 1
        self.cases_per_family[family] += 1
        self.elapsed_seconds += seconds
        if mismatch is not None:
            self.mismatches.append(mismatch)
            self.mismatched_cases_per_family[family] += 1


Outputs = tuple[mx.array, mx.array]
Case = TypeVar("Case", ParityCase, "RopeParityCase")


def run_cases(
    reports: dict[str, ParityReport],
    cases: Sequence[Case],
    prepare: Callable[[Case], tuple[Outputs, Callable[[str], Callable[[], Outputs]]]],
    bitwise: bool,
    case_done: Optional[Callable[[Case], None]] = None,
) -> dict[str, ParityReport]:
    """Each case against its reference, for each path of ``reports``:
    ``prepare(case)`` gives the reference's outputs and a path's call on the
    case's inputs, by name. A raising call is a broken contract, recorded,
    not a harness crash; ``case_done`` is called after each case."""
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
            report.record(case.family, mismatch, time.perf_counter() - started)
        if case_done is not None:
            case_done(case)
    return reports


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
    for family in families + sorted(set(report.cases_per_family) - set(FAMILY_NAMES)):
        lines.append(f"  {family:<20} {report.cases_per_family[family]:>6} "
                     f"{report.mismatched_cases_per_family[family]:>11}")
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
    """The one line a parity run ends with: every path identical, or which
    paths mismatched."""
    contract = "bit-identical" if all(report.bitwise for report in reports) else "value-identical"
    failed = [report.path_name for report in reports if not report.passed]
    if not failed:
        return f"parity: all {len(reports)} path{'s' if len(reports) != 1 else ''} {contract}"
    return (f"parity: MISMATCH in {', '.join(failed)} "
            f"({len(reports) - len(failed)} of {len(reports)} paths {contract})")


# ---- The norm + RoPE ----------------------------------------------------------------

ROPE_FAMILY = "norm_rope"
ROPE_ONLY_FAMILY = "rope_only"  # the cases without norms
ROPE_REFERENCE_DESCRIPTION = (
    "composed_dual_head_norm_rope (rms_norm, transpose, rope per side; no rms_norm for rope_only)"
)
ROPE_PATH_PREFIX = "rope_"
ROPE_PATH_DESCRIPTIONS = {
    "rope_compiled": "mlx_dualnorm.CompiledDualHeadNormRope(mode='compiled'): "
    "one compiled graph for the norms, transposes and RoPE",
    "rope_fused": "mlx_dualnorm.CompiledDualHeadNormRope(mode='fused'): one kernel (CUDA)",
}
RMS_NORM_EPSILON = 1e-6
ROPE_BASE = 10000.0

OffsetSpec = Union[int, tuple[int, ...]]
"""An int offset, or one offset per batch entry (passed as an int32 array)."""


@dataclass(frozen=True)
class RopeParityCase:
    batch_size: int
    sequence_length: int
    query_heads: int
    key_heads: int
    width: int
    dims: int
    dtype_name: str
    offset: OffsetSpec
    weighted: bool = True
    traditional: bool = False
    scale: float = 1.0
    norms: bool = True  # False: the object made without norms (eps=None)
    family: str = ROPE_FAMILY

    @property
    def query_shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, self.sequence_length, self.query_heads, self.width)

    @property
    def key_shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, self.sequence_length, self.key_heads, self.width)

    def describe(self) -> str:
        norms = ("weighted" if self.weighted else "weightless") if self.norms else "without norms"
        return (f"q={self.query_shape} k={self.key_shape} dims={self.dims} "
                f"dtype={self.dtype_name} offset={self.offset} {norms} "
                f"traditional={self.traditional} scale={self.scale}")


def build_rope_parity_matrix(quick: bool = False) -> list[RopeParityCase]:
    """Every shape (of the models that call it) with every dtype, the offset,
    weighting and RoPE variant rotating across them, then the shape without
    norms (``rope_only``); ``quick`` keeps one dtype per shape."""
    shapes = (
        # (batch, sequence, query heads, key heads, width, dims)
        (1, 1, 16, 2, 256, 64),  # Qwen3-Next full-attention decode, partial rotary
        (1, 1, 16, 8, 128, 128),  # Qwen3 decode
        (2, 1, 8, 2, 128, 128),  # a batch of two decodes
        (1, 6, 4, 1, 256, 64),  # a short prefill
        (2, 3, 4, 4, 128, 32),  # batched prefill, few rotated features
    )
    offsets: tuple[OffsetSpec, ...] = (0, 7, 4095)
    dtype_names = ("bfloat16",) if quick else ("bfloat16", "float16", "float32")
    cases = []
    position = 0
    for shape in shapes:
        for dtype_name in dtype_names:
            offset: OffsetSpec = offsets[position % len(offsets)]
            if shape[0] > 1 and position % 2:  # one offset per batch entry
                offset = tuple(3 + 97 * entry for entry in range(shape[0]))
            cases.append(RopeParityCase(
                *shape, dtype_name=dtype_name, offset=offset, weighted=position % 3 != 2,
                traditional=position % 4 == 3, scale=0.5 if position % 5 == 4 else 1.0,
            ))
            position += 1
        cases.append(RopeParityCase(*shape, dtype_name="bfloat16", offset=offsets[1],
                                    weighted=False, norms=False, family=ROPE_ONLY_FAMILY))
    return cases


@dataclass(frozen=True)
class RopeInputs(DualNormInputs):
    """A dual norm's inputs and the RoPE's position offset."""

    offset: Union[int, mx.array]


def rope_case_inputs(case: RopeParityCase, seed: int) -> RopeInputs:
    """Evaluated inputs of one case, from the seed and its description."""
    query_key, key_key, query_weight_key, key_weight_key = mx.random.split(
        case_key(case.describe(), seed), 4
    )
    dtype = getattr(mx, case.dtype_name)
    queries = (4.0 * mx.random.normal(case.query_shape, key=query_key)).astype(dtype)
    keys = (4.0 * mx.random.normal(case.key_shape, key=key_key)).astype(dtype)
    query_weight, key_weight = [
        mx.random.uniform(-2.0, 2.0, (case.width,), key=key).astype(dtype)
        if case.weighted else None
        for key in (query_weight_key, key_weight_key)
    ]
    mx.eval([array for array in (queries, keys, query_weight, key_weight) if array is not None])
    offset = case.offset if isinstance(case.offset, int) else mx.array(case.offset, dtype=mx.int32)
    return RopeInputs(queries, keys, query_weight, key_weight, offset)


def available_rope_paths() -> list[str]:
    """``rope_MODE`` for every mode but the reference that runs here."""
    return [ROPE_PATH_PREFIX + mode for mode in available_modes()
            if mode != "composed" and ROPE_PATH_PREFIX + mode in ROPE_PATH_DESCRIPTIONS]


def unavailable_rope_paths(path_names: Sequence[str]) -> dict[str, str]:
    """Of the rope paths named, those this build or device cannot run, each
    with the reason."""
    available = available_rope_paths()
    return {name: f"mode {name.removeprefix(ROPE_PATH_PREFIX)!r} is not available here"
            for name in path_names if name not in available}


def run_rope_parity_matrix(
    path_names: Sequence[str], cases: Sequence[RopeParityCase], *, seed: int, matrix_name: str,
    bitwise: bool = True,
) -> dict[str, ParityReport]:
    """Every rope path over every case, against the composed norm + RoPE,
    reported as the dual norm's parity is. Each call builds its object, as a
    model builds one per attention layer."""
    reports = {
        name: ParityReport(
            name, matrix_name, seed, bitwise, reference_description=ROPE_REFERENCE_DESCRIPTION,
            path_description=f"{name}: {ROPE_PATH_DESCRIPTIONS[name]}"
            if name in ROPE_PATH_DESCRIPTIONS else "",
        )
        for name in path_names
    }

    def prepare(case: RopeParityCase) -> tuple[Outputs, Callable[[str], Callable[[], Outputs]]]:
        inputs = rope_case_inputs(case, seed)
        eps = RMS_NORM_EPSILON if case.norms else None
        arrays = (inputs.queries, inputs.keys, inputs.query_weight, inputs.key_weight)
        expected = composed_dual_head_norm_rope(
            *arrays, eps=eps, dims=case.dims, base=ROPE_BASE, traditional=case.traditional,
            scale=case.scale, offset=inputs.offset, norms=case.norms,
        )
        return expected, lambda name: lambda: CompiledDualHeadNormRope(
            eps, case.dims, base=ROPE_BASE, traditional=case.traditional, scale=case.scale,
            mode=cast(Mode, name.removeprefix(ROPE_PATH_PREFIX)),
        )(*arrays, offset=inputs.offset)

    return run_cases(reports, cases, prepare, bitwise)
