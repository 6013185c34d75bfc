"""A parity case (:class:`ParityCase`: its shape, dtypes, epsilon,
weighting, memory layouts and value profile, each axis a type here) and its
inputs: values of each kind of row, laid out in memory as the case says.

Values come from an MLX key derived from the seed and the case's
description (:func:`case_key`), so a case reproduces from its description
alone (:func:`build_case_inputs`). Every non-contiguous layout is a view of
a larger or permuted buffer whose unused slots hold NaN, so a path reading
outside the view shows.
"""

from __future__ import annotations

import enum
import math
import zlib
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx

__all__ = [
    "DEFAULT_PARITY_SEED", "DtypeConfiguration", "DualNormInputs", "HeadCounts", "InputLayout",
    "ParityCase", "ValueProfile", "WeightLayout", "Weighting", "build_case_inputs", "case_key",
    "generate_head_values",
]

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
    """Which kinds of rows an input holds (the row kinds of each profile are
    :mod:`mlx_dualnorm.commands.parity.inputs`'s)."""

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
            f"width={self.width}", f"dtypes={self.dtypes.name}", f"heads={self.heads.name}",
            f"batch={self.batch_size}", f"seq={self.sequence_length}", f"eps={self.eps!r}",
            self.weighting.value, f"values={self.value_profile.value}",
        ]
        if self.query_layout is not InputLayout.CONTIGUOUS:
            parts.append(f"q-layout={self.query_layout.value}")
        if self.key_layout is not InputLayout.CONTIGUOUS:
            parts.append(f"k-layout={self.key_layout.value}")
        if self.weight_layout is not WeightLayout.CONTIGUOUS:
            parts.append(f"w-layout={self.weight_layout.value}")
        return " ".join(parts)


# ---- Its inputs ----------------------------------------------------------------------


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


@dataclass(frozen=True)
class DualNormInputs:
    queries: mx.array
    keys: mx.array
    query_weight: Optional[mx.array]
    key_weight: Optional[mx.array]


def case_key(description: str, seed: int) -> mx.array:
    """The MLX key of a case's values: the seed and a hash of the case's
    description, so a case reproduces from its description alone."""
    description_hash = zlib.crc32(description.encode())
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
        case_key(case.describe(), seed), 4
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
