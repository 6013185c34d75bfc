"""The compiled dual head norm and the composed path it replaces.

``CompiledDualHeadNorm(eps)(queries, keys, query_weight, key_weight)``
returns the same two arrays, bit for bit, as::

    (mx.fast.rms_norm(queries, query_weight, eps),
     mx.fast.rms_norm(keys, key_weight, eps))

from one replay of a shapeless compiled MLX graph: one crossing into C per
call, lazy outputs, no copies of the inputs.
"""

from __future__ import annotations

import numbers
from typing import Any, Literal, Optional, Union

import mlx.core as mx
import numpy as np

from mlx_dualnorm._binding import apply_compiled_dual_head_norm, ffi, lib
from mlx_dualnorm._errors import MlxCError, raise_last_error

__all__ = ["CompiledDualHeadNorm", "available_modes", "composed_dual_head_norm"]

APPLY_DUAL_HEAD_NORM_OPERATION = "apply the compiled MLX dual head norm"
COMPILE_DUAL_HEAD_NORM_OPERATION = "compile the shapeless MLX dual head norm graph"

ArrayLike = Union[mx.array, np.ndarray]
Mode = Literal["auto", "composed", "compiled", "fused"]

_MODES: dict[str, int] = {
    "auto": lib.MLX_DUALNORM_MODE_AUTO,
    "composed": lib.MLX_DUALNORM_MODE_COMPOSED,
    "compiled": lib.MLX_DUALNORM_MODE_COMPILED,
    "fused": lib.MLX_DUALNORM_MODE_FUSED,
}
_MODE_NAMES = {value: name for name, value in _MODES.items()}


def available_modes() -> tuple[str, ...]:
    """The modes that can run here: ``"fused"`` needs MLX's CUDA backend."""
    modes = ("composed", "compiled")
    return modes + ("fused",) if lib.mlx_dualnorm_fused_backend_available() else modes
StreamLike = Union[mx.Stream, mx.Device, None]


def composed_dual_head_norm(
    queries: mx.array,
    keys: mx.array,
    query_weight: Optional[mx.array] = None,
    key_weight: Optional[mx.array] = None,
    eps: float = 1e-6,
    *,
    stream: StreamLike = None,
) -> tuple[mx.array, mx.array]:
    """The reference path: two ``mx.fast.rms_norm`` calls."""
    return (
        mx.fast.rms_norm(queries, query_weight, eps, stream=stream),
        mx.fast.rms_norm(keys, key_weight, eps, stream=stream),
    )


class CompiledDualHeadNorm:
    """Query/key head RMS normalization as one compiled dual-output graph.

    Args:
        eps: the RMS epsilon, baked into the compiled graph. Must be finite
            and >= 0 (it is used as float32, as ``mx.fast.rms_norm`` does).
        mode: ``"compiled"``: one replay of the compiled dual-output graph
            (calls with more than 48 rows in all build the composed graph,
            which MLX runs faster at that size).
            ``"fused"``: one CUDA kernel launch for both inputs (MLX's CUDA
            backend only; inputs it does not cover, e.g. mixed dtypes, take
            the compiled graph). ``"composed"``: the two calls, rebuilt each
            time (the reference). ``"auto"`` (default): fused where MLX has
            a CUDA GPU, else compiled. Every mode gives the same bits;
            :attr:`mode` says which one was chosen.

    Call it like two ``mx.fast.rms_norm`` calls sharing ``eps``; the weights
    are optional and independent (mlx-lm's gated-delta layers pass none).
    Inputs may have any rank >= 1, any head counts, and different dtypes
    for queries and keys; the graph is shapeless, so new batch or sequence
    sizes reuse it, while a new dtype or rank traces it once more.

    Thread-safe. ``close()`` (or leaving a ``with`` block) releases the
    compiled graphs at once; garbage collection does it otherwise.
    """

    __slots__ = ("_native", "_address", "__weakref__")
    _native: Any  # cdata: mlx_dualnorm_compiled_dual_head_norm*, freed by ffi.gc
    _address: int  # the same pointer, as the bridge takes it

    def __init__(self, eps: float = 1e-6, mode: Mode = "auto") -> None:
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
            raise TypeError(
                f"{COMPILE_DUAL_HEAD_NORM_OPERATION}: eps must be a real number, "
                f"not {type(eps).__name__}"
            )
        if mode not in _MODES:
            raise ValueError(
                f"{COMPILE_DUAL_HEAD_NORM_OPERATION}: mode must be one of "
                f"{', '.join(map(repr, _MODES))}, not {mode!r}"
            )
        try:
            eps_value = float(eps)
        except OverflowError:  # an int or Fraction beyond a double
            raise ValueError(
                f"{COMPILE_DUAL_HEAD_NORM_OPERATION}: the RMS epsilon must be finite "
                f"and >= 0, got {eps!r:.40}"
            ) from None
        created = ffi.new("mlx_dualnorm_compiled_dual_head_norm **")
        if lib.mlx_dualnorm_compiled_dual_head_norm_new(created, eps_value, _MODES[mode]) != 0:
            raise_last_error()
        # Owned by this object: freed (closing first) when it is collected.
        self._native = ffi.gc(created[0], lib.mlx_dualnorm_compiled_dual_head_norm_free)
        self._address = int(ffi.cast("uintptr_t", self._native))

    @property
    def eps(self) -> float:
        """The epsilon baked into the graphs, as the float32 MLX uses."""
        return float(lib.mlx_dualnorm_compiled_dual_head_norm_epsilon(self._native))

    @property
    def mode(self) -> str:
        """The mode chosen at construction: "composed", "compiled" or "fused"."""
        return _MODE_NAMES[lib.mlx_dualnorm_compiled_dual_head_norm_mode(self._native)]

    def __call__(
        self,
        queries: ArrayLike,
        keys: ArrayLike,
        query_weight: Optional[ArrayLike] = None,
        key_weight: Optional[ArrayLike] = None,
        *,
        stream: StreamLike = None,
    ) -> tuple[mx.array, mx.array]:
        """Normalizes queries and keys over their last axis.

        Args:
            queries: ``(..., D_q)`` array.
            keys: ``(..., D_k)`` array.
            query_weight: optional ``(D_q,)`` scale.
            key_weight: optional ``(D_k,)`` scale.
            stream: stream or device to run on; the default stream if None.

        Returns:
            ``(normalized_queries, normalized_keys)``, lazy, with the dtypes
            ``mx.fast.rms_norm`` gives.

        Raises:
            TypeError: an argument is not an ``mx.array`` / ``numpy.ndarray``.
            DualHeadNormValueError: (a ``ValueError``) an input
                ``mx.fast.rms_norm`` rejects, or this object is closed.
            MlxCError: MLX failed while building the graph.
        """
        if stream is not None:
            if not isinstance(stream, _STREAM_TYPES):
                raise TypeError(
                    f"{APPLY_DUAL_HEAD_NORM_OPERATION}: stream must be a stream or a "
                    f"device (what mx.stream takes) or None, not {type(stream).__name__}"
                )
            with mx.stream(stream):
                return self(queries, keys, query_weight, key_weight)
        try:
            graph_outputs = apply_compiled_dual_head_norm(
                self._address, queries, keys, query_weight, key_weight
            )
        except TypeError:
            graph_outputs = apply_compiled_dual_head_norm(
                self._address,
                _as_mx_array(queries, "queries"),
                _as_mx_array(keys, "keys"),
                _as_optional_mx_array(query_weight, "query_weight"),
                _as_optional_mx_array(key_weight, "key_weight"),
            )
        if graph_outputs is None:
            raise_last_error()
        # Output order is the C builder's ABI: queries first, keys second.
        if len(graph_outputs) != 2:
            raise MlxCError(
                APPLY_DUAL_HEAD_NORM_OPERATION,
                f"compiled MLX dual head norm returned {len(graph_outputs)} "
                "outputs, expected 2",
            )
        normalized_queries, normalized_keys = graph_outputs
        return normalized_queries, normalized_keys

    def close(self) -> None:
        """Releases the compiled graphs and their compile-cache entries.
        Later calls raise ``DualHeadNormValueError``; closing twice is fine."""
        if lib.mlx_dualnorm_compiled_dual_head_norm_close(self._native) != 0:
            raise_last_error()

    def __enter__(self) -> "CompiledDualHeadNorm":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CompiledDualHeadNorm(eps={self.eps!r}, mode={self.mode!r})"


# What mx.stream() takes.
_STREAM_TYPES = (mx.Stream, mx.ThreadLocalStream, mx.Device, mx.DeviceType)


def _as_mx_array(value: object, argument_name: str) -> mx.array:
    """The slow path for non-mx.array inputs: numpy arrays are copied in."""
    if isinstance(value, mx.array):
        return value
    if isinstance(value, np.ndarray):
        # MLX holds booleans, integers and floating/complex numbers only;
        # mx.array() of any other numpy dtype raises an unnamed std::bad_cast.
        if value.dtype.kind not in "biufc":
            raise TypeError(
                f"{APPLY_DUAL_HEAD_NORM_OPERATION}: {argument_name} has numpy dtype "
                f"{value.dtype}, which MLX cannot hold"
            )
        return mx.array(value)
    raise TypeError(
        f"{APPLY_DUAL_HEAD_NORM_OPERATION}: {argument_name} must be an "
        f"mlx.core.array or numpy.ndarray, not {type(value).__name__}"
    )


def _as_optional_mx_array(value: object, argument_name: str) -> Optional[mx.array]:
    return None if value is None else _as_mx_array(value, argument_name)
