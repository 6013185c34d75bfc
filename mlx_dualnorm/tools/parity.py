"""The parity contract: any dual head norm path against the composed path.

The package's one promise is that ``CompiledDualHeadNorm(eps)(q, k, wq, wk)``
returns exactly what two ``mx.fast.rms_norm`` calls return. This module
checks that promise for ANY callable with the signature
``path(queries, keys, query_weight, key_weight) -> (normalized_queries,
normalized_keys)``, built per epsilon by a factory ``make_path(eps)``. An
output agrees when its shape and dtype match the composed path's and
``mx.array_equal(actual, expected, equal_nan=True)`` holds; ``bitwise=True``
additionally demands identical bit patterns (signed zeros, NaN signs and
payloads). Bits are the promise, so the command line compares bits unless
``--values`` asks for values only. It also checks the dual head norm +
RoPE (:mod:`mlx_dualnorm.tools.rope_parity`), and ends with a one-line
verdict, after a line for each path it left out and why.

Why a designed matrix rather than the Cartesian product: the axes below
(11 widths x 5 dtype configurations x 3 head layouts x 8 batch sizes x 2
sequence lengths x 4 epsilons x 4 weightings x 7 memory layouts x 7 value
profiles) multiply to millions of cases, and on a CPU every case costs
input generation plus two evaluations. Instead each family fixes the axes it
is about and rotates the rest:

- ``width_by_dtype``: every width with every dtype configuration, rotating
  head layout, batch, sequence length and weighting.
- ``head_layout``: each q/k head layout at decode and prefill, for the
  gated-delta shape (weightless, width 128) and the full-attention shape
  (weighted, width 256).
- ``batch_and_sequence``: batch 1..8 at decode and at prefill.
- ``epsilon``: each epsilon with each dtype, weighted and weightless, on rows
  whose mean square is near epsilon (and zero rows), where epsilon changes
  the result; elsewhere it is lost in rounding.
- ``non_contiguous``: transposed, strided, sliced and broadcast inputs, with
  strided, reversed and broadcast weight views.
- ``special_values``: zero rows, squares that overflow, subnormals, NaN and
  infinities, for every dtype configuration.
- ``mixed_dtypes``: queries and keys of different dtypes, cross promotions.

Rotations are drawn from ``random.Random(seed)``; input values come from an
MLX key derived from the seed and the case's description, so a case
reproduces from its description alone (``build_case_inputs``). The quick
matrix picks a few cases per family and shrinks them to small sizes.

Epsilons other than the production 1e-6 appear only in the ``epsilon``
family: on CPU every epsilon, dtype and weighting compiles its own fused
kernel (g++, about half a second each on a cold kernel cache), so spreading
epsilons over every family would multiply the cold-start time without
covering anything new.

The paths are those of :mod:`mlx_dualnorm.tools.paths`, by the names every
tool uses; another path joins by ``register_path``, or by passing a mapping
of factories to :func:`run_parity_matrix` or :func:`main`.
"""

from __future__ import annotations

import argparse
import enum
import math
import random
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Optional, Protocol, Sequence

import mlx.core as mx

from mlx_dualnorm._bits import count_bit_differences, count_value_differences
from mlx_dualnorm.dual_head_norm import composed_dual_head_norm
from mlx_dualnorm.tools import command, paths
from mlx_dualnorm.tools.paths import (
    PATH_REGISTRY,
    REFERENCE_PATH,
    DualNormPath,
    DualNormPathFactory,
    PathUnavailable,
    describe_paths,
    make_compiled_path,
    make_composed_path,
    make_mx_compile_path,
    routinely_checked_paths,
    unavailable_paths,
)

__all__ = [
    "DEFAULT_PARITY_SEED",
    "DualNormInputs",
    "DualNormPath",
    "DualNormPathFactory",
    "DtypeConfiguration",
    "HeadLayout",
    "InputLayout",
    "OutputDifference",
    "PATH_FACTORIES",
    "ParityCase",
    "ParityMismatch",
    "ParityReport",
    "ValueProfile",
    "WeightLayout",
    "Weighting",
    "build_case_inputs",
    "build_full_parity_matrix",
    "build_quick_parity_matrix",
    "check_path_parity",
    "check_paths",
    "compare_dual_outputs",
    "format_parity_report",
    "generate_head_values",
    "main",
    "parity_verdict",
    "skipped_path_lines",
    "make_compiled_path",
    "make_composed_path",
    "make_mx_compile_path",
    "run_parity_matrix",
]

DEFAULT_PARITY_SEED = 20261129
PRODUCTION_RMS_NORM_EPSILON = 1e-6

PATH_FACTORIES: dict[str, DualNormPathFactory] = routinely_checked_paths()
"""The paths checked when none is named: every mode this build and device
can run, and Python's mx.compile for comparison (see tools.paths)."""

# ---- The axes of the matrix ---------------------------------------------------


@dataclass(frozen=True)
class DtypeConfiguration:
    """Input and weight dtypes of one case. A float32 weight on half
    precision input exercises promotion (the output becomes float32)."""

    name: str
    query_dtype: mx.Dtype
    key_dtype: mx.Dtype
    weight_dtype: mx.Dtype


@dataclass(frozen=True)
class HeadLayout:
    query_heads: int
    key_heads: int

    @property
    def name(self) -> str:
        return f"{self.query_heads}/{self.key_heads}"


class Weighting(enum.Enum):
    WEIGHTLESS = "weightless"
    WEIGHTED = "weighted"
    QUERY_WEIGHT_ONLY = "query-weight-only"
    KEY_WEIGHT_ONLY = "key-weight-only"

    @property
    def has_query_weight(self) -> bool:
        return self in (Weighting.WEIGHTED, Weighting.QUERY_WEIGHT_ONLY)

    @property
    def has_key_weight(self) -> bool:
        return self in (Weighting.WEIGHTED, Weighting.KEY_WEIGHT_ONLY)


class InputLayout(enum.Enum):
    """How a ``(batch, sequence, heads, width)`` input sits in memory. Every
    non-contiguous layout is a view of a larger or permuted buffer whose
    unused slots hold NaN, so a path reading outside the view shows."""

    CONTIGUOUS = "contiguous"
    HEADS_SEQUENCE_TRANSPOSED = "heads-sequence-transposed"
    LAST_AXIS_STRIDED = "last-axis-strided"
    ROW_SLICED = "row-sliced"
    WIDTH_SLICED = "width-sliced"
    STEPPED_LAST_AXIS = "stepped-last-axis"
    BROADCAST_HEADS = "broadcast-heads"


class WeightLayout(enum.Enum):
    CONTIGUOUS = "contiguous"
    STRIDED_COLUMN = "strided-column"
    REVERSED = "reversed"
    STEPPED = "stepped"
    BROADCAST_SCALAR = "broadcast-scalar"


class ValueProfile(enum.Enum):
    """Which kinds of rows an input holds (see ``_ROW_KINDS_BY_PROFILE``)."""

    VARIED_ROWS = "varied-rows"
    NEAR_EPSILON = "near-epsilon"
    ZERO_ROWS = "zero-rows"
    OVERFLOWING_SQUARES = "overflowing-squares"
    SUBNORMAL_ROWS = "subnormal-rows"
    NAN_AND_INF = "nan-and-inf"
    ALL_SPECIAL_ROWS = "all-special-rows"


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
    ValueProfile.NEAR_EPSILON: (
        _RowKind.SIGNED_ZERO,
        _RowKind.NEAR_EPSILON,
        _RowKind.NEAR_EPSILON,
        _RowKind.SUBNORMAL,
        _RowKind.NEAR_EPSILON,
    ),
    ValueProfile.ZERO_ROWS: (_RowKind.SIGNED_ZERO, _RowKind.VARIED, _RowKind.VARIED),
    ValueProfile.OVERFLOWING_SQUARES: (_RowKind.OVERFLOWING, _RowKind.VARIED),
    ValueProfile.SUBNORMAL_ROWS: (_RowKind.SUBNORMAL, _RowKind.VARIED),
    ValueProfile.NAN_AND_INF: (
        _RowKind.VARIED,
        _RowKind.NAN_INF_SPRINKLED,
        _RowKind.VARIED,
        _RowKind.INFINITE,
    ),
    ValueProfile.ALL_SPECIAL_ROWS: tuple(_RowKind),
}

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
HEAD_LAYOUTS: tuple[HeadLayout, ...] = (HeadLayout(16, 16), HeadLayout(24, 4), HeadLayout(32, 2))
BATCH_SIZES: tuple[int, ...] = tuple(range(1, 9))
DECODE_SEQUENCE_LENGTH = 1
PREFILL_SEQUENCE_LENGTH = 512
SEQUENCE_LENGTHS: tuple[int, ...] = (DECODE_SEQUENCE_LENGTH, PREFILL_SEQUENCE_LENGTH)
EPSILONS: tuple[float, ...] = (1e-6, 1e-5, 1e-12, 0.0)
"""1e-6 and 1e-5 are what models use, 1e-12 sits far below any float32
mean square of O(1) rows, and 0 turns zero rows into 0 * inf = NaN."""
WEIGHTED_WEIGHTINGS: tuple[Weighting, ...] = (
    Weighting.WEIGHTED,
    Weighting.QUERY_WEIGHT_ONLY,
    Weighting.KEY_WEIGHT_ONLY,
)
NON_CONTIGUOUS_INPUT_LAYOUTS: tuple[InputLayout, ...] = tuple(
    layout for layout in InputLayout if layout is not InputLayout.CONTIGUOUS
)
NON_CONTIGUOUS_WEIGHT_LAYOUTS: tuple[WeightLayout, ...] = tuple(
    layout for layout in WeightLayout if layout is not WeightLayout.CONTIGUOUS
)
SPECIAL_VALUE_PROFILES: tuple[ValueProfile, ...] = (
    ValueProfile.ZERO_ROWS,
    ValueProfile.OVERFLOWING_SQUARES,
    ValueProfile.SUBNORMAL_ROWS,
    ValueProfile.NAN_AND_INF,
    ValueProfile.ALL_SPECIAL_ROWS,
)

FULL_MATRIX_ELEMENT_BUDGET = 1 << 22
"""Most elements one query input may hold (4 Mi): a prefill of 8 x 512 x 32
heads x 8192 would take seconds per case on CPU to generate and normalize."""
QUICK_MATRIX_ELEMENT_BUDGET = 1 << 17


@dataclass(frozen=True)
class ParityCase:
    """One point of the matrix. Inputs are ``(batch, sequence, heads,
    width)``; queries and keys share all but the head count."""

    family: str
    width: int
    dtypes: DtypeConfiguration
    heads: HeadLayout
    batch_size: int
    sequence_length: int
    eps: float = PRODUCTION_RMS_NORM_EPSILON
    weighting: Weighting = Weighting.WEIGHTLESS
    query_layout: InputLayout = InputLayout.CONTIGUOUS
    key_layout: InputLayout = InputLayout.CONTIGUOUS
    weight_layout: WeightLayout = WeightLayout.CONTIGUOUS
    value_profile: ValueProfile = ValueProfile.VARIED_ROWS

    @property
    def query_shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, self.sequence_length, self.heads.query_heads, self.width)

    @property
    def key_shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, self.sequence_length, self.heads.key_heads, self.width)

    @property
    def query_element_count(self) -> int:
        return math.prod(self.query_shape)

    def describe(self) -> str:
        """Every field, in a stable order: the key the case's values are
        generated from, and what a mismatch report prints."""
        parts = [
            f"width={self.width}",
            f"dtypes={self.dtypes.name}",
            f"heads={self.heads.name}",
            f"batch={self.batch_size}",
            f"seq={self.sequence_length}",
            f"eps={self.eps!r}",
            self.weighting.value,
            f"values={self.value_profile.value}",
        ]
        if self.query_layout is not InputLayout.CONTIGUOUS:
            parts.append(f"q-layout={self.query_layout.value}")
        if self.key_layout is not InputLayout.CONTIGUOUS:
            parts.append(f"k-layout={self.key_layout.value}")
        if self.weight_layout is not WeightLayout.CONTIGUOUS:
            parts.append(f"w-layout={self.weight_layout.value}")
        return " ".join(parts)


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


def _fit_to_element_budget(case: ParityCase, element_budget: int) -> ParityCase:
    """Halves the batch, then the sequence, until the query input fits, so
    a wide prefill stays a (shorter) prefill; the case description then
    names what actually runs."""
    while case.query_element_count > element_budget and case.batch_size > 1:
        case = replace(case, batch_size=case.batch_size // 2)
    while case.query_element_count > element_budget and case.sequence_length > 1:
        case = replace(case, sequence_length=case.sequence_length // 2)
    return case


def _width_by_dtype_family(rotation: _SeededRotation) -> list[ParityCase]:
    cases = []
    for position, (width, dtypes) in enumerate(
        (width, dtypes) for width in WIDTHS for dtypes in DTYPE_CONFIGURATIONS
    ):
        promoting = dtypes in PROMOTING_DTYPE_CONFIGURATIONS
        weighting = (
            rotation.pick("width/weighting-promoting", WEIGHTED_WEIGHTINGS, position)
            if promoting
            else rotation.pick("width/weighting", tuple(Weighting), position)
        )
        cases.append(
            ParityCase(
                family="width_by_dtype",
                width=width,
                dtypes=dtypes,
                heads=rotation.pick("width/heads", HEAD_LAYOUTS, position),
                batch_size=rotation.pick("width/batch", BATCH_SIZES, position),
                sequence_length=rotation.pick("width/seq", SEQUENCE_LENGTHS, position),
                weighting=weighting,
            )
        )
    return cases


def _head_layout_family(rotation: _SeededRotation) -> list[ParityCase]:
    """Gated-delta shape (weightless, width 128) and full-attention shape
    (weighted, width 256), each head layout at decode and at prefill, in
    bfloat16 as models run them."""
    model_shapes = ((128, Weighting.WEIGHTLESS), (256, Weighting.WEIGHTED))
    cases = []
    position = 0
    for heads in HEAD_LAYOUTS:
        for sequence_length in SEQUENCE_LENGTHS:
            for width, weighting in model_shapes:
                cases.append(
                    ParityCase(
                        family="head_layout",
                        width=width,
                        dtypes=BFLOAT16_DTYPES,
                        heads=heads,
                        batch_size=rotation.pick("heads/batch", BATCH_SIZES, position),
                        sequence_length=sequence_length,
                        weighting=weighting,
                    )
                )
                position += 1
    return cases


def _batch_and_sequence_family(rotation: _SeededRotation) -> list[ParityCase]:
    """Batch 1..8 at decode (width 128) and prefill (width 64, so batch 8 of
    512 tokens of 16 heads fits the budget)."""
    cases = []
    for position, batch_size in enumerate(BATCH_SIZES):
        dtypes = rotation.pick("batch/dtypes", BASE_DTYPE_CONFIGURATIONS, position)
        decode_and_prefill = ((DECODE_SEQUENCE_LENGTH, 128), (PREFILL_SEQUENCE_LENGTH, 64))
        for sequence_length, width in decode_and_prefill:
            cases.append(
                ParityCase(
                    family="batch_and_sequence",
                    width=width,
                    dtypes=dtypes,
                    heads=HeadLayout(16, 16),
                    batch_size=batch_size,
                    sequence_length=sequence_length,
                    weighting=Weighting.WEIGHTLESS,
                )
            )
    return cases


def _epsilon_family(rotation: _SeededRotation) -> list[ParityCase]:
    """Each epsilon with each base dtype, weightless and weighted, on
    near-epsilon, zero and subnormal rows: the only rows where an epsilon
    that is off by one ulp changes any output bit."""
    cases = []
    position = 0
    for eps in EPSILONS:
        for dtypes in BASE_DTYPE_CONFIGURATIONS:
            for weighting in (Weighting.WEIGHTLESS, Weighting.WEIGHTED):
                cases.append(
                    ParityCase(
                        family="epsilon",
                        width=rotation.pick("eps/width", (128, 256), position),
                        dtypes=dtypes,
                        heads=rotation.pick("eps/heads", HEAD_LAYOUTS, position),
                        batch_size=1,
                        sequence_length=4,
                        eps=eps,
                        weighting=weighting,
                        value_profile=ValueProfile.NEAR_EPSILON,
                    )
                )
                position += 1
    return cases


def _non_contiguous_family(rotation: _SeededRotation) -> list[ParityCase]:
    """Each non-contiguous layout for queries (and, shifted by one, for
    keys) with each base dtype. Weight views rotate over the weighted cases
    only, so each appears whatever the seed. Width-sliced weightless inputs
    are the production gated-delta case: mlx-lm splits q, k and v out of one
    convolution output."""
    layout_count = len(NON_CONTIGUOUS_INPUT_LAYOUTS)
    cases = []
    position = 0
    weighted_position = 0
    for layout_index, query_layout in enumerate(NON_CONTIGUOUS_INPUT_LAYOUTS):
        key_layout = NON_CONTIGUOUS_INPUT_LAYOUTS[(layout_index + 1) % layout_count]
        for dtypes in BASE_DTYPE_CONFIGURATIONS:
            weighting = rotation.pick("views/weighting", tuple(Weighting), position)
            weight_layout = WeightLayout.CONTIGUOUS
            if weighting is not Weighting.WEIGHTLESS:
                weight_layout = rotation.pick(
                    "views/weight-layout", NON_CONTIGUOUS_WEIGHT_LAYOUTS, weighted_position
                )
                weighted_position += 1
            cases.append(
                ParityCase(
                    family="non_contiguous",
                    width=rotation.pick("views/width", (64, 128, 200, 256), position),
                    dtypes=dtypes,
                    heads=rotation.pick("views/heads", HEAD_LAYOUTS, position),
                    batch_size=rotation.pick("views/batch", (1, 2, 3), position),
                    sequence_length=rotation.pick("views/seq", (1, 7), position),
                    weighting=weighting,
                    query_layout=query_layout,
                    key_layout=key_layout,
                    weight_layout=weight_layout,
                )
            )
            position += 1
    return cases


def _special_values_family(rotation: _SeededRotation) -> list[ParityCase]:
    """Each special-value profile with each dtype configuration, at a
    rotating width (up to 8192)."""
    cases = []
    position = 0
    for value_profile in SPECIAL_VALUE_PROFILES:
        for dtypes in DTYPE_CONFIGURATIONS:
            promoting = dtypes in PROMOTING_DTYPE_CONFIGURATIONS
            cases.append(
                ParityCase(
                    family="special_values",
                    width=rotation.pick("special/width", WIDTHS, position),
                    dtypes=dtypes,
                    heads=rotation.pick("special/heads", HEAD_LAYOUTS, position),
                    batch_size=rotation.pick("special/batch", (1, 2), position),
                    sequence_length=rotation.pick("special/seq", (1, 5), position),
                    weighting=(
                        rotation.pick("special/weighting-promoting", WEIGHTED_WEIGHTINGS, position)
                        if promoting
                        else rotation.pick("special/weighting", tuple(Weighting), position)
                    ),
                    value_profile=value_profile,
                )
            )
            position += 1
    return cases


def _mixed_dtypes_family(rotation: _SeededRotation) -> list[ParityCase]:
    """Queries and keys of different dtypes (each traced separately), and
    half-precision inputs with a weight of the other half type (promoting to
    float32), on rows of every special kind."""
    cases = []
    position = 0
    for dtypes in MIXED_DTYPE_CONFIGURATIONS:
        weightings = (
            (Weighting.WEIGHTLESS, Weighting.WEIGHTED)
            if dtypes.query_dtype != dtypes.key_dtype
            else (Weighting.WEIGHTED,)
        )
        for weighting in weightings:
            cases.append(
                ParityCase(
                    family="mixed_dtypes",
                    width=rotation.pick("mixed/width", (128, 256), position),
                    dtypes=dtypes,
                    heads=rotation.pick("mixed/heads", HEAD_LAYOUTS, position),
                    batch_size=2,
                    sequence_length=3,
                    weighting=weighting,
                    value_profile=ValueProfile.ALL_SPECIAL_ROWS,
                )
            )
            position += 1
    return cases


_FAMILY_BUILDERS: dict[str, Callable[[_SeededRotation], list[ParityCase]]] = {
    "width_by_dtype": _width_by_dtype_family,
    "head_layout": _head_layout_family,
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
    for build_family in _FAMILY_BUILDERS.values():
        cases.extend(
            _fit_to_element_budget(case, FULL_MATRIX_ELEMENT_BUDGET)
            for case in build_family(rotation)
        )
    return cases


def _belongs_to_quick_matrix(case: ParityCase) -> bool:
    """A few cases per family, chosen so each deliberate perturbation the
    tests try (epsilon off by an ulp, outputs swapped, weight applied before
    rounding, NaN flushed, dtype changed) still shows up."""
    if case.family == "width_by_dtype":
        return case.width in (128, 256)
    if case.family == "head_layout":
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


# ---- Generating inputs ----------------------------------------------------------


@dataclass(frozen=True)
class DualNormInputs:
    queries: mx.array
    keys: mx.array
    query_weight: Optional[mx.array]
    key_weight: Optional[mx.array]


def _case_key(case: ParityCase, seed: int) -> mx.array:
    description_hash = zlib.crc32(case.describe().encode())
    return mx.random.key(((seed & 0xFFFFFFFF) << 32) | description_hash)


def _row_kind_values(
    row_kind: _RowKind,
    unit_values: mx.array,
    row_fractions: mx.array,
    special_fractions: mx.array,
    dtype: mx.Dtype,
    eps: float,
) -> mx.array:
    """float32 values of one row kind, ready to be cast to ``dtype``.
    ``unit_values`` are uniform in (-1, 1), ``row_fractions`` uniform in
    [0, 1) per row, ``special_fractions`` uniform in [0, 1) per element."""
    if row_kind is _RowKind.VARIED:
        return unit_values * mx.power(2.0, row_fractions * 6.0 - 3.0)
    if row_kind is _RowKind.SIGNED_ZERO:
        return unit_values * 0.0
    if row_kind is _RowKind.NEAR_EPSILON:
        # Mean squares of about 1e-4 eps .. 30 eps: where eps decides the
        # rounding. A zero eps is stood in for by 1e-12 (float16 rows then
        # underflow to zero, which is a case too).
        root_eps = math.sqrt(max(eps, 1e-12))
        return unit_values * (root_eps * mx.power(10.0, row_fractions * 3.0 - 2.0))
    if row_kind is _RowKind.OVERFLOWING:
        # |x| from sqrt(max) up to the largest power of two below max: the
        # squares overflow the input dtype (float32 too, for float32 and
        # bfloat16 input), the values themselves stay finite.
        largest_exponent = math.floor(math.log2(mx.finfo(dtype).max))
        smallest_exponent = largest_exponent / 2.0
        exponents = smallest_exponent + row_fractions * (largest_exponent - smallest_exponent)
        return unit_values * mx.power(2.0, exponents)
    if row_kind is _RowKind.SUBNORMAL:
        return unit_values * mx.finfo(dtype).smallest_normal
    if row_kind is _RowKind.NAN_INF_SPRINKLED:
        varied = unit_values * mx.power(2.0, row_fractions * 6.0 - 3.0)
        with_nan = mx.where(special_fractions < 1 / 32, mx.nan, varied)
        with_positive_inf = mx.where(
            (special_fractions >= 1 / 32) & (special_fractions < 2 / 32), mx.inf, with_nan
        )
        return mx.where(
            (special_fractions >= 2 / 32) & (special_fractions < 3 / 32), -mx.inf, with_positive_inf
        )
    if row_kind is _RowKind.INFINITE:
        return mx.where(unit_values < 0, -mx.inf, mx.inf)
    raise AssertionError(f"unhandled row kind {row_kind}")


def generate_head_values(
    shape: Sequence[int],
    dtype: mx.Dtype,
    value_profile: ValueProfile,
    eps: float,
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
        if _RowKind.NAN_INF_SPRINKLED in row_kinds
        else unit_values
    )
    if len(row_kinds) == 1:
        values = _row_kind_values(
            row_kinds[0], unit_values, row_fractions, special_fractions, dtype, eps
        )
        return values.astype(dtype)
    row_count = math.prod(shape[:-1])
    row_kind_index = (mx.arange(row_count) % len(row_kinds)).reshape(row_shape)
    values = mx.zeros(shape, dtype=mx.float32)
    for kind_index, row_kind in enumerate(row_kinds):
        kind_values = _row_kind_values(
            row_kind, unit_values, row_fractions, special_fractions, dtype, eps
        )
        values = mx.where(row_kind_index == kind_index, kind_values, values)
    return values.astype(dtype)


def _lay_out_input(
    logical_values: mx.array, layout: InputLayout
) -> mx.array:
    """A view with ``logical_values``' values (and shape) over a buffer laid
    out as ``layout`` says; slots outside the view hold NaN. The buffer is
    evaluated, so the view is a real strided view, not a fresh copy."""
    filler_dtype = logical_values.dtype
    if layout is InputLayout.CONTIGUOUS:
        mx.eval(logical_values)
        return logical_values
    if layout is InputLayout.HEADS_SEQUENCE_TRANSPOSED:
        buffer = mx.contiguous(logical_values.swapaxes(1, 2))
        mx.eval(buffer)
        view = buffer.swapaxes(1, 2)
    elif layout is InputLayout.LAST_AXIS_STRIDED:
        buffer = mx.contiguous(logical_values.swapaxes(-1, -2))
        mx.eval(buffer)
        view = buffer.swapaxes(-1, -2)
    elif layout is InputLayout.ROW_SLICED:
        filler = mx.full(logical_values.shape, mx.nan, dtype=filler_dtype)
        interleaved = mx.stack([filler, logical_values], axis=-2)
        batch, sequence, heads, width = logical_values.shape
        buffer = mx.contiguous(interleaved.reshape(batch, sequence, 2 * heads, width))
        mx.eval(buffer)
        view = buffer[:, :, 1::2, :]
    elif layout is InputLayout.WIDTH_SLICED:
        leading_filler = mx.full(logical_values.shape[:-1] + (2,), mx.nan, dtype=filler_dtype)
        trailing_filler = mx.full(logical_values.shape[:-1] + (1,), mx.nan, dtype=filler_dtype)
        buffer = mx.concatenate([leading_filler, logical_values, trailing_filler], axis=-1)
        mx.eval(buffer)
        view = buffer[..., 2 : 2 + logical_values.shape[-1]]
    elif layout is InputLayout.STEPPED_LAST_AXIS:
        filler = mx.full(logical_values.shape, mx.nan, dtype=filler_dtype)
        interleaved = mx.stack([logical_values, filler], axis=-1)
        buffer = mx.contiguous(interleaved.reshape(logical_values.shape[:-1] + (-1,)))
        mx.eval(buffer)
        view = buffer[..., ::2]
    elif layout is InputLayout.BROADCAST_HEADS:
        single_head = mx.contiguous(logical_values[:, :, :1, :])
        mx.eval(single_head)
        view = mx.broadcast_to(single_head, logical_values.shape)
    else:
        raise AssertionError(f"unhandled input layout {layout}")
    mx.eval(view)
    return view


def _lay_out_weight(logical_weight: mx.array, layout: WeightLayout) -> mx.array:
    """A ``(width,)`` weight view laid out as ``layout`` says."""
    width = logical_weight.shape[0]
    if layout is WeightLayout.CONTIGUOUS:
        view = logical_weight
    elif layout is WeightLayout.STRIDED_COLUMN:
        filler = mx.full((width,), mx.nan, dtype=logical_weight.dtype)
        buffer = mx.stack([filler, logical_weight, filler], axis=-1)
        mx.eval(buffer)
        view = buffer[:, 1]
    elif layout is WeightLayout.REVERSED:
        buffer = mx.contiguous(logical_weight[::-1])
        mx.eval(buffer)
        view = buffer[::-1]
    elif layout is WeightLayout.STEPPED:
        filler = mx.full((width,), mx.nan, dtype=logical_weight.dtype)
        buffer = mx.stack([logical_weight, filler], axis=-1).reshape(-1)
        mx.eval(buffer)
        view = buffer[::2]
    elif layout is WeightLayout.BROADCAST_SCALAR:
        scalar = logical_weight[:1]
        mx.eval(scalar)
        view = mx.broadcast_to(scalar, (width,))
    else:
        raise AssertionError(f"unhandled weight layout {layout}")
    mx.eval(view)
    return view


def build_case_inputs(case: ParityCase, seed: int = DEFAULT_PARITY_SEED) -> DualNormInputs:
    """The evaluated inputs of one case: what reproduces a reported mismatch.
    Weights are uniform in (-2, 2): signs, small and large scales."""
    query_key, key_key, query_weight_key, key_weight_key = mx.random.split(
        _case_key(case, seed), 4
    )
    queries = _lay_out_input(
        generate_head_values(
            case.query_shape, case.dtypes.query_dtype, case.value_profile, case.eps, query_key
        ),
        case.query_layout,
    )
    keys = _lay_out_input(
        generate_head_values(
            case.key_shape, case.dtypes.key_dtype, case.value_profile, case.eps, key_key
        ),
        case.key_layout,
    )

    def scale_weight(weight_key: mx.array) -> mx.array:
        weight = mx.random.uniform(-2.0, 2.0, (case.width,), key=weight_key)
        return _lay_out_weight(weight.astype(case.dtypes.weight_dtype), case.weight_layout)

    return DualNormInputs(
        queries=queries,
        keys=keys,
        query_weight=scale_weight(query_weight_key) if case.weighting.has_query_weight else None,
        key_weight=scale_weight(key_weight_key) if case.weighting.has_key_weight else None,
    )


# ---- Comparing ------------------------------------------------------------------


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


# ---- Running ---------------------------------------------------------------------


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


def _run_path_on_case(
    path: DualNormPath,
    inputs: DualNormInputs,
    expected: tuple[mx.array, mx.array],
    case: ParityCase,
    bitwise: bool,
) -> Optional[ParityMismatch]:
    try:
        actual = path(inputs.queries, inputs.keys, inputs.query_weight, inputs.key_weight)
        mx.eval(actual)
        differences = compare_dual_outputs(actual, expected, bitwise=bitwise)
    except Exception as error:  # a raising path is a broken contract, not a harness crash
        return ParityMismatch(case, error=f"{type(error).__name__}: {error}")
    return ParityMismatch(case, differences) if differences else None


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
                try:
                    paths_by_name_and_eps[path_key] = path_factory(case.eps)
                except PathUnavailable as unavailable:
                    raise PathUnavailable(f"path {path_name!r}: {unavailable}") from unavailable
            mismatch = _run_path_on_case(
                paths_by_name_and_eps[path_key], inputs, expected, case, bitwise
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


# ---- Reporting and the command line -----------------------------------------------

MISMATCHES_LISTED_PER_REPORT = 20


def format_parity_report(report: ParityReport) -> str:
    """A short table: cases and mismatched cases per family, then the first
    mismatches with their case descriptions."""
    contract = "bit patterns" if report.bitwise else "values (array_equal, NaN equal to NaN)"
    lines = [
        f"parity of {report.path_name!r} against {report.reference_description}, "
        f"{report.matrix_name} matrix, seed {report.seed}: dtype + shape + {contract}",
        *(f"  {line}" for line in _describe_checked_paths([report.path_name])),
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


def _describe_checked_paths(path_names: Sequence[str]) -> list[str]:
    from mlx_dualnorm.tools.rope_parity import ROPE_PATH_DESCRIPTIONS

    return [
        f"{name}: {ROPE_PATH_DESCRIPTIONS[name]}" if name in ROPE_PATH_DESCRIPTIONS
        else describe_paths([name])[0]
        for name in path_names
    ]


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


def skipped_path_lines(skipped: Mapping[str, str]) -> list[str]:
    return paths.skipped_path_lines("parity", dict(skipped))


def _parity_parser(
    path_names: Sequence[str], default_names: Sequence[str]
) -> argparse.ArgumentParser:
    from mlx_dualnorm.tools.rope_parity import ROPE_FAMILY

    parser = command.tool_parser(
        "parity",
        "Check dual head norm paths against two mx.fast.rms_norm calls, and the "
        "dual head norm + RoPE against composed_dual_head_norm_rope: same shape, "
        "same dtype, the same bits (with --values: equal values, NaN matching NaN). "
        "Exit status 0 all identical, 1 a mismatch, 2 bad usage or a path that "
        "cannot run here, 130 interrupted.",
    )
    parser.add_argument(
        "--path",
        dest="path_names",
        action="append",
        choices=list(path_names),
        help=f"path to check (repeatable; default: {', '.join(default_names)})",
    )
    parser.add_argument(
        "--quick", action="store_true", help="run the quick matrix (about 60 small cases)"
    )
    parser.add_argument(
        "--seed", type=int, default=DEFAULT_PARITY_SEED, help="seed of the matrix and its values"
    )
    parser.add_argument(
        "--family",
        dest="families",
        action="append",
        choices=[*FAMILY_NAMES, ROPE_FAMILY],
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


def _skipped_by_default(
    selectable: Mapping[str, DualNormPathFactory], rope_names: Sequence[str]
) -> dict[str, str]:
    """The paths a run without --path leaves out, and why."""
    from mlx_dualnorm.tools.rope_parity import available_rope_paths

    skipped = unavailable_paths(list(selectable))
    for name in selectable:
        path = PATH_REGISTRY.get(name)
        if name not in skipped and path is not None and not path.routinely_checked:
            skipped[name] = f"not checked by default (it retraces per shape; --path {name})"
    for name in rope_names:
        if name not in available_rope_paths():
            skipped[name] = f"mode {name.removeprefix('rope_')!r} is not available here"
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
    from mlx_dualnorm.tools import rope_parity

    cases = build_quick_parity_matrix(seed) if quick else build_full_parity_matrix(seed)
    if families:
        cases = [case for case in cases if case.family in families]
    rope_cases = (
        rope_parity.build_rope_parity_matrix(quick=quick)
        if not families or rope_parity.ROPE_FAMILY in families
        else []
    )
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


def main(
    argv: Optional[Sequence[str]] = None,
    *,
    path_factories: Optional[Mapping[str, DualNormPathFactory]] = None,
) -> int:
    """``python -m mlx_dualnorm parity``: prints one report per path and a
    verdict line; exits 1 when any path mismatches anywhere, 2 when a path
    named cannot run here. ``path_factories`` replaces the registered paths
    (a test's deliberately broken path, say), the norm + RoPE left out."""
    from mlx_dualnorm.tools import rope_parity

    if path_factories is None:
        selectable = {
            name: path.factory for name, path in PATH_REGISTRY.items() if name != REFERENCE_PATH
        }
        rope_names = list(rope_parity.ROPE_PATH_DESCRIPTIONS)
        default_names = [*PATH_FACTORIES, *rope_parity.available_rope_paths()]
    else:
        selectable, rope_names = dict(path_factories), []
        default_names = list(path_factories)

    def run(arguments: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        command.select_device(arguments.device, parser)
        named = arguments.path_names or default_names
        for name in named:
            if name in rope_names and name not in rope_parity.available_rope_paths():
                raise PathUnavailable(
                    f"path {name!r}: mode {name.removeprefix('rope_')!r} is not available here"
                )
        reports = check_paths(
            {name: selectable[name] for name in named if name not in rope_names},
            [name for name in named if name in rope_names],
            quick=arguments.quick,
            seed=arguments.seed,
            families=arguments.families,
            bitwise=arguments.bitwise,
        )
        if not arguments.path_names:
            for line in skipped_path_lines(_skipped_by_default(selectable, rope_names)):
                print(line)
        print(parity_verdict(reports))
        passed = all(report.passed for report in reports)
        return command.EXIT_OK if passed else command.EXIT_MISMATCH

    return command.run_tool(_parity_parser([*selectable, *rope_names], default_names), run, argv)


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
