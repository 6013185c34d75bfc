"""Bit-level comparison for the reliability tests.

The reliability suite promises the composed path's BITS: same dtype, same
shape, same bit pattern everywhere, through the tests' one bit-exact
assertion (``conftest.assert_bit_identical``), with context in each failure
message. Here: the reference those checks compare with, and what the
epsilon contract adds to them.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from conftest import assert_bit_identical
from mlx_dualnorm import composed_dual_head_norm
from mlx_dualnorm._bits import count_bit_differences


def mismatched_elements(
    actual: mx.array, expected: mx.array, nan_payloads_may_differ: bool = False
) -> int:
    """How many elements differ in their bits (arrays of one dtype and
    shape); with ``nan_payloads_may_differ``, a NaN matches any NaN."""
    return count_bit_differences(
        actual, expected, nan_payloads_may_differ=nan_payloads_may_differ
    )


ON_GPU = mx.default_device() == mx.gpu

# Skips a check whose premise is MLX's CPU backend, which compiles fused
# kernels with g++ at run time (its GPU backend uses NVRTC).
CPU_BACKEND_ONLY = pytest.mark.skipif(
    ON_GPU, reason="MLX's CPU backend compiles with g++; its GPU backend with NVRTC"
)


def composed_reference(
    queries: Any, keys: Any, query_weight: Any, key_weight: Any, eps: float
) -> tuple[mx.array, mx.array]:
    """Two ``mx.fast.rms_norm`` calls, the reference of every bit check, for
    arguments that may be empty (or invalid: they raise what rms_norm
    raises). MLX 0.32.4's CUDA RMSNorm cannot launch on an empty input (a
    zero-size grid), so on the GPU an empty side is built on the GPU stream,
    which raises whatever MLX raises there (float64, say) and is never
    evaluated, then normalized on the CPU stream, as the package does; its
    output has no elements, only a shape and a dtype to match."""

    def normalized(inputs: Any, weight: Any) -> mx.array:
        if ON_GPU and isinstance(inputs, mx.array) and inputs.size == 0:
            mx.fast.rms_norm(inputs, weight, eps)
            return mx.fast.rms_norm(inputs, weight, eps, stream=mx.cpu)
        return mx.fast.rms_norm(inputs, weight, eps)

    return normalized(queries, query_weight), normalized(keys, key_weight)


def assert_normalized_with_eps(
    outputs: tuple[mx.array, mx.array],
    inputs: tuple,
    eps: float,
    other_epsilons: tuple[float, ...] = (),
    context: str = "",
) -> None:
    """``outputs`` are the composed path's bits for ``eps``, and NOT those for
    any of ``other_epsilons`` (so a call that used another object's epsilon
    cannot pass). ``inputs`` is (queries, keys, query_weight, key_weight)."""
    assert isinstance(outputs, tuple) and len(outputs) == 2, (context, outputs)
    expected = composed_dual_head_norm(*inputs, eps=eps)
    for side, actual, reference in zip(("queries", "keys"), outputs, expected):
        assert_bit_identical(actual, reference, f"{context} {side} eps={eps!r}")
    for other_eps in other_epsilons:
        if other_eps == eps:
            continue
        wrong = composed_dual_head_norm(*inputs, eps=other_eps)
        for side, actual, reference in zip(("queries", "keys"), outputs, wrong):
            assert mismatched_elements(actual, reference) > 0, (
                f"{context} {side}: the output of eps={eps!r} equals the output of "
                f"eps={other_eps!r}; these inputs cannot tell epsilons apart"
            )
