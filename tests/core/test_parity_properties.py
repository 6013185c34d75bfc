"""Property tests: CompiledDualHeadNorm equals the composed path bit for bit
over shapes, dtypes, epsilons, weightings and values the parity matrix does
not enumerate (ranks 1-4, odd widths, mixed promotions, special entries at
arbitrary positions).

One CompiledDualHeadNorm is kept per epsilon for the whole module, as a
model keeps one per layer type: every example then also checks that a
shapeless replay over a new shape, or a retrace for a new dtype or rank,
still matches. On CPU each new (epsilon, dtype, weighting, layout)
combination compiles a fused kernel with g++ (about half a second on a cold
kernel cache), which is why the epsilon choices are a short list.

Width 0 is left to its own test at the end (the value strategy needs
elements). MLX 0.32.4's shapeless compile gets widths 0 and 1 wrong (wrong
shape; a segfault in the CPU sum at rank >= 2), so the core runs those
widths through the uncompiled graph; the two tests at the end pin that.
"""

from __future__ import annotations

import functools
import math
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.bit_parity import assert_bit_identical, composed_reference
from helpers.hypothesis_profiles import scaled_examples
from mlx_dualnorm import CompiledDualHeadNorm, composed_dual_head_norm
from mlx_dualnorm.commands.parity.cases import ValueProfile, generate_head_values

FLOATING_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
SMALLEST_FLOAT32_SUBNORMAL = float(np.nextafter(np.float32(0), np.float32(1)))
EPSILON_CHOICES = (
    0.0,
    SMALLEST_FLOAT32_SUBNORMAL,  # a subnormal eps must survive the kernel's literal
    1e-30,
    1e-12,
    1e-6,
    1e-5,
    0.1,
    1e4,  # dwarfs every O(1) mean square
    1e30,  # near float32's top: mean square + eps may overflow
)
SPECIAL_ENTRY_VALUES = (
    math.nan,
    math.inf,
    -math.inf,
    0.0,
    -0.0,
    SMALLEST_FLOAT32_SUBNORMAL,
    1e-8,  # subnormal in float16
    65504.0,  # float16 max: its square overflows float16
    3.0e38,  # near float32 max: its square overflows float32
    -1.0,
)
MAX_ELEMENTS_PER_INPUT = 48_000

PROPERTY_SETTINGS = settings(
    max_examples=scaled_examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@functools.cache
def compiled_norm_for(eps: float) -> CompiledDualHeadNorm:
    """One object per epsilon for the module: reused across examples."""
    return CompiledDualHeadNorm(eps)


@dataclass(frozen=True)
class HeadNormSide:
    """How to build one of the two inputs (queries or keys)."""

    shape: tuple[int, ...]
    dtype: mx.Dtype
    weight_dtype: Optional[mx.Dtype]  # None: no weight
    value_profile: ValueProfile
    value_seed: int
    special_entries: tuple[tuple[int, float], ...]  # (flat position, value)
    reversed_last_axis: bool  # hand over a negative-stride view


def _side_strategy(
    leading_shape: Optional[tuple[int, ...]], width_minimum: int
) -> st.SearchStrategy:
    """One input: ``(width,)`` when ``leading_shape`` is None (rank 1), else
    ``(*leading_shape, heads, width)``."""

    @st.composite
    def side(draw) -> HeadNormSide:
        width = draw(st.integers(width_minimum, 300))
        if leading_shape is None:
            shape: tuple[int, ...] = (width,)
        else:
            shape = (*leading_shape, draw(st.integers(1, 32)), width)
            while math.prod(shape) > MAX_ELEMENTS_PER_INPUT and shape[-2] > 1:
                shape = (*shape[:-2], shape[-2] // 2, width)
        element_count = math.prod(shape)
        special_entries = draw(
            st.lists(
                st.tuples(st.integers(0, element_count - 1), st.sampled_from(SPECIAL_ENTRY_VALUES)),
                max_size=6,
            )
        )
        return HeadNormSide(
            shape=shape,
            dtype=draw(st.sampled_from(FLOATING_DTYPES)),
            weight_dtype=draw(st.one_of(st.none(), st.sampled_from(FLOATING_DTYPES))),
            value_profile=draw(st.sampled_from(tuple(ValueProfile))),
            value_seed=draw(st.integers(0, 2**32 - 1)),
            special_entries=tuple(special_entries),
            reversed_last_axis=draw(st.booleans()),
        )

    return side()


@st.composite
def dual_head_norm_problems(draw) -> tuple[HeadNormSide, HeadNormSide, float]:
    """Queries and keys of one rank (1-4) sharing their leading axes, with
    their own head counts, widths, dtypes and weights, and one epsilon."""
    rank = draw(st.integers(1, 4))
    eps = draw(st.sampled_from(EPSILON_CHOICES))
    if rank == 1:
        # A rank-1 input is a single row: widths 1..300 all work.
        query_side = draw(_side_strategy(None, 1))
        key_side = draw(_side_strategy(None, 1))
    else:
        leading_sizes = st.lists(st.integers(1, 3), min_size=rank - 2, max_size=rank - 2)
        leading_shape = tuple(draw(leading_sizes))
        query_side = draw(_side_strategy(leading_shape, 1))
        key_side = draw(_side_strategy(leading_shape, 1))
    return query_side, key_side, eps


def build_side(side: HeadNormSide, eps: float) -> tuple[mx.array, Optional[mx.array]]:
    values = generate_head_values(
        side.shape, side.dtype, side.value_profile, eps, mx.random.key(side.value_seed)
    )
    if side.special_entries:
        flat = values.reshape(-1)
        positions = mx.array([position for position, _ in side.special_entries])
        flat[positions] = mx.array([value for _, value in side.special_entries]).astype(side.dtype)
        values = flat.reshape(side.shape)
    if side.reversed_last_axis:
        buffer = mx.contiguous(values[..., ::-1])
        mx.eval(buffer)
        values = buffer[..., ::-1]
    weight = None
    if side.weight_dtype is not None:
        weight_key = mx.random.key(side.value_seed ^ 0x5EED)
        weight = mx.random.uniform(-2.0, 2.0, (side.shape[-1],), key=weight_key)
        weight = weight.astype(side.weight_dtype)
        mx.eval(weight)
    mx.eval(values)
    return values, weight


def assert_compiled_matches_composed(
    norm: CompiledDualHeadNorm,
    queries: mx.array,
    keys: mx.array,
    query_weight: Optional[mx.array],
    key_weight: Optional[mx.array],
    eps: float,
) -> None:
    normalized_queries, normalized_keys = norm(queries, keys, query_weight, key_weight)
    expected_queries, expected_keys = composed_dual_head_norm(
        queries, keys, query_weight, key_weight, eps
    )
    assert_bit_identical(normalized_queries, expected_queries)
    assert_bit_identical(normalized_keys, expected_keys)


@PROPERTY_SETTINGS
@given(problem=dual_head_norm_problems())
def test_compiled_dual_head_norm_equals_two_rms_norms(problem) -> None:
    query_side, key_side, eps = problem
    queries, query_weight = build_side(query_side, eps)
    keys, key_weight = build_side(key_side, eps)

    assert_compiled_matches_composed(
        compiled_norm_for(eps), queries, keys, query_weight, key_weight, eps
    )


@settings(max_examples=scaled_examples(25), deadline=None)
@given(
    rank=st.integers(2, 4),
    dtype=st.sampled_from(FLOATING_DTYPES),
    weighted=st.booleans(),
    shapes=st.lists(
        st.tuples(st.integers(1, 4), st.integers(1, 24), st.integers(2, 300)),
        min_size=2,
        max_size=5,
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_one_norm_replays_over_changing_shapes(rank, dtype, weighted, shapes, seed) -> None:
    """Same rank and dtype, new shapes: the shapeless graph replays without
    a retrace, and every replay still matches (a decode/prefill mix)."""
    norm = compiled_norm_for(1e-6)
    for call_index, (leading, heads, width) in enumerate(shapes):
        shape = ((leading,) * (rank - 2) + (heads, width))
        key = mx.random.key(seed + call_index)
        queries = generate_head_values(shape, dtype, ValueProfile.VARIED_ROWS, 1e-6, key)
        keys = generate_head_values(
            shape[:-2] + (1, width), dtype, ValueProfile.ZERO_ROWS, 1e-6, key
        )
        weight = mx.linspace(-1.5, 1.5, width).astype(dtype) if weighted else None
        assert_compiled_matches_composed(norm, queries, keys, weight, weight, 1e-6)


@settings(max_examples=scaled_examples(20), deadline=None)
@given(
    first_eps=st.sampled_from(EPSILON_CHOICES),
    second_eps=st.sampled_from(EPSILON_CHOICES),
    dtype=st.sampled_from(FLOATING_DTYPES),
    width=st.integers(2, 300),
    seed=st.integers(0, 2**32 - 1),
)
def test_interleaved_norms_keep_their_own_epsilon(
    first_eps, second_eps, dtype, width, seed
) -> None:
    """Two objects with different epsilons, called alternately on the same
    dtype and rank: each must use its own epsilon (the C core passes eps to
    its traces through a process-wide slot)."""
    larger_eps, smaller_eps = max(first_eps, second_eps), min(first_eps, second_eps)
    queries = generate_head_values(
        (3, 4, width), dtype, ValueProfile.NEAR_EPSILON, larger_eps, mx.random.key(seed)
    )
    keys = generate_head_values(
        (3, 1, width), dtype, ValueProfile.NEAR_EPSILON, smaller_eps, mx.random.key(seed + 1)
    )
    for eps in (first_eps, second_eps, first_eps, second_eps):
        assert_compiled_matches_composed(compiled_norm_for(eps), queries, keys, None, None, eps)


# ---- MLX 0.32.4 shapeless-compile defects the core routes around -------------


def test_width_one_rows_match_composed_in_a_subprocess() -> None:
    """In a child process: compiled, this input segfaults MLX 0.32.4."""
    script = textwrap.dedent(
        """
        import mlx.core as mx
        from mlx_dualnorm import CompiledDualHeadNorm, composed_dual_head_norm
        from mlx_dualnorm.bits import same_bits
        queries = mx.array([[3.0], [-2.0]])
        actual = CompiledDualHeadNorm(1e-6)(queries, queries)
        expected = composed_dual_head_norm(queries, queries, eps=1e-6)
        mx.eval(actual, expected)
        assert all(same_bits(a, e) for a, e in zip(actual, expected))
        """
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, f"child exited with {completed.returncode}"


def test_width_zero_rows_keep_their_shape() -> None:
    queries = mx.zeros((2, 0))
    actual = CompiledDualHeadNorm(1e-6)(queries, queries)
    expected = composed_reference(queries, queries, None, None, eps=1e-6)

    assert_bit_identical(actual[0], expected[0])
