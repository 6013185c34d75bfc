"""Which cases a parity run checks. The dual head norm's designed matrix (``FAMILY_NAMES``):
each family fixes the axes it is about and rotates the rest in seed-shuffled orders, since the
product of all axes is millions of cases. Then the norm + RoPE's: ``CompiledDualHeadNormRope``
against ``composed_dual_head_norm_rope`` over a small matrix of its own (it takes RoPE's
parameters and an offset), one path ``rope_MODE`` per mode but the reference."""

from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence, TypeVar, Union, cast

import mlx.core as mx

from mlx_dualnorm import CompiledDualHeadNormRope, Mode, composed_dual_head_norm_rope
from mlx_dualnorm.commands.parity.cases import (
    BASE_DTYPE_CONFIGURATIONS, BATCH_SIZES, DECODE_SEQUENCE_LENGTH, DEFAULT_PARITY_SEED,
    DTYPE_CONFIGURATIONS, EPSILONS, HEAD_COUNTS, MIXED_DTYPE_CONFIGURATIONS,
    NON_CONTIGUOUS_INPUT_LAYOUTS, NON_CONTIGUOUS_WEIGHT_LAYOUTS, PREFILL_SEQUENCE_LENGTH,
    PRODUCTION_RMS_NORM_EPSILON, PROMOTING_DTYPE_CONFIGURATIONS, SEQUENCE_LENGTHS,
    SPECIAL_VALUE_PROFILES, WEIGHTED_WEIGHTINGS, WIDTHS, DtypeConfiguration, DualNormInputs,
    HeadCounts, Outputs, ParityCase, PathCalls, ValueProfile, Weighting, case_key,
)
from mlx_dualnorm.commands.shared.paths import ROPE_BASE, unavailable_modes

FULL_MATRIX_ELEMENT_BUDGET = 1 << 22
"""Most elements one query input may hold (4 Mi): a prefill of 8 x 512 x 32 heads x 8192
would take seconds per case on CPU to generate and normalize."""
QUICK_MATRIX_ELEMENT_BUDGET = 1 << 17

# ---- The dual head norm's matrix --------------------------------------------------------

_Pick = Callable[[str, Sequence], Any]  # (axis name, its values) -> the value picked
_At = Callable[[str, int], _Pick]  # (family, position) -> its picker there


def _rotation(seed: int) -> _At:
    """``at(family, position)``: the picker of a family's axes at a position. Each axis cycles
    through its values in a seed-shuffled order, so every value appears once per cycle whatever
    the seed, and different seeds pair the axes differently."""
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
    """Every weighting in turn, except for dtype configurations that promote: they promote only
    through a weight, so they take the weighted ones."""
    if dtypes in PROMOTING_DTYPE_CONFIGURATIONS:
        return pick("weighting-promoting", WEIGHTED_WEIGHTINGS)
    return pick("weighting", tuple(Weighting))


_CaseOfFamily = Callable[..., ParityCase]  # ParityCase with the family filled in


def _width_by_dtype_family(at: _At, case: _CaseOfFamily) -> list[ParityCase]:
    return [
        case(width=width, dtypes=dtypes, heads=pick("heads", HEAD_COUNTS),
             batch_size=pick("batch", BATCH_SIZES), sequence_length=pick("seq", SEQUENCE_LENGTHS),
             weighting=weighting)
        for position, (width, dtypes) in enumerate(itertools.product(WIDTHS, DTYPE_CONFIGURATIONS))
        for pick in [at("width", position)]
        for weighting in [_weighting(pick, dtypes)]  # drawn before the other axes
    ]


def _head_counts_family(at: _At, case: _CaseOfFamily) -> list[ParityCase]:
    """Gated-delta shape (weightless, width 128) and full-attention shape (weighted, width
    256), at decode and at prefill, in bfloat16."""
    model_shapes = ((128, Weighting.WEIGHTLESS), (256, Weighting.WEIGHTED))
    return [
        case(width=width, dtypes=BASE_DTYPE_CONFIGURATIONS[2], heads=heads,
             batch_size=at("heads", position)("batch", BATCH_SIZES),
             sequence_length=sequence_length, weighting=weighting)
        for position, (heads, sequence_length, (width, weighting)) in enumerate(
            itertools.product(HEAD_COUNTS, SEQUENCE_LENGTHS, model_shapes))
    ]


def _batch_and_sequence_family(at: _At, case: _CaseOfFamily) -> list[ParityCase]:
    """Batch 1..8 at decode (width 128) and prefill (width 64, to fit)."""
    return [
        case(width=width, dtypes=dtypes, heads=HeadCounts(16, 16), batch_size=batch_size,
             sequence_length=sequence_length, weighting=Weighting.WEIGHTLESS)
        for position, batch_size in enumerate(BATCH_SIZES)
        for dtypes in [at("batch", position)("dtypes", BASE_DTYPE_CONFIGURATIONS)]
        for sequence_length, width in ((DECODE_SEQUENCE_LENGTH, 128), (PREFILL_SEQUENCE_LENGTH, 64))
    ]


def _epsilon_family(at: _At, case: _CaseOfFamily) -> list[ParityCase]:
    """Near-epsilon, zero and subnormal rows: the only rows where an epsilon off by one ulp
    changes any output bit."""
    return [
        case(width=pick("width", (128, 256)), heads=pick("heads", HEAD_COUNTS), dtypes=dtypes,
             batch_size=1, sequence_length=4, eps=eps, weighting=weighting,
             value_profile=ValueProfile.NEAR_EPSILON)
        for position, (eps, dtypes, weighting) in enumerate(itertools.product(
            EPSILONS, BASE_DTYPE_CONFIGURATIONS, (Weighting.WEIGHTLESS, Weighting.WEIGHTED)))
        for pick in [at("eps", position)]
    ]


def _non_contiguous_family(at: _At, case: _CaseOfFamily) -> list[ParityCase]:
    """Each layout for queries (and, shifted by one, for keys). Weight views rotate over the
    weighted cases only, so each appears whatever the seed. Width-sliced weightless inputs are
    the production gated-delta case."""
    layouts = NON_CONTIGUOUS_INPUT_LAYOUTS
    layout_pairs = zip(layouts, layouts[1:] + layouts[:1])
    weighted_cases = itertools.count()
    cases = []
    for position, ((query_layout, key_layout), dtypes) in enumerate(
            itertools.product(layout_pairs, BASE_DTYPE_CONFIGURATIONS)):
        pick = at("views", position)
        weighting = pick("weighting", tuple(Weighting))
        weight_layout = "contiguous"
        if weighting is not Weighting.WEIGHTLESS:
            pick_weight_layout = at("views", next(weighted_cases))
            weight_layout = pick_weight_layout("weight-layout", NON_CONTIGUOUS_WEIGHT_LAYOUTS)
        cases.append(case(
            width=pick("width", (64, 128, 200, 256)), dtypes=dtypes,
            heads=pick("heads", HEAD_COUNTS), batch_size=pick("batch", (1, 2, 3)),
            sequence_length=pick("seq", (1, 7)), weighting=weighting, query_layout=query_layout,
            key_layout=key_layout, weight_layout=weight_layout,
        ))
    return cases


def _special_values_family(at: _At, case: _CaseOfFamily) -> list[ParityCase]:
    return [
        case(width=pick("width", WIDTHS), dtypes=dtypes, heads=pick("heads", HEAD_COUNTS),
             batch_size=pick("batch", (1, 2)), sequence_length=pick("seq", (1, 5)),
             weighting=_weighting(pick, dtypes), value_profile=value_profile)
        for position, (value_profile, dtypes) in enumerate(
            itertools.product(SPECIAL_VALUE_PROFILES, DTYPE_CONFIGURATIONS))
        for pick in [at("special", position)]
    ]


def _mixed_dtypes_family(at: _At, case: _CaseOfFamily) -> list[ParityCase]:
    """Queries and keys of different dtypes (each traced separately), and half-precision inputs
    with a weight of the other half type."""
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
    """Halves the batch, then the sequence, until the query input fits, so a wide prefill stays
    a (shorter) prefill; the case description then names what actually runs."""
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
"""A few cases per family, chosen so each deliberate perturbation the tests try (epsilon off by
an ulp, outputs swapped, weight applied before rounding, NaN flushed, dtype changed) shows up."""


def build_quick_parity_matrix(seed: int = DEFAULT_PARITY_SEED) -> list[ParityCase]:
    """About 50 cases picked from the full matrix and shrunk to at most 128 Ki query elements: a
    second or two on CPU once kernels are cached. A shrunk case has its own description, hence
    its own values."""
    return [
        _fit_to_element_budget(case, QUICK_MATRIX_ELEMENT_BUDGET)
        for case in build_full_parity_matrix(seed) if _IN_QUICK_MATRIX[case.family](case)
    ]


# ---- The norm + RoPE's matrix -----------------------------------------------------------

ROPE_FAMILY = "norm_rope"
ROPE_ONLY_FAMILY = "rope_only"  # the cases without norms
ROPE_REFERENCE_DESCRIPTION = ("composed_dual_head_norm_rope (rms_norm, transpose, rope per side; "
                              "no rms_norm for rope_only)")
ROPE_PATH_PREFIX = "rope_"
ROPE_PATH_DESCRIPTIONS = {
    "rope_compiled": "mlx_dualnorm.CompiledDualHeadNormRope(mode='compiled'): "
    "one compiled graph for the norms, transposes and RoPE",
    "rope_fused": "mlx_dualnorm.CompiledDualHeadNormRope(mode='fused'): one kernel (CUDA)",
}

OffsetSpec = Union[int, tuple[int, ...]]  # an int, or one per batch entry (an int32 array)


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
    """Every shape (of the models that call it) with every dtype, the offset, weighting and RoPE
    variant rotating across them, then the shape without norms (``rope_only``); ``quick`` keeps
    one dtype per shape."""
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


Case = TypeVar("Case", ParityCase, RopeParityCase)


def of_families(cases: Sequence[Case], families: Optional[Sequence[str]]) -> list[Case]:
    """The cases of ``families``; every case where None (an empty list: none)."""
    return [case for case in cases if families is None or case.family in families]


def prepare_rope_case(case: RopeParityCase, seed: int) -> tuple[Outputs, PathCalls]:
    """The composed norm + RoPE's outputs on the case's inputs (from the seed and its
    description), and the call of a path (by name) on them. Each call builds its object, as a
    model builds one per attention layer."""
    query_key, key_key, query_weight_key, key_weight_key = mx.random.split(
        case_key(case.describe(), seed), 4
    )
    dtype = getattr(mx, case.dtype_name)
    query_weight, key_weight = [
        mx.random.uniform(-2.0, 2.0, (case.width,), key=key).astype(dtype)
        if case.weighted else None
        for key in (query_weight_key, key_weight_key)
    ]
    inputs = DualNormInputs(
        (4.0 * mx.random.normal(case.query_shape, key=query_key)).astype(dtype),
        (4.0 * mx.random.normal(case.key_shape, key=key_key)).astype(dtype),
        query_weight, key_weight,
    )
    mx.eval(inputs)
    offset = case.offset if isinstance(case.offset, int) else mx.array(case.offset, dtype=mx.int32)
    eps = PRODUCTION_RMS_NORM_EPSILON if case.norms else None
    expected = composed_dual_head_norm_rope(
        *inputs, eps=eps, dims=case.dims, base=ROPE_BASE, traditional=case.traditional,
        scale=case.scale, offset=offset, norms=case.norms,
    )
    return expected, lambda name: lambda: CompiledDualHeadNormRope(
        eps, case.dims, base=ROPE_BASE, traditional=case.traditional, scale=case.scale,
        mode=cast(Mode, name.removeprefix(ROPE_PATH_PREFIX)),
    )(*inputs, offset=offset)


def available_rope_paths() -> list[str]:
    """``rope_MODE`` for every mode but the reference that runs here."""
    unavailable = unavailable_rope_paths(list(ROPE_PATH_DESCRIPTIONS))
    return [name for name in ROPE_PATH_DESCRIPTIONS if name not in unavailable]


def unavailable_rope_paths(path_names: Sequence[str]) -> dict[str, str]:
    """Of the rope paths named, those this build or device cannot run, with the reason."""
    return unavailable_modes({name: name.removeprefix(ROPE_PATH_PREFIX) for name in path_names})
