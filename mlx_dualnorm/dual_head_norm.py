"""The compiled dual head norm and the composed path it replaces.

``CompiledDualHeadNorm(eps)(queries, keys, query_weight, key_weight)``
returns the same two arrays, bit for bit, as::

    (mx.fast.rms_norm(queries, query_weight, eps),
     mx.fast.rms_norm(keys, key_weight, eps))

from one replay of a compiled MLX graph: one crossing into C per call, lazy
outputs, no copies of the inputs.
"""

from __future__ import annotations

import math
import numbers
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Literal, Optional, TypeVar, Union

import mlx.core as mx
import numpy as np

from mlx_dualnorm._binding import (
    apply_compiled_dual_head_norm,
    bind_bridge,
    call_native,
    ffi,
    lib,
)
from mlx_dualnorm._errors import DualHeadNormValueError, MlxCError

__all__ = ["CompiledDualHeadNorm", "available_modes", "composed_dual_head_norm"]

APPLY_DUAL_HEAD_NORM_OPERATION = "apply the compiled MLX dual head norm"
COMPILE_DUAL_HEAD_NORM_OPERATION = "compile the MLX dual head norm graph"
COMPOSED_DUAL_HEAD_NORM_OPERATION = "composed dual head norm"

ArrayLike = Union[mx.array, np.ndarray]
Mode = Literal["auto", "composed", "compiled", "fused"]
StreamLike = Union[mx.Stream, mx.Device, None]

_MODES: dict[str, int] = {
    "auto": lib.MLX_DUALNORM_MODE_AUTO,
    "composed": lib.MLX_DUALNORM_MODE_COMPOSED,
    "compiled": lib.MLX_DUALNORM_MODE_COMPILED,
    "fused": lib.MLX_DUALNORM_MODE_FUSED,
}
_MODE_NAMES = {value: name for name, value in _MODES.items()}


def available_modes() -> tuple[str, ...]:
    """The modes that can run here: ``"fused"`` needs a build with the fused
    mode and MLX's CUDA backend with a GPU."""
    modes = ("composed", "compiled")
    return modes + ("fused",) if lib.mlx_dualnorm_fused_mode_available() else modes


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
    rms_norm_epsilon = _as_epsilon(eps, COMPOSED_DUAL_HEAD_NORM_OPERATION)
    return (
        mx.fast.rms_norm(queries, query_weight, rms_norm_epsilon, stream=stream),
        mx.fast.rms_norm(keys, key_weight, rms_norm_epsilon, stream=stream),
    )


_Composite = TypeVar("_Composite", bound="_NativeComposite")

# An object made by __new__ whose __init__ has not run: no C object, and
# an address the facades refuse before crossing into C.
_NO_NATIVE: tuple[Any, int] = (None, 0)


class _NativeComposite:
    """What both composites are in Python: the C object each owns (freed,
    closing first, when the Python object is collected), its address as
    the nanobind bridge takes it, and closing it at once.

    Both live in one tuple, ``_handle``, that a call reads once into a
    local: the call then holds the C object alive until it returns, even
    if another thread drops or replaces ``_handle`` meanwhile (converting
    a numpy argument runs Python, so other threads do run mid-call).
    Re-running ``__init__`` on an initialized object is refused, so the
    constants an object was made with never change under its callers.
    """

    __slots__ = ("_handle", "_constructor_arguments", "__weakref__")
    _handle: tuple[Any, int]  # (cdata freed by ffi.gc, the same pointer as an int)
    # (args, kwargs) that make an equal, independent object: copies and pickles.
    _constructor_arguments: tuple[tuple[Any, ...], dict[str, Any]]
    _close_native: Callable[..., int]  # the subclass's C close function
    _operation: str  # the label of this class's errors

    def __new__(cls, *arguments: Any, **options: Any):
        composite = super().__new__(cls)
        composite._handle = _NO_NATIVE
        return composite

    def _refuse_reinitialization(self) -> None:
        if self._handle is not _NO_NATIVE:
            raise TypeError(
                f"[{self._operation}] this {type(self).__name__} is already initialized; "
                "create a new object for other constants"
            )

    def _own(self, native: Any, free: Callable[[Any], None], arguments, options) -> None:
        """Takes ownership of a C object that ``free`` releases."""
        self._refuse_reinitialization()  # again: __init__ ran Python since the first check
        owned = ffi.gc(native, free)
        self._constructor_arguments = (arguments, options)
        self._handle = (owned, int(ffi.cast("uintptr_t", owned)))

    @property
    def _native(self) -> Any:
        """The C object, or a TypeError for an object never initialized."""
        native = self._handle[0]
        if native is None:
            raise self._uninitialized_error()
        return native

    def _uninitialized_error(self) -> TypeError:
        return TypeError(
            f"[{self._operation}] this {type(self).__name__} was never initialized "
            "(made by __new__ without __init__)"
        )

    def close(self) -> None:
        """Releases the compiled graphs and their compile-cache entries.
        Later calls raise ``DualHeadNormValueError``; closing twice is fine."""
        call_native(self._close_native, self._native)

    def __enter__(self: _Composite) -> _Composite:
        self._native  # refuses an object never initialized
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __reduce__(self):
        """Copies (``copy.copy``, ``copy.deepcopy``) and pickles are new,
        independent objects with the same constructor arguments: the C
        state itself is never shared or serialized."""
        self._native  # refuses an object never initialized
        arguments, options = self._constructor_arguments
        return (_rebuild_composite, (type(self), arguments, options))


def _rebuild_composite(cls, arguments: tuple, options: dict):
    """Unpickles or copies a composite: a fresh object from its arguments."""
    return cls(*arguments, **options)


def _mode_value(mode: object, operation: str) -> int:
    """The C enum value of a mode name, checked."""
    if not isinstance(mode, str):
        raise TypeError(f"[{operation}] mode must be a str, not {type(mode).__name__}")
    if mode not in _MODES:
        raise DualHeadNormValueError(
            operation, f"mode must be one of {', '.join(map(repr, _MODES))}, not {mode!r}"
        )
    return _MODES[mode]


class CompiledDualHeadNorm(_NativeComposite):
    """Query/key head RMS normalization as one compiled dual-output graph.

    Args:
        eps: the RMS epsilon, baked into the compiled graph. Must be finite,
            >= 0 and within float32's range, checked as given; it is then
            used as float32, as ``mx.fast.rms_norm`` does.
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
    for queries and keys. The graph is traced once per input shape and
    dtype (a trace specialized to the shape runs faster than a shapeless
    one), so the first call at a new decode batch size traces it; calls
    over 48 rows, such as prefills, never trace.

    Thread-safe. ``close()`` (or leaving a ``with`` block) releases the
    compiled graphs at once; garbage collection does it otherwise.
    """

    __slots__ = ()  # _handle[0]: mlx_dualnorm_compiled_dual_head_norm*
    _close_native = lib.mlx_dualnorm_compiled_dual_head_norm_close
    _operation = COMPILE_DUAL_HEAD_NORM_OPERATION

    def __init__(self, eps: float = 1e-6, mode: Mode = "auto") -> None:
        self._refuse_reinitialization()
        rms_norm_epsilon = _as_epsilon(eps, COMPILE_DUAL_HEAD_NORM_OPERATION)
        mode_value = _mode_value(mode, COMPILE_DUAL_HEAD_NORM_OPERATION)
        created = ffi.new("mlx_dualnorm_compiled_dual_head_norm **")
        call_native(
            lib.mlx_dualnorm_compiled_dual_head_norm_new, created, rms_norm_epsilon, mode_value
        )
        self._own(
            created[0], lib.mlx_dualnorm_compiled_dual_head_norm_free, (eps,), {"mode": mode}
        )

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
            with _default_stream(stream):
                return self(queries, keys, query_weight, key_weight)
        # The local keeps the C object alive for the whole call.
        native, address = self._handle
        if not address:
            raise self._uninitialized_error()
        graph_outputs = apply_compiled_dual_head_norm(
            address, queries, keys, query_weight, key_weight
        )
        # The C builders' fixed order, queries then keys: the tuple as is.
        if len(graph_outputs) != 2:
            raise _output_count_error(graph_outputs, APPLY_DUAL_HEAD_NORM_OPERATION)
        return graph_outputs

    def __repr__(self) -> str:
        if self._handle is _NO_NATIVE:
            return "CompiledDualHeadNorm(<uninitialized>)"
        return f"CompiledDualHeadNorm(eps={self.eps!r}, mode={self.mode!r})"


def _output_count_error(graph_outputs: tuple[mx.array, ...], operation: str) -> MlxCError:
    """What a call raises when the graph did not give exactly two outputs:
    the C builders publish queries first, keys second, nothing else. The
    facades check the count inline and return the bridge's tuple as is (one
    Python call less per call)."""
    return MlxCError(
        operation, f"the compiled graph returned {len(graph_outputs)} outputs, expected 2"
    )


# What mx.stream() takes.
_STREAM_TYPES = (mx.Stream, mx.ThreadLocalStream, mx.Device, mx.DeviceType)


@contextmanager
def _default_stream(
    stream: object, operation: str = APPLY_DUAL_HEAD_NORM_OPERATION
) -> Iterator[None]:
    """``mx.stream(stream)``, with a stream or device MLX cannot use here
    (``mx.gpu`` on a CPU-only MLX) reported as bad input of this call."""
    if not isinstance(stream, _STREAM_TYPES):
        raise TypeError(
            f"[{operation}] stream must be a stream or a device "
            f"(what mx.stream takes) or None, not {type(stream).__name__}"
        )
    try:
        scope = mx.stream(stream)
        scope.__enter__()
    except (ValueError, RuntimeError) as error:
        raise DualHeadNormValueError(
            operation, f"stream {stream} cannot be used here: {error}"
        ) from None
    try:
        yield
    finally:
        scope.__exit__(None, None, None)


def _as_epsilon(eps: object, operation: str) -> float:
    """eps as the double the C API checks (finite, >= 0, within float32's
    range, before rounding); a number beyond a double becomes inf, which
    that check rejects."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"[{operation}] eps must be a real number, not {type(eps).__name__}")
    try:
        return float(eps)
    except OverflowError:  # an int or Fraction beyond a double
        # Either sign is refused alike; the sign only keeps the message true.
        negative = str(eps).lstrip().startswith("-")
        return -math.inf if negative else math.inf


def _as_mx_array(
    value: object, argument_name: str, operation: str = APPLY_DUAL_HEAD_NORM_OPERATION
) -> mx.array:
    """The bridge's converter for arguments that are not ``mx.array``:
    numpy arrays are copied in (as ``mx.array(...)`` does), in native byte
    order; anything else is a TypeError."""
    if not isinstance(value, np.ndarray):
        raise TypeError(
            f"[{operation}] {argument_name} must be an "
            f"mlx.core.array or numpy.ndarray, not {type(value).__name__}"
        )
    dtype = value.dtype
    # MLX holds booleans, integers and floating/complex numbers of at most
    # 8 bytes (16 for complex); anything else would end in std::bad_cast.
    widest = 16 if dtype.kind == "c" else 8
    if dtype.kind not in "biufc" or dtype.itemsize > widest:
        raise TypeError(
            f"[{operation}] {argument_name} has numpy dtype {dtype}, which MLX cannot hold"
        )
    if not dtype.isnative:
        value = value.astype(dtype.newbyteorder("="))
    return mx.array(value)


bind_bridge(_as_mx_array)
