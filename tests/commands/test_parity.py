"""The parity harness: the real paths pass it, and deliberately broken
paths fail it where they should, so a pass means something."""

from __future__ import annotations

import subprocess
import sys
from typing import Optional

import mlx.core as mx
import numpy as np
import pytest

from helpers.bit_parity import assert_bit_identical
from mlx_dualnorm import CompiledDualHeadNorm, available_modes, composed_dual_head_norm
from mlx_dualnorm.commands import parity
from mlx_dualnorm.commands.parity import check_path_parity, run_parity_matrix
from mlx_dualnorm.commands.parity.cases import (
    BATCH_SIZES,
    DTYPE_CONFIGURATIONS,
    HEAD_COUNTS,
    NON_CONTIGUOUS_INPUT_LAYOUTS,
    NON_CONTIGUOUS_WEIGHT_LAYOUTS,
    SPECIAL_VALUE_PROFILES,
    WIDTHS,
    ParityCase,
    Weighting,
    build_case_inputs,
)
from mlx_dualnorm.commands.parity.matrices import (
    FAMILY_NAMES,
    FULL_MATRIX_ELEMENT_BUDGET,
    build_full_parity_matrix,
    build_quick_parity_matrix,
)
from mlx_dualnorm.commands.shared.paths import (
    DualNormPath,
    make_compiled_path,
    make_composed_path,
    make_mx_compile_path,
)

# The fused path joins every registered-path check where this MLX has CUDA.
FUSED_WHERE_AVAILABLE = ("fused",) if "fused" in available_modes() else ()

# ---- Deliberately broken paths ------------------------------------------------


def make_path_with_epsilon_one_ulp_high(eps: float) -> DualNormPath:
    """The composed path with eps one float32 ulp too large: what a
    double-to-float rounding slip in a kernel's epsilon would look like."""
    one_ulp_higher = float(np.nextafter(np.float32(eps), np.float32(np.inf)))
    return make_composed_path(one_ulp_higher)


def make_path_with_outputs_swapped(eps: float) -> DualNormPath:
    """Returns (normalized keys, normalized queries): an output-order slip."""
    composed_path = make_composed_path(eps)

    def swapped(queries, keys, query_weight, key_weight):
        normalized_queries, normalized_keys = composed_path(queries, keys, query_weight, key_weight)
        return normalized_keys, normalized_queries

    return swapped


def _rms_norm_with_weight_before_rounding(
    inputs: mx.array, weight: Optional[mx.array], eps: float
) -> mx.array:
    """Scales in float32 and rounds once at the end. MLX rounds x * rsqrt(...)
    to the input dtype BEFORE multiplying by the weight (in the weight's
    promoted dtype), so half-precision weighted rows differ."""
    if weight is None:
        return mx.fast.rms_norm(inputs, None, eps)
    output_dtype = mx.result_type(inputs, weight)
    return mx.fast.rms_norm(
        inputs.astype(mx.float32), weight.astype(mx.float32), eps
    ).astype(output_dtype)


def make_path_with_weight_before_rounding(eps: float) -> DualNormPath:
    def weight_before_rounding(queries, keys, query_weight, key_weight):
        return (
            _rms_norm_with_weight_before_rounding(queries, query_weight, eps),
            _rms_norm_with_weight_before_rounding(keys, key_weight, eps),
        )

    return weight_before_rounding


def make_path_sanitizing_nan_and_inf(eps: float) -> DualNormPath:
    """Right on finite rows, but NaN -> 0 and inf -> the dtype's max: what a
    kernel that clamps or guards its reduction would produce."""
    composed_path = make_composed_path(eps)

    def sanitizing(queries, keys, query_weight, key_weight):
        normalized_queries, normalized_keys = composed_path(queries, keys, query_weight, key_weight)
        return mx.nan_to_num(normalized_queries), mx.nan_to_num(normalized_keys)

    return sanitizing


def make_path_returning_float32(eps: float) -> DualNormPath:
    """Right values, wrong dtype for half-precision inputs."""
    composed_path = make_composed_path(eps)

    def upcasting(queries, keys, query_weight, key_weight):
        normalized_queries, normalized_keys = composed_path(queries, keys, query_weight, key_weight)
        return normalized_queries.astype(mx.float32), normalized_keys.astype(mx.float32)

    return upcasting


def make_path_rejecting_broadcast_weights(eps: float) -> DualNormPath:
    """Raises on one input kind, as a kernel with a stride assumption might."""
    composed_path = make_composed_path(eps)

    def rejecting(queries, keys, query_weight, key_weight):
        for weight in (query_weight, key_weight):
            if weight is not None and mx.all(weight == weight[0]).item():
                raise ValueError("[fused dual head norm] stride-0 weights are not supported")
        return composed_path(queries, keys, query_weight, key_weight)

    return rejecting


# ---- The real paths pass --------------------------------------------------------


def test_compiled_path_matches_composed_bit_patterns_over_full_matrix() -> None:
    report = check_path_parity(make_compiled_path, path_name="compiled", bitwise=True)

    assert report.cases_run == len(build_full_parity_matrix())
    assert report.mismatches == [], parity.format_parity_report(report)
    assert report.passed


def test_mx_compile_path_matches_composed_over_full_matrix() -> None:
    report = check_path_parity(make_mx_compile_path, path_name="mx_compile")

    assert report.mismatches == [], parity.format_parity_report(report)
    assert set(report.cases_per_family) == set(FAMILY_NAMES)


def test_quick_matrix_passes_for_every_registered_path() -> None:
    reports = run_parity_matrix(
        parity.PATH_FACTORIES, build_quick_parity_matrix(), matrix_name="quick"
    )

    assert set(reports) == {"compiled", "mx_compile", *FUSED_WHERE_AVAILABLE}
    for report in reports.values():
        assert report.passed, parity.format_parity_report(report)


def test_harness_inputs_reproduce_a_case_exactly() -> None:
    """A reported case description is enough to rebuild its inputs."""
    case = next(case for case in build_full_parity_matrix() if case.family == "non_contiguous")
    first_inputs = build_case_inputs(case)
    second_inputs = build_case_inputs(case)

    assert_bit_identical(first_inputs.queries, second_inputs.queries)
    assert_bit_identical(first_inputs.keys, second_inputs.keys)
    normalized = CompiledDualHeadNorm(case.eps)(
        first_inputs.queries, first_inputs.keys, first_inputs.query_weight, first_inputs.key_weight
    )
    expected = composed_dual_head_norm(
        first_inputs.queries,
        first_inputs.keys,
        first_inputs.query_weight,
        first_inputs.key_weight,
        case.eps,
    )
    for actual_output, expected_output in zip(normalized, expected):
        assert_bit_identical(actual_output, expected_output)


# ---- Broken paths fail, in the families that should catch them --------------


def test_epsilon_one_ulp_high_is_caught_by_the_epsilon_family() -> None:
    report = check_path_parity(
        make_path_with_epsilon_one_ulp_high, families=["epsilon"], path_name="eps+1ulp"
    )

    assert not report.passed
    # Every epsilon is caught somewhere (0 -> the smallest subnormal turns
    # 0 * inf = NaN rows into zeros; the others shift near-epsilon rows).
    caught_epsilons = {mismatch.case.eps for mismatch in report.mismatches}
    assert caught_epsilons == {1e-6, 1e-5, 1e-12, 0.0}
    assert all(
        difference.reason == "values"
        for mismatch in report.mismatches
        for difference in mismatch.differences
    )


def test_an_empty_family_list_selects_no_case() -> None:
    """None means every family; an empty list means none: a caller that
    filtered its families down to nothing runs nothing, and its report
    does not pass (no case ran)."""
    report = check_path_parity(make_compiled_path, quick=True, families=[])

    assert report.cases_run == 0
    assert not report.passed
    assert check_path_parity(make_compiled_path, quick=True, families=["epsilon"]).cases_run > 0


def test_epsilon_one_ulp_high_is_caught_by_the_quick_matrix() -> None:
    report = check_path_parity(make_path_with_epsilon_one_ulp_high, quick=True)

    assert "epsilon" in report.mismatched_families


def test_swapped_outputs_are_caught_in_every_family() -> None:
    report = check_path_parity(make_path_with_outputs_swapped, quick=True)

    assert report.mismatched_families == set(FAMILY_NAMES)
    reasons = {
        difference.reason for mismatch in report.mismatches for difference in mismatch.differences
    }
    # 24/4 and 32/2 head counts differ in shape; 16/16 only in values.
    assert {"shape", "values"} <= reasons


def test_weight_applied_before_rounding_is_caught_only_where_it_differs() -> None:
    report = check_path_parity(make_path_with_weight_before_rounding, path_name="weight-first")

    assert not report.passed
    for mismatch in report.mismatches:
        assert mismatch.case.weighting is not Weighting.WEIGHTLESS
        assert mismatch.differing_elements > 0
    mismatched_dtype_names = {mismatch.case.dtypes.name for mismatch in report.mismatches}
    assert {"float16", "bfloat16"} <= mismatched_dtype_names
    # float32 rounds nothing extra; nor does a float32 weight: on CPU MLX
    # then normalizes half-precision rows wholly in float32 (no rounding to
    # the input dtype before the weight), as this path does.
    assert not mismatched_dtype_names & {
        "float32",
        "float16+float32-weight",
        "bfloat16+float32-weight",
    }


def test_weight_applied_before_rounding_is_caught_by_the_quick_matrix() -> None:
    assert not check_path_parity(make_path_with_weight_before_rounding, quick=True).passed


def test_nan_and_inf_sanitizing_is_caught_by_special_values() -> None:
    report = check_path_parity(make_path_sanitizing_nan_and_inf, quick=True)

    assert "special_values" in report.mismatched_families
    # Families without NaN or inf inputs or outputs cannot see it.
    assert "width_by_dtype" not in report.mismatched_families


def test_wrong_output_dtype_is_reported_as_dtype_mismatch() -> None:
    report = check_path_parity(make_path_returning_float32, quick=True)

    reasons = {
        difference.reason for mismatch in report.mismatches for difference in mismatch.differences
    }
    assert reasons == {"dtype"}
    assert all(mismatch.case.dtypes.name != "float32" for mismatch in report.mismatches)


def test_a_raising_path_is_a_mismatch_not_a_harness_crash() -> None:
    report = check_path_parity(
        make_path_rejecting_broadcast_weights, families=["non_contiguous"], path_name="rejecting"
    )

    assert not report.passed
    assert all(mismatch.error is not None for mismatch in report.mismatches)
    assert "stride-0 weights" in report.mismatches[0].describe()


def test_mismatch_report_counts_differing_elements() -> None:
    case = ParityCase(
        family="by hand",
        width=64,
        dtypes=DTYPE_CONFIGURATIONS[0],
        heads=HEAD_COUNTS[0],
        batch_size=1,
        sequence_length=1,
    )
    report = run_parity_matrix({"swapped": make_path_with_outputs_swapped}, [case])["swapped"]

    (mismatch,) = report.mismatches
    query_difference, key_difference = mismatch.differences
    assert query_difference.reason == key_difference.reason == "values"
    assert query_difference.element_count == 16 * 64
    assert 0 < query_difference.differing_elements <= 16 * 64
    assert report.mismatched_cases_per_family == {"by hand": 1}


# ---- The matrix covers what the contract names ---------------------------------


@pytest.mark.parametrize("seed", [parity.DEFAULT_PARITY_SEED, 0, 12345])
def test_full_matrix_covers_every_required_axis(seed: int) -> None:
    cases = build_full_parity_matrix(seed)
    by_family = {
        family: [case for case in cases if case.family == family] for family in FAMILY_NAMES
    }

    assert {(case.width, case.dtypes) for case in by_family["width_by_dtype"]} == {
        (width, dtypes) for width in WIDTHS for dtypes in DTYPE_CONFIGURATIONS
    }
    assert {(case.heads, case.sequence_length) for case in by_family["head_counts"]} == {
        (heads, sequence_length) for heads in HEAD_COUNTS for sequence_length in (1, 512)
    }
    assert {
        (case.batch_size, case.sequence_length) for case in by_family["batch_and_sequence"]
    } == {(batch, sequence_length) for batch in BATCH_SIZES for sequence_length in (1, 512)}
    assert {1e-6, 1e-5, 1e-12} <= {case.eps for case in by_family["epsilon"]}
    assert {case.weighting for case in cases} == set(Weighting)
    assert {case.query_layout for case in by_family["non_contiguous"]} == set(
        NON_CONTIGUOUS_INPUT_LAYOUTS
    )
    assert {case.key_layout for case in by_family["non_contiguous"]} == set(
        NON_CONTIGUOUS_INPUT_LAYOUTS
    )
    assert {
        case.weight_layout
        for case in by_family["non_contiguous"]
        if case.weighting is not Weighting.WEIGHTLESS
    } == set(NON_CONTIGUOUS_WEIGHT_LAYOUTS)
    assert {(case.value_profile, case.dtypes) for case in by_family["special_values"]} == {
        (profile, dtypes) for profile in SPECIAL_VALUE_PROFILES for dtypes in DTYPE_CONFIGURATIONS
    }
    # Wide rows are also seen with many rows at once (a shortened prefill).
    assert {case.width for case in cases if case.sequence_length >= 16} >= set(WIDTHS)
    assert max(case.query_element_count for case in cases) <= FULL_MATRIX_ELEMENT_BUDGET


def test_matrices_are_deterministic_from_the_seed() -> None:
    assert build_full_parity_matrix(7) == build_full_parity_matrix(7)
    assert build_quick_parity_matrix(7) == build_quick_parity_matrix(7)
    assert build_full_parity_matrix(7) != build_full_parity_matrix(8)


def test_quick_matrix_is_small_and_touches_every_family_and_dtype() -> None:
    cases = build_quick_parity_matrix()

    assert len(cases) <= 60
    assert {case.family for case in cases} == set(FAMILY_NAMES)
    assert set(DTYPE_CONFIGURATIONS) <= {case.dtypes for case in cases}
    assert sum(case.query_element_count for case in cases) <= 2_000_000


# ---- The command line ---------------------------------------------------------------


def test_main_prints_a_table_and_returns_zero_for_the_compiled_path(capsys) -> None:
    exit_status = parity.main(["--quick", "--path", "compiled"])

    printed = capsys.readouterr().out
    assert exit_status == 0
    assert "'compiled'" in printed and "PASS" in printed
    assert "'mx_compile'" not in printed
    for family in FAMILY_NAMES:
        assert family in printed


def test_main_returns_nonzero_and_lists_mismatches_for_a_broken_path(capsys) -> None:
    exit_status = parity.main(
        ["--quick", "--family", "epsilon"],
        path_factories={"eps+1ulp": make_path_with_epsilon_one_ulp_high},
    )

    printed = capsys.readouterr().out
    assert exit_status == 1
    assert "MISMATCH [epsilon]" in printed and "FAIL" in printed


def test_main_runs_as_a_command() -> None:
    completed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from mlx_dualnorm.commands.parity import main; sys.exit(main(sys.argv[1:]))",
            "--quick",
            "--family",
            "mixed_dtypes",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert completed.stdout.count("PASS") == 2 + len(FUSED_WHERE_AVAILABLE)
