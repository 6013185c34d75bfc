"""Bit-level comparison for the reliability tests.

``conftest.assert_bit_identical`` compares values (``array_equal`` with NaN
matching NaN), which cannot tell ``-0.0`` from ``0.0`` or one NaN payload
from another. The reliability suite promises the composed path's BITS, so
it compares the raw integer view of each element: same dtype, same shape,
same bit pattern everywhere.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_dualnorm import composed_dual_head_norm

# The unsigned view of each floating dtype the dual head norm can return.
BIT_VIEW_DTYPES = {
    mx.float16: mx.uint16,
    mx.bfloat16: mx.uint16,
    mx.float32: mx.uint32,
    mx.float64: mx.uint64,
}


def mismatched_elements(
    actual: mx.array, expected: mx.array, nan_payloads_may_differ: bool = False
) -> int:
    """How many elements differ in their bits (arrays of one dtype and
    shape); with ``nan_payloads_may_differ``, a NaN matches any NaN."""
    view_dtype = BIT_VIEW_DTYPES[actual.dtype]
    differ = actual.view(view_dtype) != expected.view(view_dtype)
    if nan_payloads_may_differ:
        differ = mx.logical_and(differ, mx.logical_not(mx.logical_and(mx.isnan(actual), mx.isnan(expected))))
    return int(mx.sum(differ).item())


def assert_same_bits(
    actual: mx.array, expected: mx.array, context: str = "", nan_payloads_may_differ: bool = False
) -> None:
    """Same dtype, same shape, same bits in every element (NaN payloads
    excepted only when asked: see docs/reliability.md on NaN payloads)."""
    assert actual.dtype == expected.dtype, (context, actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (context, actual.shape, expected.shape)
    mismatches = mismatched_elements(actual, expected, nan_payloads_may_differ)
    assert mismatches == 0, f"{context}: {mismatches} of {actual.size} elements differ in bits"


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
        assert_same_bits(actual, reference, f"{context} {side} eps={eps!r}")
    for other_eps in other_epsilons:
        if other_eps == eps:
            continue
        wrong = composed_dual_head_norm(*inputs, eps=other_eps)
        for side, actual, reference in zip(("queries", "keys"), outputs, wrong):
            assert mismatched_elements(actual, reference) > 0, (
                f"{context} {side}: the output of eps={eps!r} equals the output of "
                f"eps={other_eps!r}; these inputs cannot tell epsilons apart"
            )
