"""What the norm + RoPE composite takes, converted as its C object takes
it: its constants (dims, flags, float32 arguments) and, for the bridge,
the arguments of a call that are not already what MLX passes (offsets,
arrays, the write position). Each conversion checks a type once; the
ranges are the C library's to check.
"""

from __future__ import annotations

import numbers

import mlx.core as mx
import numpy as np

from mlx_dualnorm import _composite
from mlx_dualnorm._errors import DualHeadNormValueError

# The labels of the composite's errors, ``[label] message``, as MLX's ops do
# (the C library reports the same ones); close()'s is the label + "_close".
DUAL_HEAD_NORM_ROPE_OPERATION = "dual_head_norm_rope"  # construct and call
DUAL_HEAD_NORM_ROPE_WITH_CACHE_OPERATION = "dual_head_norm_rope_with_cache"  # apply_with_cache

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _as_write_offset(value: object, from_offset: bool) -> int:
    """The write position as a Python int. Its range is checked once, where
    it becomes the C int (the bridge refuses a row no int32 holds) and
    against the buffers (the C call)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        what = "offset (the write position when write_offset is omitted)" if from_offset else (
            "write_offset"
        )
        raise TypeError(
            f"[{DUAL_HEAD_NORM_ROPE_WITH_CACHE_OPERATION}] {what} must be an int, "
            f"not {type(value).__name__}"
        )
    return int(value)


def _as_dims(dims: object) -> int:
    """dims as the C int the constructor checks (positive, even)."""
    if isinstance(dims, bool) or not isinstance(dims, numbers.Integral):
        raise TypeError(
            f"[{DUAL_HEAD_NORM_ROPE_OPERATION}] dims must be an int, not {type(dims).__name__}"
        )
    value = int(dims)
    if not _INT32_MIN <= value <= _INT32_MAX:
        raise DualHeadNormValueError(
            DUAL_HEAD_NORM_ROPE_OPERATION, f"dims must be positive and even, got {value}"
        )
    return value


def _as_flag(value: object, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"[{DUAL_HEAD_NORM_ROPE_OPERATION}] {name} must be a bool, not {type(value).__name__}"
        )
    return bool(value)


def _as_float32_argument(value: object, name: str) -> float:
    """A real number, which C rounds to float32 as MLX's binding does."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"[{DUAL_HEAD_NORM_ROPE_OPERATION}] {name} must be a real number, "
            f"not {type(value).__name__}"
        )
    try:
        return float(value)
    except OverflowError:  # an int or Fraction beyond a double
        raise DualHeadNormValueError(
            DUAL_HEAD_NORM_ROPE_OPERATION, f"{name} is beyond the range of a float"
        ) from None


def _as_offset_array(offset: object, operation: str) -> mx.array:
    """The bridge's converter for offsets that are neither an ``mx.array``
    nor an int within int32 (which the bridge makes into an int32 scalar
    itself): what ``mx.fast.rope`` makes an array of (an int beyond int32,
    a numpy integer or array, a bool or a float, whose dtype the C checks
    then refuse as rope does); anything else is a TypeError. ``operation``
    labels its errors (the bridge passes the call's)."""
    if isinstance(offset, (np.ndarray, np.generic)):
        return _composite._as_mx_array(np.asarray(offset), "offset", operation)
    if not isinstance(offset, (int, float, complex)):  # bool is an int
        raise TypeError(
            f"[{operation}] offset must be an int or an mlx.core.array "
            f"(what mx.fast.rope takes), not {type(offset).__name__}"
        )
    if isinstance(offset, (float, complex)):
        raise DualHeadNormValueError(
            operation, f"offset must be an integer, not {offset!r}"
        )
    try:
        return mx.array(offset)
    except (TypeError, ValueError, OverflowError, RuntimeError) as error:  # MLX: bad_cast
        raise DualHeadNormValueError(
            operation, f"offset {offset!r} is not an MLX array value: {error}"
        ) from None


def _as_array(value: object, argument_name: str, operation: str) -> mx.array:
    """The bridge's converter for this composite's arguments that are not
    ``mx.array``; ``freqs`` must be one already, as ``mx.fast.rope``
    requires. ``operation`` labels its errors."""
    if argument_name == "freqs":
        raise TypeError(
            f"[{operation}] freqs must be an mlx.core.array or None "
            f"(what mx.fast.rope takes), not {type(value).__name__}"
        )
    return _composite._as_mx_array(value, argument_name, operation)
