"""The parity matrix: the cases every dual head norm path is checked on
(the families, as docs/parity.md lists them: ``FAMILY_NAMES``).

A designed matrix, not the Cartesian product: the axes below (widths,
dtype configurations, head counts, batch sizes, sequence lengths,
epsilons, weightings, memory layouts, value profiles) multiply to millions
of cases, each costing input generation and two evaluations on a CPU.
Instead each family fixes the axes it is about and rotates the rest, drawn
from ``random.Random(seed)``; input values come from an MLX key derived
from the seed and the case's description, so a case reproduces from its
description alone (:mod:`mlx_dualnorm.commands.parity.inputs` builds
them). The quick matrix picks a few cases per family and shrinks them.

Epsilons other than the production 1e-6 appear only in the ``epsilon``
family: on a CPU every epsilon, dtype and weighting compiles its own fused
kernel (g++, about half a second each on a cold kernel cache).
"""

from __future__ import annotations

import functools
import itertools
import random
from dataclasses import replace
from typing import Callable, Sequence

import mlx.core as mx

from mlx_dualnorm.commands.parity.inputs import (
    DEFAULT_PARITY_SEED, DtypeConfiguration, HeadCounts, InputLayout, ParityCase,
    ValueProfile, WeightLayout, Weighting,
)

__all__ = [
    "BATCH_SIZES", "DTYPE_CONFIGURATIONS", "FAMILY_NAMES", "FULL_MATRIX_ELEMENT_BUDGET",
    "HEAD_COUNTS", "NON_CONTIGUOUS_INPUT_LAYOUTS", "NON_CONTIGUOUS_WEIGHT_LAYOUTS",
    "SPECIAL_VALUE_PROFILES", "WIDTHS", "build_full_parity_matrix", "build_quick_parity_matrix",
]

# ---- The axes' values -----------------------------------------------------------


WIDTHS: tuple[int, ...] = (64, 80, 96, 128, 200, 256, 512, 1024, 2048, 4096, 8192)
BASE_DTYPE_CONFIGURATIONS: tuple[DtypeConfiguration, ...] = (
    DtypeConfiguration("float32", mx.float32, mx.float32, mx.float32),
    DtypeConfiguration("float16", mx.float16, mx.float16, mx.float16),
    DtypeConfiguration("bfloat16", mx.bfloat16, mx.bfloat16, mx.bfloat16),
)
PROMOTING_DTYPE_CONFIGURATIONS: tuple[DtypeConfiguration, ...] = (
    DtypeConfiguration("float16+float32-weight", mx.float16, mx.float16, mx.float32),
    DtypeConfiguration("bfloat16+float32-weight", mx.bfloat16, mx.bfloat16, mx.float32),
)
DTYPE_CONFIGURATIONS = BASE_DTYPE_CONFIGURATIONS + PROMOTING_DTYPE_CONFIGURATIONS
BFLOAT16_DTYPES = BASE_DTYPE_CONFIGURATIONS[2]
MIXED_DTYPE_CONFIGURATIONS: tuple[DtypeConfiguration, ...] = (
    DtypeConfiguration("q-bfloat16/k-float32", mx.bfloat16, mx.float32, mx.bfloat16),
    DtypeConfiguration("q-float16/k-bfloat16", mx.float16, mx.bfloat16, mx.bfloat16),
    DtypeConfiguration("float16+bfloat16-weight", mx.float16, mx.float16, mx.bfloat16),
    DtypeConfiguration("float32+bfloat16-weight", mx.float32, mx.float32, mx.bfloat16),
)
HEAD_COUNTS: tuple[HeadCounts, ...] = (HeadCounts(16, 16), HeadCounts(24, 4), HeadCounts(32, 2))
BATCH_SIZES: tuple[int, ...] = tuple(range(1, 9))
DECODE_SEQUENCE_LENGTH = 1
PREFILL_SEQUENCE_LENGTH = 512
SEQUENCE_LENGTHS: tuple[int, ...] = (DECODE_SEQUENCE_LENGTH, PREFILL_SEQUENCE_LENGTH)
EPSILONS: tuple[float, ...] = (1e-6, 1e-5, 1e-12, 0.0)
"""1e-6 and 1e-5 are what models use, 1e-12 sits far below any float32
mean square of O(1) rows, and 0 turns zero rows into 0 * inf = NaN."""
WEIGHTED_WEIGHTINGS: tuple[Weighting, ...] = (
    Weighting.WEIGHTED, Weighting.QUERY_WEIGHT_ONLY, Weighting.KEY_WEIGHT_ONLY,
)
NON_CONTIGUOUS_INPUT_LAYOUTS: tuple[InputLayout, ...] = tuple(
    layout for layout in InputLayout if layout is not InputLayout.CONTIGUOUS
)
NON_CONTIGUOUS_WEIGHT_LAYOUTS: tuple[WeightLayout, ...] = tuple(
    layout for layout in WeightLayout if layout is not WeightLayout.CONTIGUOUS
)
SPECIAL_VALUE_PROFILES: tuple[ValueProfile, ...] = (
    ValueProfile.ZERO_ROWS, ValueProfile.OVERFLOWING_SQUARES, ValueProfile.SUBNORMAL_ROWS,
    ValueProfile.NAN_AND_INF, ValueProfile.ALL_SPECIAL_ROWS,
)

FULL_MATRIX_ELEMENT_BUDGET = 1 << 22
"""Most elements one query input may hold (4 Mi): a prefill of 8 x 512 x 32
heads x 8192 would take seconds per case on CPU to generate and normalize."""
QUICK_MATRIX_ELEMENT_BUDGET = 1 << 17


# ---- Building the matrix ------------------------------------------------------


class _SeededRotation:
    """Cycles through each axis in a seed-shuffled order, so every value of
    an axis appears once per cycle whatever the seed, and different seeds
    pair the axes differently."""

    def __init__(self, seed: int) -> None:
        self._random = random.Random(seed)
        self._shuffled_axes: dict[str, tuple] = {}

    def pick(self, axis_name: str, axis_values: Sequence, position: int):
        if axis_name not in self._shuffled_axes:
            self._shuffled_axes[axis_name] = tuple(
                self._random.sample(list(axis_values), len(axis_values))
            )
        shuffled = self._shuffled_axes[axis_name]
        return shuffled[position % len(shuffled)]


# A family's builder makes its cases with this: ParityCase with the family,
# the builder's name in _FAMILY_BUILDERS, filled in.
_CaseOfFamily = Callable[..., ParityCase]


def _rotated_case(
    case: _CaseOfFamily, rotation: _SeededRotation, axis: str, position: int,
    widths: Sequence[int], **fields: object,
) -> ParityCase:
    """A case whose width, then head counts, rotate on the family's own
    axes (``axis/width``, ``axis/heads``)."""
    return case(
        width=rotation.pick(f"{axis}/width", widths, position),
        heads=rotation.pick(f"{axis}/heads", HEAD_COUNTS, position),
        **fields,
    )


def _rotated_weighting(
    rotation: _SeededRotation, axis: str, dtypes: DtypeConfiguration, position: int
) -> Weighting:
    """Every weighting in turn (``axis/weighting``), except for dtype
    configurations that promote: they promote only through a weight, so
    they take the weighted ones in turn (``axis/weighting-promoting``)."""
    if dtypes in PROMOTING_DTYPE_CONFIGURATIONS:
        return rotation.pick(f"{axis}/weighting-promoting", WEIGHTED_WEIGHTINGS, position)
    return rotation.pick(f"{axis}/weighting", tuple(Weighting), position)


def _fit_to_element_budget(case: ParityCase, element_budget: int) -> ParityCase:
    """Halves the batch, then the sequence, until the query input fits, so
    a wide prefill stays a (shorter) prefill; the case description then
    names what actually runs."""
    while case.query_element_count > element_budget and case.batch_size > 1:
        case = replace(case, batch_size=case.batch_size // 2)
    while case.query_element_count > element_budget and case.sequence_length > 1:
        case = replace(case, sequence_length=case.sequence_length // 2)
    return case


def _width_by_dtype_family(rotation: _SeededRotation, case: _CaseOfFamily) -> list[ParityCase]:
    return [
        case(
            width=width, dtypes=dtypes, heads=rotation.pick("width/heads", HEAD_COUNTS, position),
            batch_size=rotation.pick("width/batch", BATCH_SIZES, position),
            sequence_length=rotation.pick("width/seq", SEQUENCE_LENGTHS, position),
            weighting=weighting,
        )
        for position, (width, dtypes) in enumerate(itertools.product(WIDTHS, DTYPE_CONFIGURATIONS))
        for weighting in [_rotated_weighting(rotation, "width", dtypes, position)]
    ]


def _head_counts_family(rotation: _SeededRotation, case: _CaseOfFamily) -> list[ParityCase]:
    """Gated-delta shape (weightless, width 128) and full-attention shape
    (weighted, width 256), each pair of head counts at decode and at prefill, in
    bfloat16 as models run them."""
    model_shapes = ((128, Weighting.WEIGHTLESS), (256, Weighting.WEIGHTED))
    return [
        case(
            width=width, dtypes=BFLOAT16_DTYPES, heads=heads,
            batch_size=rotation.pick("heads/batch", BATCH_SIZES, position),
            sequence_length=sequence_length, weighting=weighting,
        )
        for position, (heads, sequence_length, (width, weighting)) in enumerate(
            itertools.product(HEAD_COUNTS, SEQUENCE_LENGTHS, model_shapes)
        )
    ]


def _batch_and_sequence_family(rotation: _SeededRotation, case: _CaseOfFamily) -> list[ParityCase]:
    """Batch 1..8 at decode (width 128) and prefill (width 64, so batch 8 of
    512 tokens of 16 heads fits the budget)."""
    decode_and_prefill = ((DECODE_SEQUENCE_LENGTH, 128), (PREFILL_SEQUENCE_LENGTH, 64))
    return [
        case(
            width=width, dtypes=dtypes, heads=HeadCounts(16, 16), batch_size=batch_size,
            sequence_length=sequence_length, weighting=Weighting.WEIGHTLESS,
        )
        for position, batch_size in enumerate(BATCH_SIZES)
        for dtypes in [rotation.pick("batch/dtypes", BASE_DTYPE_CONFIGURATIONS, position)]
        for sequence_length, width in decode_and_prefill
    ]


def _epsilon_family(rotation: _SeededRotation, case: _CaseOfFamily) -> list[ParityCase]:
    """Each epsilon with each base dtype, weightless and weighted, on
    near-epsilon, zero and subnormal rows: the only rows where an epsilon
    that is off by one ulp changes any output bit."""
    return [
        _rotated_case(
            case, rotation, "eps", position, (128, 256),
            dtypes=dtypes, batch_size=1, sequence_length=4, eps=eps,
            weighting=weighting, value_profile=ValueProfile.NEAR_EPSILON,
        )
        for position, (eps, dtypes, weighting) in enumerate(itertools.product(
            EPSILONS, BASE_DTYPE_CONFIGURATIONS, (Weighting.WEIGHTLESS, Weighting.WEIGHTED)
        ))
    ]


def _non_contiguous_family(rotation: _SeededRotation, case: _CaseOfFamily) -> list[ParityCase]:
    """Each non-contiguous layout for queries (and, shifted by one, for
    keys) with each base dtype. Weight views rotate over the weighted cases
    only, so each appears whatever the seed. Width-sliced weightless inputs
    are the production gated-delta case: mlx-lm splits q, k and v out of one
    convolution output."""
    layouts = NON_CONTIGUOUS_INPUT_LAYOUTS
    cases: list[ParityCase] = []
    weighted_position = 0
    for position, (layout_index, dtypes) in enumerate(
        itertools.product(range(len(layouts)), BASE_DTYPE_CONFIGURATIONS)
    ):
        weighting = rotation.pick("views/weighting", tuple(Weighting), position)
        weight_layout = WeightLayout.CONTIGUOUS
        if weighting is not Weighting.WEIGHTLESS:
            weight_layout = rotation.pick(
                "views/weight-layout", NON_CONTIGUOUS_WEIGHT_LAYOUTS, weighted_position
            )
            weighted_position += 1
        cases.append(case(
            width=rotation.pick("views/width", (64, 128, 200, 256), position),
            dtypes=dtypes, heads=rotation.pick("views/heads", HEAD_COUNTS, position),
            batch_size=rotation.pick("views/batch", (1, 2, 3), position),
            sequence_length=rotation.pick("views/seq", (1, 7), position),
            weighting=weighting, query_layout=layouts[layout_index],
            key_layout=layouts[(layout_index + 1) % len(layouts)], weight_layout=weight_layout,
        ))
    return cases


def _special_values_family(rotation: _SeededRotation, case: _CaseOfFamily) -> list[ParityCase]:
    """Each special-value profile with each dtype configuration, at a
    rotating width (up to 8192)."""
    return [
        case(
            width=rotation.pick("special/width", WIDTHS, position), dtypes=dtypes,
            heads=rotation.pick("special/heads", HEAD_COUNTS, position),
            batch_size=rotation.pick("special/batch", (1, 2), position),
            sequence_length=rotation.pick("special/seq", (1, 5), position),
            weighting=_rotated_weighting(rotation, "special", dtypes, position),
            value_profile=value_profile,
        )
        for position, (value_profile, dtypes) in enumerate(
            itertools.product(SPECIAL_VALUE_PROFILES, DTYPE_CONFIGURATIONS)
        )
    ]


def _mixed_dtypes_family(rotation: _SeededRotation, case: _CaseOfFamily) -> list[ParityCase]:
    """Queries and keys of different dtypes (each traced separately), and
    half-precision inputs with a weight of the other half type (promoting to
    float32), on rows of every special kind."""
    pairs = [
        (dtypes, weighting) for dtypes in MIXED_DTYPE_CONFIGURATIONS
        for weighting in (
            (Weighting.WEIGHTLESS, Weighting.WEIGHTED)
            if dtypes.query_dtype != dtypes.key_dtype else (Weighting.WEIGHTED,)
        )
    ]
    return [
        _rotated_case(
            case, rotation, "mixed", position, (128, 256),
            dtypes=dtypes, batch_size=2, sequence_length=3,
            weighting=weighting, value_profile=ValueProfile.ALL_SPECIAL_ROWS,
        )
        for position, (dtypes, weighting) in enumerate(pairs)
    ]


_FAMILY_BUILDERS: dict[str, Callable[[_SeededRotation, _CaseOfFamily], list[ParityCase]]] = {
    "width_by_dtype": _width_by_dtype_family,
    "head_counts": _head_counts_family,
    "batch_and_sequence": _batch_and_sequence_family,
    "epsilon": _epsilon_family,
    "non_contiguous": _non_contiguous_family,
    "special_values": _special_values_family,
    "mixed_dtypes": _mixed_dtypes_family,
}
FAMILY_NAMES: tuple[str, ...] = tuple(_FAMILY_BUILDERS)


def build_full_parity_matrix(seed: int = DEFAULT_PARITY_SEED) -> list[ParityCase]:
    """The covering matrix (about 160 cases), deterministic from the seed."""
    rotation = _SeededRotation(seed)
    cases: list[ParityCase] = []
    for family, build_family in _FAMILY_BUILDERS.items():
        cases.extend(
            _fit_to_element_budget(case, FULL_MATRIX_ELEMENT_BUDGET)
            for case in build_family(rotation, functools.partial(ParityCase, family))
        )
    return cases


def _belongs_to_quick_matrix(case: ParityCase) -> bool:
    """A few cases per family, chosen so each deliberate perturbation the
    tests try (epsilon off by an ulp, outputs swapped, weight applied before
    rounding, NaN flushed, dtype changed) still shows up."""
    if case.family == "width_by_dtype":
        return case.width in (128, 256)
    if case.family == "head_counts":
        return case.sequence_length == DECODE_SEQUENCE_LENGTH
    if case.family == "batch_and_sequence":
        return case.sequence_length == DECODE_SEQUENCE_LENGTH and case.batch_size in (1, 8)
    if case.family == "epsilon":
        return case.dtypes.query_dtype == mx.float32 or case.eps == 0.0
    if case.family == "non_contiguous":
        return case.dtypes.query_dtype == mx.bfloat16
    if case.family == "special_values":
        return case.value_profile is ValueProfile.ALL_SPECIAL_ROWS
    return case.family == "mixed_dtypes"


def build_quick_parity_matrix(seed: int = DEFAULT_PARITY_SEED) -> list[ParityCase]:
    """About 50 cases picked from the full matrix and shrunk (batch first,
    then sequence) to at most 128 Ki query elements: a second or two on CPU
    once kernels are cached, for the package's routine checks. A shrunk
    case has its own description, hence its own values."""
    return [
        _fit_to_element_budget(case, QUICK_MATRIX_ELEMENT_BUDGET)
        for case in build_full_parity_matrix(seed)
        if _belongs_to_quick_matrix(case)
    ]
