"""``python -m mlx_dualnorm parity``: any dual head norm path (a factory
``make_path(eps)`` of ``path(queries, keys, query_weight, key_weight) ->
(normalized_queries, normalized_keys)``) against two ``mx.fast.rms_norm``
calls over the matrix of :mod:`.matrix`, and the norm + RoPE of :mod:`.rope`:
the same shape, dtype and bits (``--values``: values), then a verdict."""

from __future__ import annotations

import argparse
import enum
import math
from typing import Callable, Mapping, Optional, Sequence

import mlx.core as mx

from mlx_dualnorm import composed_dual_head_norm
from mlx_dualnorm.commands.shared import command, paths as compared_paths
from mlx_dualnorm.commands.parity import rope as rope_parity
from mlx_dualnorm.commands.parity.matrix import (
    DEFAULT_PARITY_SEED, FAMILY_NAMES, DualNormInputs, InputLayout, ParityCase, ValueProfile,
    WeightLayout, Weighting, build_full_parity_matrix, build_quick_parity_matrix, case_key,
)
from mlx_dualnorm.commands.parity.rope import (
    Outputs, ParityReport, format_parity_report, parity_verdict, run_cases,
)
from mlx_dualnorm.commands.shared.paths import (
    PATH_REGISTRY, DualNormPath, DualNormPathFactory, PathSelection, build_path,
    refuse_unavailable, routinely_checked_paths, unavailable_paths,
)

PATH_FACTORIES: dict[str, DualNormPathFactory] = routinely_checked_paths()
"""The paths checked when none is named: every mode this build and device
can run, and Python's mx.compile for comparison."""
PROGRESS_INTERVAL_SECONDS = 5.0

# ---- A case's inputs ------------------------------------------------------------------


class _RowKind(enum.Enum):
    VARIED = "varied"  # magnitudes 2^-3 .. 2^3 per row
    SIGNED_ZERO = "signed-zero"  # +0 and -0
    NEAR_EPSILON = "near-epsilon"  # mean square from ~1e-4 eps to ~30 eps
    OVERFLOWING = "overflowing"  # squares overflow the input dtype
    SUBNORMAL = "subnormal"  # below the input dtype's smallest normal
    NAN_INF_SPRINKLED = "nan-inf-sprinkled"  # ~3/32 of entries NaN/+inf/-inf
    INFINITE = "infinite"  # every entry +inf or -inf


_ROW_KINDS_BY_PROFILE: dict[ValueProfile, tuple[_RowKind, ...]] = {
    ValueProfile.VARIED_ROWS: (_RowKind.VARIED,),
    ValueProfile.NEAR_EPSILON: (_RowKind.SIGNED_ZERO, _RowKind.NEAR_EPSILON, _RowKind.NEAR_EPSILON,
                                _RowKind.SUBNORMAL, _RowKind.NEAR_EPSILON),
    ValueProfile.ZERO_ROWS: (_RowKind.SIGNED_ZERO, _RowKind.VARIED, _RowKind.VARIED),
    ValueProfile.OVERFLOWING_SQUARES: (_RowKind.OVERFLOWING, _RowKind.VARIED),
    ValueProfile.SUBNORMAL_ROWS: (_RowKind.SUBNORMAL, _RowKind.VARIED),
    ValueProfile.NAN_AND_INF: (_RowKind.VARIED, _RowKind.NAN_INF_SPRINKLED, _RowKind.VARIED,
                               _RowKind.INFINITE),
    ValueProfile.ALL_SPECIAL_ROWS: tuple(_RowKind),
}


def _row_kind_values(
    row_kind: _RowKind, unit_values: mx.array, row_fractions: mx.array,
    special_fractions: mx.array, dtype: mx.Dtype, eps: float,
) -> mx.array:
    """float32 values of one row kind, from uniform values in (-1, 1) per
    element (``unit_values``, ``special_fractions`` in [0, 1)) and per row."""
    varied = unit_values * mx.power(2.0, row_fractions * 6.0 - 3.0)  # lazy: costs only if used
    if row_kind is _RowKind.VARIED:
        return varied
    if row_kind is _RowKind.SIGNED_ZERO:
        return unit_values * 0.0
    if row_kind is _RowKind.NEAR_EPSILON:
        # Where eps decides the rounding; a zero eps is stood in for by 1e-12.
        root_eps = math.sqrt(max(eps, 1e-12))
        return unit_values * (root_eps * mx.power(10.0, row_fractions * 3.0 - 2.0))
    if row_kind is _RowKind.OVERFLOWING:
        # |x| from sqrt(max) up to the largest power of two below max: finite values.
        largest = math.floor(math.log2(mx.finfo(dtype).max))
        exponents = largest / 2.0 + row_fractions * (largest - largest / 2.0)
        return unit_values * mx.power(2.0, exponents)
    if row_kind is _RowKind.SUBNORMAL:
        return unit_values * mx.finfo(dtype).smallest_normal
    if row_kind is _RowKind.NAN_INF_SPRINKLED:
        special = mx.where(special_fractions < 1 / 32, mx.nan,
                           mx.where(special_fractions < 2 / 32, mx.inf, -mx.inf))
        return mx.where(special_fractions < 3 / 32, special, varied)
    if row_kind is _RowKind.INFINITE:
        return mx.where(unit_values < 0, -mx.inf, mx.inf)
    raise AssertionError(f"unhandled row kind {row_kind}")


def generate_head_values(
    shape: Sequence[int], dtype: mx.Dtype, value_profile: ValueProfile, eps: float,
    key: mx.array,
) -> mx.array:
    """Inputs of ``shape`` whose rows (all axes but the last) cycle through
    the profile's row kinds. Deterministic from ``key``."""
    shape = tuple(shape)
    row_shape = shape[:-1] + (1,)
    unit_key, row_key, special_key = mx.random.split(key, 3)
    unit_values = mx.random.uniform(-1.0, 1.0, shape, key=unit_key)
    row_fractions = mx.random.uniform(0.0, 1.0, row_shape, key=row_key)
    row_kinds = _ROW_KINDS_BY_PROFILE[value_profile]
    special_fractions = (
        mx.random.uniform(0.0, 1.0, shape, key=special_key)
        if _RowKind.NAN_INF_SPRINKLED in row_kinds else unit_values
    )
    kind_values = [_row_kind_values(kind, unit_values, row_fractions, special_fractions, dtype, eps)
                   for kind in row_kinds]
    row_kind_index = (mx.arange(math.prod(shape[:-1])) % len(row_kinds)).reshape(row_shape)
    values = kind_values[0]
    for kind_index in range(1, len(row_kinds)):
        values = mx.where(row_kind_index == kind_index, kind_values[kind_index], values)
    return values.astype(dtype)


def _nans(values: mx.array, width: Optional[int] = None) -> mx.array:
    """NaN filler: of ``values``' shape, or ``width`` wide."""
    shape = values.shape if width is None else values.shape[:-1] + (width,)
    return mx.full(shape, mx.nan, dtype=values.dtype)


def _evaluated(buffer: mx.array) -> mx.array:
    """``buffer``, contiguous and evaluated: a view of it is a real strided view."""
    buffer = mx.contiguous(buffer)
    mx.eval(buffer)
    return buffer


_INPUT_VIEWS: dict[InputLayout, Callable[[mx.array], mx.array]] = {
    InputLayout.CONTIGUOUS: lambda values: values,
    InputLayout.HEADS_SEQUENCE_TRANSPOSED: lambda values: _evaluated(
        values.swapaxes(1, 2)).swapaxes(1, 2),
    InputLayout.LAST_AXIS_STRIDED: lambda values: _evaluated(
        values.swapaxes(-1, -2)).swapaxes(-1, -2),
    InputLayout.ROW_SLICED: lambda values: _evaluated(  # each head after a NaN head
        mx.stack([_nans(values), values], axis=-2).reshape(*values.shape[:2], -1, values.shape[3])
    )[:, :, 1::2, :],
    InputLayout.WIDTH_SLICED: lambda values: _evaluated(  # two NaN columns before, one after
        mx.concatenate([_nans(values, 2), values, _nans(values, 1)], axis=-1))[..., 2:-1],
    InputLayout.STEPPED_LAST_AXIS: lambda values: _evaluated(  # a NaN after each element
        mx.stack([values, _nans(values)], axis=-1).reshape(*values.shape[:-1], -1))[..., ::2],
    InputLayout.BROADCAST_HEADS: lambda values: mx.broadcast_to(
        _evaluated(values[:, :, :1, :]), values.shape),
}
_WEIGHT_VIEWS: dict[WeightLayout, Callable[[mx.array], mx.array]] = {
    WeightLayout.CONTIGUOUS: lambda weight: weight,
    WeightLayout.STRIDED_COLUMN: lambda weight: _evaluated(
        mx.stack([_nans(weight), weight, _nans(weight)], axis=-1))[:, 1],
    WeightLayout.REVERSED: lambda weight: _evaluated(weight[::-1])[::-1],
    WeightLayout.STEPPED: lambda weight: _evaluated(
        mx.stack([weight, _nans(weight)], axis=-1).reshape(-1))[::2],
    WeightLayout.BROADCAST_SCALAR: lambda weight: mx.broadcast_to(
        _evaluated(weight[:1]), weight.shape),
}


def build_case_inputs(case: ParityCase, seed: int = DEFAULT_PARITY_SEED) -> DualNormInputs:
    """The evaluated inputs of one case, laid out as it says: what reproduces
    a reported mismatch. Weights are uniform in (-2, 2): signs, small and
    large scales."""
    query_key, key_key, query_weight_key, key_weight_key = mx.random.split(
        case_key(case.describe(), seed), 4
    )

    def heads(
        shape: tuple[int, ...], dtype: mx.Dtype, layout: InputLayout, key: mx.array
    ) -> mx.array:
        values = generate_head_values(shape, dtype, case.value_profile, case.eps, key)
        return _INPUT_VIEWS[layout](values)

    def weight(side_only: Weighting, key: mx.array) -> Optional[mx.array]:
        if case.weighting not in (Weighting.WEIGHTED, side_only):
            return None
        values = mx.random.uniform(-2.0, 2.0, (case.width,), key=key)
        return _WEIGHT_VIEWS[case.weight_layout](values.astype(case.dtypes.weight_dtype))

    inputs = DualNormInputs(
        heads(case.query_shape, case.dtypes.query_dtype, case.query_layout, query_key),
        heads(case.key_shape, case.dtypes.key_dtype, case.key_layout, key_key),
        weight(Weighting.QUERY_WEIGHT_ONLY, query_weight_key),
        weight(Weighting.KEY_WEIGHT_ONLY, key_weight_key),
    )
    mx.eval([array for array in vars(inputs).values() if array is not None])
    return inputs


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
    """Runs every path over every case; each factory is called once per
    epsilon, so compiled paths are reused across cases as in a model. A given
    (empty) ``reports`` fills as the cases run, so an interrupted caller still
    holds what ran. A factory's PathUnavailable propagates, naming the path."""
    reports = {} if reports is None else reports
    run_reports = {name: ParityReport(name, matrix_name, seed, bitwise) for name in path_factories}
    reports.update(run_reports)
    paths: dict[tuple[str, float], DualNormPath] = {}

    def prepare(case: ParityCase) -> tuple[Outputs, Callable[[str], Callable[[], Outputs]]]:
        inputs = build_case_inputs(case, seed)
        arrays = (inputs.queries, inputs.keys, inputs.query_weight, inputs.key_weight)

        def path_call(name: str) -> Callable[[], Outputs]:
            if (name, case.eps) not in paths:
                paths[name, case.eps] = build_path(name, path_factories[name], case.eps)
            path = paths[name, case.eps]
            return lambda: path(*arrays)

        return composed_dual_head_norm(*arrays, case.eps), path_call

    run_cases(run_reports, cases, prepare, bitwise, case_done)
    return reports


def _matrix(quick: bool, seed: int, families: Optional[Sequence[str]]) -> list[ParityCase]:
    cases = build_quick_parity_matrix(seed) if quick else build_full_parity_matrix(seed)
    return [case for case in cases if not families or case.family in families]


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
    unknown_families = set(families or ()) - set(FAMILY_NAMES)
    if unknown_families:
        raise ValueError(f"unknown parity families: {sorted(unknown_families)}")
    return run_parity_matrix(
        {path_name: path_factory}, _matrix(quick, seed, families), seed=seed,
        matrix_name="quick" if quick else "full", bitwise=bitwise,
    )[path_name]


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
    cases = _matrix(quick, seed, families)
    rope_cases = [case for case in rope_parity.build_rope_parity_matrix(quick=quick)
                  if not families or case.family in families]
    matrix_name = "quick" if quick else "full"
    progress = command.StepProgress(
        f"parity, {matrix_name} matrix, cases", len(cases) if path_factories else 0,
        min_interval_s=PROGRESS_INTERVAL_SECONDS,
    )
    reports: dict[str, ParityReport] = {}
    try:
        if path_factories and cases:
            run_parity_matrix(
                path_factories, cases, seed=seed, matrix_name=matrix_name, bitwise=bitwise,
                reports=reports, case_done=lambda case: progress.step(f"[{case.family}]"),
            )
        if rope_path_names and rope_cases:
            reports.update(rope_parity.run_rope_parity_matrix(
                rope_path_names, rope_cases, seed=seed, matrix_name=matrix_name, bitwise=bitwise,
            ))
    except KeyboardInterrupt:
        for report in reports.values():
            print(format_parity_report(report))
        print(f"parity: INTERRUPTED after {progress.done} of {len(cases)} cases; "
              "the reports above cover only the cases that ran", flush=True)
        raise
    for report in reports.values():
        print(format_parity_report(report))
    return list(reports.values())


# ---- The command line ---------------------------------------------------------------


def skipped_path_lines(skipped: Mapping[str, str]) -> list[str]:
    return compared_paths.skipped_path_lines("parity", dict(skipped))


def _path_selection(path_factories: Optional[Mapping[str, DualNormPathFactory]]) -> PathSelection:
    return PathSelection.of(
        path_factories, PATH_FACTORIES, extra_names=list(rope_parity.ROPE_PATH_DESCRIPTIONS),
        extra_default_names=rope_parity.available_rope_paths(),
    )


def _skipped_by_default(selection: PathSelection) -> dict[str, str]:
    """The paths a run without --path leaves out, and why."""
    skipped = unavailable_paths(list(selection.factories))
    for name in selection.factories:
        path = PATH_REGISTRY.get(name)
        if name not in skipped and path is not None and not path.routinely_checked:
            skipped[name] = f"not checked by default (it retraces per shape; --path {name})"
    skipped.update(rope_parity.unavailable_rope_paths(selection.extra_names))
    return skipped


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
    parser.add_argument("--seed", type=command.seed, default=DEFAULT_PARITY_SEED,
                        help="seed of the matrix and its values")
    parser.add_argument(
        "--family", dest="families", action="append",
        choices=[*FAMILY_NAMES, rope_parity.ROPE_FAMILY, rope_parity.ROPE_ONLY_FAMILY],
        help="only this family of cases (repeatable; default: all)",
    )
    parser.add_argument(
        "--values", dest="bitwise", action="store_false",
        help="compare values (NaN equal to NaN, -0 equal to +0) instead of bits",
    )
    # Bits are the default; --bitwise stays accepted for command lines that say so.
    parser.add_argument("--bitwise", action="store_true", help=argparse.SUPPRESS)
    command.add_device_argument(parser)
    return parser


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
            selection.factories_named(named), rope_names, quick=arguments.quick,
            seed=arguments.seed, families=arguments.families, bitwise=arguments.bitwise,
        )
        if not arguments.path_names:
            for line in skipped_path_lines(_skipped_by_default(selection)):
                print(line)
        print(parity_verdict(reports))
        passed = all(report.passed for report in reports)
        return command.EXIT_OK if passed else command.EXIT_MISMATCH

    return command.run_tool(_parity_parser(selection), run, argv)
