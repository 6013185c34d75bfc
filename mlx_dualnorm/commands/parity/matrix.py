"""The dual head norm's parity cases: a case and its axes, its inputs, and the
designed matrix (``FAMILY_NAMES``): each family fixes the axes it is about and
rotates the rest in seed-shuffled orders, since the product of all axes is
millions of cases. A case's values come from the seed and its description, so
it reproduces from the description alone; a non-contiguous input is a view of
a larger or permuted buffer whose unused slots hold NaN."""

from __future__ import annotations

import enum
import functools
import itertools
import math
import random
import zlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx

DEFAULT_PARITY_SEED = 20261129
PRODUCTION_RMS_NORM_EPSILON = 1e-6

# ---- A case: its axes ------------------------------------------------------------


@dataclass(frozen=True)
class DtypeConfiguration:
    """Input and weight dtypes of one case. A float32 weight on half
    precision input exercises promotion (the output becomes float32)."""

    name: str
    query_dtype: mx.Dtype
    key_dtype: mx.Dtype
    weight_dtype: mx.Dtype


@dataclass(frozen=True)
class HeadCounts:
    query_heads: int
    key_heads: int


class Weighting(enum.Enum):
    WEIGHTLESS = "weightless"
    WEIGHTED = "weighted"
    QUERY_WEIGHT_ONLY = "query-weight-only"
    KEY_WEIGHT_ONLY = "key-weight-only"


class InputLayout(enum.Enum):
    """How a ``(batch, sequence, heads, width)`` input sits in memory."""

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
    """Which kinds of rows an input holds (see ``generate_head_values``)."""

    VARIED_ROWS = "varied-rows"
    NEAR_EPSILON = "near-epsilon"
    ZERO_ROWS = "zero-rows"
    OVERFLOWING_SQUARES = "overflowing-squares"
    SUBNORMAL_ROWS = "subnormal-rows"
    NAN_AND_INF = "nan-and-inf"
    ALL_SPECIAL_ROWS = "all-special-rows"


@dataclass(frozen=True)
class ParityCase:
    """One point of the matrix. Inputs are ``(batch, sequence, heads,
    width)``; queries and keys share all but the head count."""

    family: str
    width: int
    dtypes: DtypeConfiguration
    heads: HeadCounts
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
            f"width={self.width}", f"dtypes={self.dtypes.name}",
            f"heads={self.heads.query_heads}/{self.heads.key_heads}", f"batch={self.batch_size}",
            f"seq={self.sequence_length}", f"eps={self.eps!r}", self.weighting.value,
            f"values={self.value_profile.value}",
        ]
        layouts = {"q": self.query_layout, "k": self.key_layout, "w": self.weight_layout}
        parts += [f"{side}-layout={layout.value}" for side, layout in layouts.items()
                  if layout.value != "contiguous"]
        return " ".join(parts)


# ---- Its inputs' type and key -------------------------------------------------


@dataclass(frozen=True)
class DualNormInputs:
    queries: mx.array
    keys: mx.array
    query_weight: Optional[mx.array]
    key_weight: Optional[mx.array]


def case_key(description: str, seed: int) -> mx.array:
    """The MLX key of a case's values: the seed and a hash of the case's
    description, so a case reproduces from its description alone."""
    return mx.random.key(((seed & 0xFFFFFFFF) << 32) | zlib.crc32(description.encode()))


# ---- The axes' values ---------------------------------------------------------------

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
DECODE_SEQUENCE_LENGTH, PREFILL_SEQUENCE_LENGTH = 1, 512
SEQUENCE_LENGTHS: tuple[int, ...] = (DECODE_SEQUENCE_LENGTH, PREFILL_SEQUENCE_LENGTH)
EPSILONS: tuple[float, ...] = (1e-6, 1e-5, 1e-12, 0.0)
"""1e-6 and 1e-5 are what models use, 1e-12 sits far below any float32
mean square of O(1) rows, and 0 turns zero rows into 0 * inf = NaN."""
WEIGHTED_WEIGHTINGS = (Weighting.WEIGHTED, Weighting.QUERY_WEIGHT_ONLY, Weighting.KEY_WEIGHT_ONLY)
NON_CONTIGUOUS_INPUT_LAYOUTS = tuple(InputLayout)[1:]  # all but the first, CONTIGUOUS
NON_CONTIGUOUS_WEIGHT_LAYOUTS = tuple(WeightLayout)[1:]
SPECIAL_VALUE_PROFILES = tuple(  # all but those of the width and epsilon families
    profile for profile in ValueProfile
    if profile not in (ValueProfile.VARIED_ROWS, ValueProfile.NEAR_EPSILON)
)

FULL_MATRIX_ELEMENT_BUDGET = 1 << 22
"""Most elements one query input may hold (4 Mi): a prefill of 8 x 512 x 32
heads x 8192 would take seconds per case on CPU to generate and normalize."""
QUICK_MATRIX_ELEMENT_BUDGET = 1 << 17


# ---- The matrix ------------------------------------------------------------------------


_Pick = Callable[[str, Sequence], Any]  # (axis name, its values) -> the value picked
_At = Callable[[str, int], _Pick]  # (family, position) -> its picker there


def _rotation(seed: int) -> _At:
    """``at(family, position)``: the picker of a family's axes at a position.
    Each axis cycles through its values in a seed-shuffled order, so every
    value appears once per cycle whatever the seed, and different seeds pair
    the axes differently."""
    draw = random.Random(seed)
    orders: dict[str, list] = {}

    def at(family: str, position: int) -> _Pick:
        def pick(axis: str, values: Sequence) -> Any:
            name = f"{family}/{axis}"
            if name not in orders:
                orders[name] = draw.sample(list(values), len(values))
            return orders[name][position % len(values)]

        return pick

    return at


def _weighting(pick: _Pick, dtypes: DtypeConfiguration) -> Weighting:
    """Every weighting in turn, except for dtype configurations that promote:
    they promote only through a weight, so they take the weighted ones."""
    if dtypes in PROMOTING_DTYPE_CONFIGURATIONS:
        return pick("weighting-promoting", WEIGHTED_WEIGHTINGS)
    return pick("weighting", tuple(Weighting))


# A family's builder makes its cases with this: ParityCase with the family filled in.
_CaseOfFamily = Callable[..., ParityCase]


def _width_by_dtype_family(at: _At, case: _CaseOfFamily) -> list[ParityCase]:
    cases = []
    for position, (width, dtypes) in enumerate(itertools.product(WIDTHS, DTYPE_CONFIGURATIONS)):
        pick = at("width", position)
        weighting = _weighting(pick, dtypes)
        cases.append(case(
            width=width, dtypes=dtypes, heads=pick("heads", HEAD_COUNTS),
            batch_size=pick("batch", BATCH_SIZES), sequence_length=pick("seq", SEQUENCE_LENGTHS),
            weighting=weighting,
        ))
    return cases


def _head_counts_family(at: _At, case: _CaseOfFamily) -> list[ParityCase]:
    """Gated-delta shape (weightless, width 128) and full-attention shape
    (weighted, width 256), each pair of head counts at decode and at prefill,
    in bfloat16 as models run them."""
    model_shapes = ((128, Weighting.WEIGHTLESS), (256, Weighting.WEIGHTED))
    return [
        case(width=width, dtypes=BFLOAT16_DTYPES, heads=heads,
             batch_size=at("heads", position)("batch", BATCH_SIZES),
             sequence_length=sequence_length, weighting=weighting)
        for position, (heads, sequence_length, (width, weighting)) in enumerate(
            itertools.product(HEAD_COUNTS, SEQUENCE_LENGTHS, model_shapes))
    ]


def _batch_and_sequence_family(at: _At, case: _CaseOfFamily) -> list[ParityCase]:
    """Batch 1..8 at decode (width 128) and prefill (width 64, so batch 8 of
    512 tokens of 16 heads fits the budget)."""
    return [
        case(width=width, dtypes=dtypes, heads=HeadCounts(16, 16), batch_size=batch_size,
             sequence_length=sequence_length, weighting=Weighting.WEIGHTLESS)
        for position, batch_size in enumerate(BATCH_SIZES)
        for dtypes in [at("batch", position)("dtypes", BASE_DTYPE_CONFIGURATIONS)]
        for sequence_length, width in ((DECODE_SEQUENCE_LENGTH, 128), (PREFILL_SEQUENCE_LENGTH, 64))
    ]


def _epsilon_family(at: _At, case: _CaseOfFamily) -> list[ParityCase]:
    """Each epsilon with each base dtype, weightless and weighted, on
    near-epsilon, zero and subnormal rows: the only rows where an epsilon
    that is off by one ulp changes any output bit."""
    return [
        case(width=pick("width", (128, 256)), heads=pick("heads", HEAD_COUNTS), dtypes=dtypes,
             batch_size=1, sequence_length=4, eps=eps, weighting=weighting,
             value_profile=ValueProfile.NEAR_EPSILON)
        for position, (eps, dtypes, weighting) in enumerate(itertools.product(
            EPSILONS, BASE_DTYPE_CONFIGURATIONS, (Weighting.WEIGHTLESS, Weighting.WEIGHTED)))
        for pick in [at("eps", position)]
    ]


def _non_contiguous_family(at: _At, case: _CaseOfFamily) -> list[ParityCase]:
    """Each non-contiguous layout for queries (and, shifted by one, for
    keys) with each base dtype. Weight views rotate over the weighted cases
    only, so each appears whatever the seed. Width-sliced weightless inputs
    are the production gated-delta case: mlx-lm splits q, k and v out of one
    convolution output."""
    layouts = NON_CONTIGUOUS_INPUT_LAYOUTS
    cases: list[ParityCase] = []
    for position, (layout_index, dtypes) in enumerate(
        itertools.product(range(len(layouts)), BASE_DTYPE_CONFIGURATIONS)
    ):
        pick = at("views", position)
        weighting = pick("weighting", tuple(Weighting))
        weight_layout = WeightLayout.CONTIGUOUS
        if weighting is not Weighting.WEIGHTLESS:
            weighted_position = sum(case.weighting is not Weighting.WEIGHTLESS for case in cases)
            weight_layout = at("views", weighted_position)(
                "weight-layout", NON_CONTIGUOUS_WEIGHT_LAYOUTS
            )
        cases.append(case(
            width=pick("width", (64, 128, 200, 256)), dtypes=dtypes,
            heads=pick("heads", HEAD_COUNTS),
            batch_size=pick("batch", (1, 2, 3)), sequence_length=pick("seq", (1, 7)),
            weighting=weighting, query_layout=layouts[layout_index],
            key_layout=layouts[(layout_index + 1) % len(layouts)], weight_layout=weight_layout,
        ))
    return cases


def _special_values_family(at: _At, case: _CaseOfFamily) -> list[ParityCase]:
    """Each special-value profile with each dtype configuration, at a
    rotating width (up to 8192)."""
    return [
        case(width=pick("width", WIDTHS), dtypes=dtypes, heads=pick("heads", HEAD_COUNTS),
             batch_size=pick("batch", (1, 2)), sequence_length=pick("seq", (1, 5)),
             weighting=_weighting(pick, dtypes), value_profile=value_profile)
        for position, (value_profile, dtypes) in enumerate(
            itertools.product(SPECIAL_VALUE_PROFILES, DTYPE_CONFIGURATIONS))
        for pick in [at("special", position)]
    ]


def _mixed_dtypes_family(at: _At, case: _CaseOfFamily) -> list[ParityCase]:
    """Queries and keys of different dtypes (each traced separately), and
    half-precision inputs with a weight of the other half type (promoting to
    float32), on rows of every special kind."""
    pairs = [
        (dtypes, weighting) for dtypes in MIXED_DTYPE_CONFIGURATIONS
        for weighting in ((Weighting.WEIGHTLESS, Weighting.WEIGHTED)
                          if dtypes.query_dtype != dtypes.key_dtype else (Weighting.WEIGHTED,))
    ]
    return [
        case(width=pick("width", (128, 256)), heads=pick("heads", HEAD_COUNTS), dtypes=dtypes,
             batch_size=2, sequence_length=3, weighting=weighting,
             value_profile=ValueProfile.ALL_SPECIAL_ROWS)
        for position, (dtypes, weighting) in enumerate(pairs)
        for pick in [at("mixed", position)]
    ]


_FAMILY_BUILDERS: dict[str, Callable[[_At, _CaseOfFamily], list[ParityCase]]] = {
    "width_by_dtype": _width_by_dtype_family,
    "head_counts": _head_counts_family,
    "batch_and_sequence": _batch_and_sequence_family,
    "epsilon": _epsilon_family,
    "non_contiguous": _non_contiguous_family,
    "special_values": _special_values_family,
    "mixed_dtypes": _mixed_dtypes_family,
}
FAMILY_NAMES: tuple[str, ...] = tuple(_FAMILY_BUILDERS)


def _fit_to_element_budget(case: ParityCase, element_budget: int) -> ParityCase:
    """Halves the batch, then the sequence, until the query input fits, so
    a wide prefill stays a (shorter) prefill; the case description then
    names what actually runs."""
    while case.query_element_count > element_budget and case.batch_size > 1:
        case = replace(case, batch_size=case.batch_size // 2)
    while case.query_element_count > element_budget and case.sequence_length > 1:
        case = replace(case, sequence_length=case.sequence_length // 2)
    return case


def build_full_parity_matrix(seed: int = DEFAULT_PARITY_SEED) -> list[ParityCase]:
    """The covering matrix (about 160 cases), deterministic from the seed."""
    at = _rotation(seed)
    return [
        _fit_to_element_budget(case, FULL_MATRIX_ELEMENT_BUDGET)
        for family, build_family in _FAMILY_BUILDERS.items()
        for case in build_family(at, functools.partial(ParityCase, family))
    ]


_IN_QUICK_MATRIX: dict[str, Callable[[ParityCase], bool]] = {
    "width_by_dtype": lambda case: case.width in (128, 256),
    "head_counts": lambda case: case.sequence_length == DECODE_SEQUENCE_LENGTH,
    "batch_and_sequence": lambda case: (
        case.sequence_length == DECODE_SEQUENCE_LENGTH and case.batch_size in (1, 8)),
    "epsilon": lambda case: case.dtypes.query_dtype == mx.float32 or case.eps == 0.0,
    "non_contiguous": lambda case: case.dtypes.query_dtype == mx.bfloat16,
    "special_values": lambda case: case.value_profile is ValueProfile.ALL_SPECIAL_ROWS,
    "mixed_dtypes": lambda case: True,
}
"""A few cases per family, chosen so each deliberate perturbation the tests
try (epsilon off by an ulp, outputs swapped, weight applied before rounding,
NaN flushed, dtype changed) still shows up."""


def build_quick_parity_matrix(seed: int = DEFAULT_PARITY_SEED) -> list[ParityCase]:
    """About 50 cases picked from the full matrix and shrunk (batch first,
    then sequence) to at most 128 Ki query elements: a second or two on CPU
    once kernels are cached, for the package's routine checks. A shrunk
    case has its own description, hence its own values."""
    return [
        _fit_to_element_budget(case, QUICK_MATRIX_ELEMENT_BUDGET)
        for case in build_full_parity_matrix(seed) if _IN_QUICK_MATRIX[case.family](case)
    ]
