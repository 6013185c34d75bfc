"""What both composites share in Python: the owner of a C object, the
argument types and their checks, the modes, and the stream scope."""

from __future__ import annotations

import math
import numbers
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Literal, NamedTuple, TypeVar, Union

import mlx.core as mx
import numpy as np

from mlx_dualnorm._binding import call_native, ffi, lib
from mlx_dualnorm._errors import DualHeadNormValueError, MlxCError

ArrayLike = Union[mx.array, np.ndarray]
Mode = Literal["auto", "composed", "compiled", "fused"]
StreamLike = Union[mx.Stream, mx.Device, None]
# What mx.fast.rope takes as offset: an int, or an integer mx.array (a
# scalar, or one value per batch entry).
Offset = Union[int, mx.array]

_MODES: dict[str, int] = {
    "auto": lib.MLX_DUALNORM_MODE_AUTO,
    "composed": lib.MLX_DUALNORM_MODE_COMPOSED,
    "compiled": lib.MLX_DUALNORM_MODE_COMPILED,
    "fused": lib.MLX_DUALNORM_MODE_FUSED,
}
_MODE_NAMES = {value: name for name, value in _MODES.items()}

_Composite = TypeVar("_Composite", bound="_NativeComposite")


class _CFunctions(NamedTuple):
    """The C functions a composite calls on its C object after making it,
    named as the C header names them: ``<C type>_close`` and so on."""

    close: Callable[[Any], int]
    epsilon: Callable[[Any], float]
    mode: Callable[[Any], int]

    @classmethod
    def named(cls, c_type: str) -> _CFunctions:
        return cls(*(getattr(lib, f"{c_type}_{function}") for function in cls._fields))

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
    _c_functions: _CFunctions  # the subclass's C object's
    _operation: str  # the label of this class's errors; close()'s are "<label>_close"

    def __new__(cls, *arguments: Any, **options: Any):
        composite = super().__new__(cls)
        composite._handle = _NO_NATIVE
        return composite

    def __getattr__(self, name: str) -> Any:
        """Called only where normal lookup failed: ``_handle`` of an object
        whose class's ``__new__`` never ran (``object.__new__(cls)``, which
        leaves the slot empty) is the empty handle, so such an object is
        uninitialized like one made by ``cls.__new__(cls)``: its repr says
        so and its use is the same TypeError. Costs the calls nothing."""
        if name == "_handle":
            return _NO_NATIVE
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

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

    @property
    def mode(self) -> str:
        """The mode chosen at construction: "composed", "compiled" or "fused"."""
        return _MODE_NAMES[self._c_functions.mode(self._native)]

    def _uninitialized_error(self, operation: str = "") -> TypeError:
        return TypeError(
            f"[{operation or self._operation}] this {type(self).__name__} was never "
            "initialized (made by __new__ without __init__)"
        )

    def close(self) -> None:
        """Releases the compiled graphs and their compile-cache entries.
        Later calls raise ``DualHeadNormValueError``; closing twice is fine."""
        native = self._handle[0]
        if native is None:
            raise self._uninitialized_error(f"{self._operation}_close")
        call_native(self._c_functions.close, native)

    def __repr__(self) -> str:
        if self._handle is _NO_NATIVE:
            return f"{type(self).__name__}(<uninitialized>)"
        return f"{type(self).__name__}({self._constants_repr()})"

    def _constants_repr(self) -> str:
        """The constants the object was made with, as its repr shows them."""
        raise NotImplementedError

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


def _float32_repr(value: float) -> str:
    """The shortest literal that reads back as the same float32 (``1e-06``
    for the float32 nearest 1e-6, whose double ``repr`` has 16 digits)."""
    return repr(float(np.format_float_positional(np.float32(value), unique=True, trim="-")))


def _mode_value(mode: object, operation: str) -> int:
    """The C enum value of a mode name, checked."""
    if not isinstance(mode, str):
        raise TypeError(f"[{operation}] mode must be a str, not {type(mode).__name__}")
    if mode not in _MODES:
        raise DualHeadNormValueError(
            operation, f"mode must be one of {', '.join(map(repr, _MODES))}, not {mode!r}"
        )
    return _MODES[mode]


def _output_count_error(
    graph_outputs: tuple[mx.array, ...], operation: str, expected: int = 2
) -> MlxCError:
    """What a call raises when the C call did not give exactly the outputs
    it publishes (two for a norm pair: queries first, keys second). The
    facades check the count inline and return the bridge's tuple as is (one
    Python call less per call)."""
    return MlxCError(
        operation, f"the compiled graph returned {len(graph_outputs)} outputs, expected {expected}"
    )


# What mx.stream() takes.
_STREAM_TYPES = (mx.Stream, mx.ThreadLocalStream, mx.Device, mx.DeviceType)


@contextmanager
def _default_stream(stream: object, operation: str) -> Iterator[None]:
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


def _as_mx_array(value: object, argument_name: str, operation: str) -> mx.array:
    """The bridges' converter for arguments that are not ``mx.array``:
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
