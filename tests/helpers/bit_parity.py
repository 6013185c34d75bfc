"""Bit-level comparison for the reliability tests.

The reliability suite promises the composed path's BITS: same dtype, same
shape, same bit pattern everywhere, through the tests' one bit-exact
assertion (:func:`assert_bit_identical`), with context in each failure
message. Here: that assertion, the reference those checks compare with,
what the epsilon contract adds to them, and the graphs and transforms
the facades' tests compare.
"""

from __future__ import annotations

import io
import re
from typing import Any

import mlx.core as mx
import pytest

from mlx_dualnorm import composed_dual_head_norm
from mlx_dualnorm.bits import count_bit_differences


def assert_bit_identical(
    actual: mx.array,
    expected: mx.array,
    context: str = "",
    nan_payloads_may_differ: bool = False,
) -> None:
    """Same dtype, same shape, same bits in every element (signed zeros and
    NaN payloads included): the package's one comparison rule, the one
    bit-exact assertion of the tests. ``context`` opens each failure
    message; ``nan_payloads_may_differ`` lets a NaN match any NaN (see
    docs/reliability.md on NaN payloads)."""
    where = (context,) if context else ()
    assert actual.dtype == expected.dtype, (*where, actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (*where, actual.shape, expected.shape)
    differing = count_bit_differences(
        actual, expected, nan_payloads_may_differ=nan_payloads_may_differ
    )
    prefix = f"{context}: " if context else ""
    assert differing == 0, f"{prefix}{differing} of {actual.size} elements differ in bits"


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


def assert_transforms_agree(transform: str, actual, expected, primals, vmap_arguments) -> None:
    """``actual`` and ``expected``, functions of (queries, keys,
    query_weight, key_weight) returning a list of arrays, give the same bits
    under ``transform``: "vjp" and "jvp" at ``primals`` with the same seeded
    cotangents or tangents, "vmap" over ``vmap_arguments`` (queries and
    keys batched on axis 0, the weights shared), or "compile": a user's
    ``mx.compile`` of the function, called at ``primals``."""

    def transformed(function):
        if transform == "vjp":
            cotangents = [
                mx.random.normal(output.shape, key=mx.random.key(20 + index))
                for index, output in enumerate(expected(*primals))
            ]
            return mx.vjp(function, primals, cotangents)[1]
        if transform == "jvp":
            tangents = [
                mx.random.normal(primal.shape, key=mx.random.key(30 + index))
                for index, primal in enumerate(primals)
            ]
            return mx.jvp(function, primals, tangents)[1]
        if transform == "compile":
            return mx.compile(function)(*primals)
        return mx.vmap(function, in_axes=(0, 0, None, None))(*vmap_arguments)

    expected_outputs = transformed(expected)
    actual_outputs = transformed(actual)
    assert len(actual_outputs) == len(expected_outputs)
    for a, e in zip(actual_outputs, expected_outputs):
        assert_bit_identical(a, e)


def graph_primitives(*outputs: mx.array) -> list[str]:
    """The primitive names of the graph behind `outputs`, sorted."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return sorted(re.findall(r'label ="([^"]+)", shape=rectangle', dot.getvalue()))
