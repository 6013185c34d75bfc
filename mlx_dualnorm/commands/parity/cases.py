"""A dual head norm parity case: its type, the values of its axes, and its inputs. A case's
values come from the seed and its description, so it reproduces from the description alone; a
non-contiguous input is a view of a larger or permuted buffer whose unused slots hold NaN."""

from __future__ import annotations

import enum
import math
import zlib
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

import mlx.core as mx

DEFAULT_PARITY_SEED = 20261129
PRODUCTION_RMS_NORM_EPSILON = 1e-6


@dataclass(frozen=True)
class DtypeConfiguration:
    """A float32 weight on half precision input exercises promotion."""

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


class ValueProfile(enum.Enum):
    """Which kinds of rows an input holds (``_ROW_KINDS_BY_PROFILE``)."""

    VARIED_ROWS = "varied-rows"
    NEAR_EPSILON = "near-epsilon"
    ZERO_ROWS = "zero-rows"
    OVERFLOWING_SQUARES = "overflowing-squares"
    SUBNORMAL_ROWS = "subnormal-rows"
    NAN_AND_INF = "nan-and-inf"
    ALL_SPECIAL_ROWS = "all-special-rows"


@dataclass(frozen=True)
class ParityCase:
    """One point of the matrix. Inputs are ``(batch, sequence, heads, width)``; queries and
    keys share all but the head count. A layout is a key of ``INPUT_VIEWS`` or ``WEIGHT_VIEWS``."""

    family: str
    width: int
    dtypes: DtypeConfiguration
    heads: HeadCounts
    batch_size: int
    sequence_length: int
    eps: float = PRODUCTION_RMS_NORM_EPSILON
    weighting: Weighting = Weighting.WEIGHTLESS
    query_layout: str = "contiguous"
    key_layout: str = "contiguous"
    weight_layout: str = "contiguous"
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
        """Every field, in a stable order: the key the case's values are generated from, and
        what a mismatch report prints."""
        layouts = {"q": self.query_layout, "k": self.key_layout, "w": self.weight_layout}
        return " ".join([
            f"width={self.width}", f"dtypes={self.dtypes.name}",
            f"heads={self.heads.query_heads}/{self.heads.key_heads}", f"batch={self.batch_size}",
            f"seq={self.sequence_length}", f"eps={self.eps!r}", self.weighting.value,
            f"values={self.value_profile.value}",
            *(f"{side}-layout={layout}" for side, layout in layouts.items()
              if layout != "contiguous"),
        ])


class DualNormInputs(NamedTuple):
    queries: mx.array
    keys: mx.array
    query_weight: Optional[mx.array]
    key_weight: Optional[mx.array]


Outputs = tuple[mx.array, mx.array]  # (normalized queries, normalized keys)
PathCalls = Callable[[str], Callable[[], Outputs]]  # a path's call on a case's inputs, by name


def case_key(description: str, seed: int) -> mx.array:
    """The MLX key of a case's values: the seed and a hash of the case's description."""
    return mx.random.key(((seed & 0xFFFFFFFF) << 32) | zlib.crc32(description.encode()))


_ROW_KINDS_BY_PROFILE: dict[ValueProfile, tuple[str, ...]] = {
    ValueProfile.VARIED_ROWS: ("varied",),
    ValueProfile.NEAR_EPSILON: ("signed-zero", "near-epsilon", "near-epsilon", "subnormal",
                                "near-epsilon"),
    ValueProfile.ZERO_ROWS: ("signed-zero", "varied", "varied"),
    ValueProfile.OVERFLOWING_SQUARES: ("overflowing", "varied"),
    ValueProfile.SUBNORMAL_ROWS: ("subnormal", "varied"),
    ValueProfile.NAN_AND_INF: ("varied", "nan-inf-sprinkled", "varied", "infinite"),
    ValueProfile.ALL_SPECIAL_ROWS: ("varied", "signed-zero", "near-epsilon", "overflowing",
                                    "subnormal", "nan-inf-sprinkled", "infinite"),
}


def generate_head_values(
    shape: Sequence[int], dtype: mx.Dtype, value_profile: ValueProfile, eps: float,
    key: mx.array,
) -> mx.array:
    """Inputs of ``shape`` whose rows (all axes but the last) cycle through the profile's row
    kinds. Deterministic from ``key``; MLX is lazy, so only the kinds used are computed."""
    shape = tuple(shape)
    row_shape = shape[:-1] + (1,)
    unit_key, row_key, special_key = mx.random.split(key, 3)
    unit_values = mx.random.uniform(-1.0, 1.0, shape, key=unit_key)
    row_fractions = mx.random.uniform(0.0, 1.0, row_shape, key=row_key)
    row_kinds = _ROW_KINDS_BY_PROFILE[value_profile]
    special_fractions = (
        mx.random.uniform(0.0, 1.0, shape, key=special_key)
        if "nan-inf-sprinkled" in row_kinds else unit_values
    )
    varied = unit_values * mx.power(2.0, row_fractions * 6.0 - 3.0)
    # Where eps decides the rounding; a zero eps is stood in for by 1e-12.
    root_eps = math.sqrt(max(eps, 1e-12))
    # Overflowing: |x| from sqrt(max) up to the largest power of two below max.
    largest = math.floor(math.log2(mx.finfo(dtype).max))
    exponents = largest / 2.0 + row_fractions * (largest - largest / 2.0)
    special = mx.where(special_fractions < 1 / 32, mx.nan,
                       mx.where(special_fractions < 2 / 32, mx.inf, -mx.inf))
    kind_values = {
        "varied": varied,  # magnitudes 2^-3 .. 2^3 per row
        "signed-zero": unit_values * 0.0,  # +0 and -0
        # mean square from ~1e-4 eps to ~30 eps
        "near-epsilon": unit_values * (root_eps * mx.power(10.0, row_fractions * 3.0 - 2.0)),
        "overflowing": unit_values * mx.power(2.0, exponents),  # squares overflow the dtype
        "subnormal": unit_values * mx.finfo(dtype).smallest_normal,  # below its smallest normal
        # ~3/32 of entries NaN/+inf/-inf
        "nan-inf-sprinkled": mx.where(special_fractions < 3 / 32, special, varied),
        "infinite": mx.where(unit_values < 0, -mx.inf, mx.inf),  # every entry +inf or -inf
    }
    row_kind_index = (mx.arange(math.prod(shape[:-1])) % len(row_kinds)).reshape(row_shape)
    values = kind_values[row_kinds[0]]
    for kind_index, kind in enumerate(row_kinds[1:], start=1):
        values = mx.where(row_kind_index == kind_index, kind_values[kind], values)
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


# How a (batch, sequence, heads, width) input, or a weight, sits in memory.
INPUT_VIEWS: dict[str, Callable[[mx.array], mx.array]] = {
    "contiguous": lambda values: values,
    "heads-sequence-transposed": lambda values: _evaluated(
        values.swapaxes(1, 2)).swapaxes(1, 2),
    "last-axis-strided": lambda values: _evaluated(values.swapaxes(-1, -2)).swapaxes(-1, -2),
    "row-sliced": lambda values: _evaluated(  # each head after a NaN head
        mx.stack([_nans(values), values], axis=-2).reshape(*values.shape[:2], -1, values.shape[3])
    )[:, :, 1::2, :],
    "width-sliced": lambda values: _evaluated(  # two NaN columns before, one after
        mx.concatenate([_nans(values, 2), values, _nans(values, 1)], axis=-1))[..., 2:-1],
    "stepped-last-axis": lambda values: _evaluated(  # a NaN after each element
        mx.stack([values, _nans(values)], axis=-1).reshape(*values.shape[:-1], -1))[..., ::2],
    "broadcast-heads": lambda values: mx.broadcast_to(
        _evaluated(values[:, :, :1, :]), values.shape),
}
WEIGHT_VIEWS: dict[str, Callable[[mx.array], mx.array]] = {
    "contiguous": lambda weight: weight,
    "strided-column": lambda weight: _evaluated(
        mx.stack([_nans(weight), weight, _nans(weight)], axis=-1))[:, 1],
    "reversed": lambda weight: _evaluated(weight[::-1])[::-1],
    "stepped": lambda weight: _evaluated(
        mx.stack([weight, _nans(weight)], axis=-1).reshape(-1))[::2],
    "broadcast-scalar": lambda weight: mx.broadcast_to(_evaluated(weight[:1]), weight.shape),
}


def build_case_inputs(case: ParityCase, seed: int = DEFAULT_PARITY_SEED) -> DualNormInputs:
    """The evaluated inputs of one case, laid out as it says: what reproduces a reported
    mismatch. Weights are uniform in (-2, 2): signs, small and large scales."""
    query_key, key_key, query_weight_key, key_weight_key = mx.random.split(
        case_key(case.describe(), seed), 4
    )

    def heads(shape: tuple[int, ...], dtype: mx.Dtype, layout: str, key: mx.array) -> mx.array:
        return INPUT_VIEWS[layout](
            generate_head_values(shape, dtype, case.value_profile, case.eps, key))

    def weight(side_only: Weighting, key: mx.array) -> Optional[mx.array]:
        if case.weighting not in (Weighting.WEIGHTED, side_only):
            return None
        values = mx.random.uniform(-2.0, 2.0, (case.width,), key=key)
        return WEIGHT_VIEWS[case.weight_layout](values.astype(case.dtypes.weight_dtype))

    inputs = DualNormInputs(
        heads(case.query_shape, case.dtypes.query_dtype, case.query_layout, query_key),
        heads(case.key_shape, case.dtypes.key_dtype, case.key_layout, key_key),
        weight(Weighting.QUERY_WEIGHT_ONLY, query_weight_key),
        weight(Weighting.KEY_WEIGHT_ONLY, key_weight_key),
    )
    mx.eval(inputs)
    return inputs


# The values of the axes.
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
"""1e-6 and 1e-5 are what models use, 1e-12 sits far below any float32 mean square of O(1)
rows, and 0 turns zero rows into 0 * inf = NaN."""
WEIGHTED_WEIGHTINGS = (Weighting.WEIGHTED, Weighting.QUERY_WEIGHT_ONLY, Weighting.KEY_WEIGHT_ONLY)
NON_CONTIGUOUS_INPUT_LAYOUTS = tuple(name for name in INPUT_VIEWS if name != "contiguous")
NON_CONTIGUOUS_WEIGHT_LAYOUTS = tuple(name for name in WEIGHT_VIEWS if name != "contiguous")
SPECIAL_VALUE_PROFILES: tuple[ValueProfile, ...] = (
    ValueProfile.ZERO_ROWS, ValueProfile.OVERFLOWING_SQUARES, ValueProfile.SUBNORMAL_ROWS,
    ValueProfile.NAN_AND_INF, ValueProfile.ALL_SPECIAL_ROWS,
)
