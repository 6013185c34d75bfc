"""Exceptions raised by mlx_dualnorm, and the one place that reads the C
side's thread-local error record and turns it into one."""

from __future__ import annotations

from typing import NoReturn

from mlx_dualnorm._binding import ffi, lib

__all__ = ["DualHeadNormValueError", "MlxCError", "raise_last_error"]


class MlxCError(RuntimeError):
    """An MLX or mlx-c failure, naming the operation that failed.

    Attributes:
        operation: what was being done, e.g. ``"apply the compiled MLX dual
            head norm"``.
        description: what went wrong; for failures inside MLX, MLX's own
            first message (the root cause).
    """

    def __init__(self, operation: str, description: str) -> None:
        super().__init__(f"{operation}: {description}")
        self.operation = operation
        self.description = description

    def __reduce__(self):  # keeps the two fields across pickling
        return (type(self), (self.operation, self.description))


class DualHeadNormValueError(MlxCError, ValueError):
    """Bad input (or use after close): a ``ValueError``, as
    ``mx.fast.rms_norm`` raises for the same input, that is also an
    :class:`MlxCError` carrying the operation."""


_VALUE_ERROR_STATUSES = frozenset(
    {lib.MLX_DUALNORM_INVALID_ARGUMENT, lib.MLX_DUALNORM_CLOSED}
)


def raise_last_error() -> NoReturn:
    """Raises the calling thread's last C failure (the record is
    thread-local, so this must run on the thread whose call failed)."""
    status = lib.mlx_dualnorm_last_error_status()
    operation = ffi.string(lib.mlx_dualnorm_last_error_operation()).decode()
    description = ffi.string(lib.mlx_dualnorm_last_error_description()).decode(
        errors="replace"
    )
    if status in _VALUE_ERROR_STATUSES:
        raise DualHeadNormValueError(operation, description)
    raise MlxCError(operation, description)
