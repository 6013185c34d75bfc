"""Exceptions raised by mlx_dualnorm.

Every failure reads as MLX's own do, ``[operation] message``, and carries
the two parts as attributes. The C composite fills them within the call
that failed; the bridge raises them before control returns to Python.
"""

from __future__ import annotations

__all__ = ["DualHeadNormValueError", "MlxCError"]


class MlxCError(RuntimeError):
    """An MLX or mlx-c failure, naming the operation that failed.

    Attributes:
        operation: the operation's label, e.g. ``"dual_head_norm"``.
        description: what went wrong; for failures inside MLX, MLX's own
            first message (the root cause).
    """

    def __init__(self, operation: str, description: str) -> None:
        super().__init__(f"[{operation}] {description}")
        self.operation = operation
        self.description = description

    def __reduce__(self):  # keeps the two fields across pickling
        return (type(self), (self.operation, self.description))


class DualHeadNormValueError(MlxCError, ValueError):
    """Bad input (or use after close): a ``ValueError``, as
    ``mx.fast.rms_norm`` raises for the same input, that is also an
    :class:`MlxCError` carrying the operation."""


# Tracebacks and pickles name them where users import them from.
MlxCError.__module__ = DualHeadNormValueError.__module__ = "mlx_dualnorm"

