"""Bit-level comparison of MLX arrays: the one rule behind every parity claim,
public for engines' own parity tests (docs/parity.md).

The package promises the composed path's BITS, not only its values: ``-0.0``
and ``0.0`` compare equal as values, and so do two NaNs of different payload,
yet a model downstream can tell them apart. So two arrays agree when they
have the same dtype, the same shape and the same bit pattern in every
element, read through an unsigned integer view of the same width.

Two looser rules exist for the places that need them, each named:

* ``nan_payloads_may_differ=True``: a NaN matches any NaN (MLX's CPU
  compiled multiply keeps one operand's NaN payload where the composed path
  keeps the other's; see docs/reliability.md). Signed zeros still count.
* :func:`count_value_differences`: ``mx.array_equal(..., equal_nan=True)``'s
  rule, NaN matching NaN and ``-0.0`` matching ``0.0``: the parity matrix's
  default contract.

Arrays with no elements are compared by dtype and shape only: MLX's GPU
reductions cannot launch on none.
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["bit_difference_mask", "count_bit_differences", "count_value_differences", "same_bits"]

_UNSIGNED_OF_WIDTH = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def bit_difference_mask(
    actual: mx.array, expected: mx.array, *, nan_payloads_may_differ: bool = False
) -> mx.array:
    """Lazily, per element: True where the bit patterns differ. Both arrays
    must have one dtype and one shape (ValueError otherwise): a dtype or
    shape difference is not an element difference."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise ValueError(
            "[bit_difference_mask] Expected arrays of one dtype and shape, got "
            f"{actual.dtype} {tuple(actual.shape)} and {expected.dtype} {tuple(expected.shape)}."
        )
    unsigned = _UNSIGNED_OF_WIDTH[actual.dtype.size]
    differ = mx.not_equal(mx.view(actual, unsigned), mx.view(expected, unsigned))
    if nan_payloads_may_differ and mx.issubdtype(actual.dtype, mx.inexact):
        differ = mx.logical_and(
            differ, mx.logical_not(mx.logical_and(mx.isnan(actual), mx.isnan(expected)))
        )
    return differ


def count_bit_differences(
    actual: mx.array, expected: mx.array, *, nan_payloads_may_differ: bool = False
) -> int:
    """How many elements differ in their bits (one dtype and shape required)."""
    if actual.size == 0:
        bit_difference_mask(actual, expected)  # still rejects a dtype or shape mismatch
        return 0
    mask = bit_difference_mask(actual, expected, nan_payloads_may_differ=nan_payloads_may_differ)
    return int(mx.sum(mask))


def same_bits(
    actual: mx.array, expected: mx.array, *, nan_payloads_may_differ: bool = False
) -> bool:
    """Same dtype, same shape and the same bits in every element."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return False
    if actual.size == 0:
        return True
    mask = bit_difference_mask(actual, expected, nan_payloads_may_differ=nan_payloads_may_differ)
    return not bool(mx.any(mask).item())


def count_value_differences(actual: mx.array, expected: mx.array) -> int:
    """Elements whose VALUES differ, NaN matching NaN and ``-0.0`` matching
    ``0.0`` (the rule of ``mx.array_equal(..., equal_nan=True)``). Shapes
    must broadcast; dtypes may differ (values are compared after promotion)."""
    if actual.size == 0 or expected.size == 0:
        return 0
    both_nan = mx.logical_and(mx.isnan(actual), mx.isnan(expected))
    return int(mx.sum(mx.logical_not(mx.logical_or(mx.equal(actual, expected), both_nan))))
