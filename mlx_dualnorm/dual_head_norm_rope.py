"""The q/k head norm + RoPE of a full-attention layer, and the composed path
it replaces.

``CompiledDualHeadNormRope(eps, dims, base=...)(queries, keys, wq, wk,
offset=offset)`` returns the same two arrays, bit for bit, as::

    (mx.fast.rope(mx.fast.rms_norm(queries, wq, eps).transpose(0, 2, 1, 3),
                  dims, traditional=, base=, scale=, offset=offset),
     mx.fast.rope(mx.fast.rms_norm(keys, wk, eps).transpose(0, 2, 1, 3),
                  dims, traditional=, base=, scale=, offset=offset))

the q/k prework of mlx-lm's Qwen3 attention, from one replay of a compiled
MLX graph: one crossing into C per call, lazy outputs, no copies.

A weight of ``H * D`` elements (more than one head) normalizes each token's
heads together, as mlx-lm's OLMo-2 normalizes its whole q/k projection
before splitting it into heads: ``mx.fast.rms_norm(x.reshape(B, L, H * D),
w, eps).reshape(B, L, H, D)``, then the transpose and RoPE.

Scaled RoPE (mlx-lm's ``Llama3RoPE``, ``YarnRoPE``, ``SuScaledRoPE``):
``base=None`` and the frequency table as ``freqs=`` of each call, as
``mx.fast.rope(..., base=None, freqs=freqs)``; ``input_scale=s`` multiplies
the first ``dims`` features of each normalized side first, as
``x.at[..., :dims].multiply(s)``.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Generic, Optional, TypeVar, Union, overload

import mlx.core as mx
import numpy as np

from mlx_dualnorm._binding import (
    apply_compiled_dual_head_norm_rope,
    apply_compiled_dual_head_norm_rope_with_cache,
    call_native,
    ffi,
    lib,
)
from mlx_dualnorm import _composite
from mlx_dualnorm._composite import ArrayLike, Mode, StreamLike, _NativeComposite
from mlx_dualnorm._errors import DualHeadNormValueError

__all__ = ["CompiledDualHeadNormRope", "composed_dual_head_norm_rope"]

# The labels of this module's errors, ``[label] message``, as MLX's ops do
# (the C library reports the same ones); close()'s is the label + "_close".
DUAL_HEAD_NORM_ROPE_OPERATION = "dual_head_norm_rope"  # construct and call
COMPOSED_DUAL_HEAD_NORM_ROPE_OPERATION = "composed_dual_head_norm_rope"
DUAL_HEAD_NORM_ROPE_WITH_CACHE_OPERATION = "dual_head_norm_rope_with_cache"  # apply_with_cache

# What mx.fast.rope takes as offset: an int, or an integer mx.array (a
# scalar, or one value per batch entry).
Offset = Union[int, mx.array]

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def composed_dual_head_norm_rope(
    queries: mx.array,
    keys: mx.array,
    query_weight: Optional[mx.array] = None,
    key_weight: Optional[mx.array] = None,
    eps: Optional[float] = None,
    *,
    dims: int,
    base: Optional[float],
    traditional: bool = False,
    scale: float = 1.0,
    offset: Offset = 0,
    freqs: Optional[mx.array] = None,
    input_scale: Optional[float] = None,
    stream: StreamLike = None,
) -> tuple[mx.array, mx.array]:
    """The reference path: ``rms_norm``, transpose to ``(B, H, L, D)``, then
    ``x.at[..., :dims].multiply(input_scale)`` where ``input_scale`` is not
    None, and ``rope`` (with ``base``, or with ``freqs`` when ``base`` is
    None), for each side, as mlx-lm's attention and RoPE classes call them.
    ``eps`` is required, by position (as in :func:`composed_dual_head_norm`)
    or by keyword."""
    if eps is None:
        raise TypeError(
            f"[{COMPOSED_DUAL_HEAD_NORM_ROPE_OPERATION}] missing the required argument eps"
        )
    rms_norm_epsilon = _composite._as_epsilon(eps, COMPOSED_DUAL_HEAD_NORM_ROPE_OPERATION)

    def normalized_heads(inputs: mx.array, weight: Optional[mx.array]) -> mx.array:
        if inputs.ndim == 4 and weight is not None and weight.ndim == 1:
            batch, length, heads, width = inputs.shape
            if heads > 1 and width > 0 and weight.shape[0] == heads * width:
                # A weight of H * D elements: each token's heads as one row.
                projection = inputs.reshape(batch, length, heads * width, stream=stream)
                normalized = mx.fast.rms_norm(projection, weight, rms_norm_epsilon, stream=stream)
                return normalized.reshape(batch, length, heads, width, stream=stream)
        return mx.fast.rms_norm(inputs, weight, rms_norm_epsilon, stream=stream)

    def normalized_and_rotated(inputs: mx.array, weight: Optional[mx.array]) -> mx.array:
        head_major = normalized_heads(inputs, weight).transpose(0, 2, 1, 3, stream=stream)
        if input_scale is not None:
            # ArrayAt takes no stream: the default one, set for the call.
            if stream is None:
                head_major = head_major.at[..., :dims].multiply(input_scale)
            else:
                with mx.stream(stream):
                    head_major = head_major.at[..., :dims].multiply(input_scale)
        return mx.fast.rope(
            head_major,
            dims,
            traditional=traditional,
            base=base,
            scale=scale,
            offset=offset,
            freqs=freqs,
            stream=stream,
        )

    return normalized_and_rotated(queries, query_weight), normalized_and_rotated(keys, key_weight)


_Parameter = TypeVar("_Parameter", int, bool, float)


class _RopeParameter(Generic[_Parameter]):
    """A read-only attribute of a :class:`CompiledDualHeadNormRope`: the
    field of its C object's RoPE parameters that has the attribute's name,
    converted to the Python type."""

    def __init__(self, convert: Callable[[Any], _Parameter], doc: str) -> None:
        self._convert: Callable[[Any], _Parameter] = convert
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self._field = name

    @overload
    def __get__(self, composite: None, owner: type) -> _RopeParameter[_Parameter]: ...
    @overload
    def __get__(self, composite: CompiledDualHeadNormRope, owner: type) -> _Parameter: ...
    def __get__(self, composite, owner):
        if composite is None:
            return self
        parameters = lib.mlx_dualnorm_dual_head_norm_rope_parameters(composite._native)
        return self._convert(getattr(parameters, self._field))

    def __set__(self, composite: CompiledDualHeadNormRope, value: object) -> None:
        raise AttributeError(f"{self._field} is read-only: it was fixed at construction")


class CompiledDualHeadNormRope(_NativeComposite):
    """Query/key head RMS normalization, then RoPE, as one compiled graph.

    Args:
        eps: the RMS epsilon. Finite, >= 0 and within float32's range,
            checked as given, then used as float32 (as ``mx.fast.rms_norm``).
        dims: the features RoPE rotates (positive, even, at most the head
            width; the rest are copied), as ``mx.fast.rope``'s ``dims``.
        base: RoPE's base (``nn.RoPE``'s; mlx-lm's ``rope_theta``), finite
            and > 0, or None for a RoPE whose frequencies are a table: each
            call then takes it as ``freqs`` (as ``mx.fast.rope``, exactly
            one of the two).
            Required.
        traditional: rotate consecutive pairs instead of halves.
        scale: the scale of the positions.
        input_scale: None (default), or a factor applied to the first
            ``dims`` features of each normalized side before the rotation,
            as ``x.at[..., :dims].multiply(input_scale)`` (YaRN's
            ``mscale``, su-scaled RoPE's ``_scale``): a Python float, so
            rounded to float32, then to the inputs' dtype, the product
            computed in that dtype, as MLX does. Finite.
        mode: ``"compiled"``: one replay of a compiled graph, traced once
            per input shape (calls with more than 16384 elements in all,
            as in a prefill, build the composed graph instead). ``"composed"``: the
            six calls, rebuilt each time (the reference). ``"fused"``: one
            CUDA kernel launch for every row of queries and keys (MLX's CUDA
            backend with a GPU only; calls it does not take run the compiled
            graph). ``"auto"`` (default): ``"fused"`` where it can run, else
            ``"compiled"``. Every mode gives the same bits.

    Call it with queries ``(B, L, Hq, D)``, keys ``(B, L, Hk, D)``, optional
    ``(D,)`` weights (or ``(H * D,)``: one norm over each token's heads) and
    the RoPE ``offset``: an int, or an integer
    ``mx.array`` (a scalar, or one per batch entry, as ``mx.fast.rope``
    takes). The offset is an input of the graph, not a constant: decoding
    at successive positions replays one trace.

    With ``base=None``, every call takes the frequency table as ``freqs``:
    an ``mx.array`` of shape ``(dims // 2,)``, of any dtype (converted to
    float32, as ``mx.fast.rope`` does). It is an input of the graph too,
    not held by the object: a table that changes between calls (a module
    whose ``_freqs`` is replaced) is followed, with no new trace for one of
    the same shape and dtype, and the object keeps no array alive.

    Thread-safe. ``close()`` (or leaving a ``with`` block) releases the
    compiled graphs at once; garbage collection does it otherwise.
    """

    __slots__ = ()  # _handle[0]: mlx_dualnorm_dual_head_norm_rope*
    _c_functions = _composite._CFunctions.named("mlx_dualnorm_dual_head_norm_rope")
    _operation = DUAL_HEAD_NORM_ROPE_OPERATION

    def __init__(
        self,
        eps: float,
        dims: int,
        *,
        base: Optional[float],
        traditional: bool = False,
        scale: float = 1.0,
        input_scale: Optional[float] = None,
        mode: Mode = "auto",
    ) -> None:
        self._refuse_reinitialization()
        operation = DUAL_HEAD_NORM_ROPE_OPERATION
        rms_norm_epsilon = _composite._as_epsilon(eps, operation)
        rope = ffi.new("mlx_dualnorm_rope_parameters *")
        rope.dims = _as_dims(dims)
        rope.traditional = _as_flag(traditional, "traditional")
        rope.with_freqs = base is None
        rope.base = 0.0 if base is None else _as_float32_argument(base, "base")
        rope.scale = _as_float32_argument(scale, "scale")
        if input_scale is not None:
            rope.input_scale.value = _as_float32_argument(input_scale, "input_scale")
            rope.input_scale.has_value = True
        mode_value = _composite._mode_value(mode, operation)
        created = ffi.new("mlx_dualnorm_dual_head_norm_rope **")
        call_native(
            lib.mlx_dualnorm_dual_head_norm_rope_new, created, rms_norm_epsilon, rope[0], mode_value
        )
        self._own(
            created[0], lib.mlx_dualnorm_dual_head_norm_rope_free, (eps, dims),
            {"base": base, "traditional": traditional, "scale": scale,
             "input_scale": input_scale, "mode": mode},
        )

    # RoPE's constants, read back from the C object as it holds them.
    dims = _RopeParameter(int, "The features RoPE rotates; the rest are copied.")
    traditional = _RopeParameter(bool, "Whether RoPE rotates consecutive pairs, not halves.")
    scale = _RopeParameter(float, "RoPE's position scale, as the float32 MLX uses.")

    @property
    def base(self) -> Optional[float]:
        """RoPE's base, as the float32 MLX uses; None when each call takes
        the frequency table."""
        parameters = lib.mlx_dualnorm_dual_head_norm_rope_parameters(self._native)
        return None if parameters.with_freqs else float(parameters.base)

    @property
    def input_scale(self) -> Optional[float]:
        """The factor of the first ``dims`` features before the rotation,
        as the float32 the C object holds; None for none."""
        parameters = lib.mlx_dualnorm_dual_head_norm_rope_parameters(self._native)
        return float(parameters.input_scale.value) if parameters.input_scale.has_value else None

    def __call__(
        self,
        queries: ArrayLike,
        keys: ArrayLike,
        query_weight: Optional[ArrayLike] = None,
        key_weight: Optional[ArrayLike] = None,
        *,
        offset: Offset = 0,
        freqs: Optional[mx.array] = None,
        stream: StreamLike = None,
    ) -> tuple[mx.array, mx.array]:
        """Normalizes, transposes and rotates queries and keys.

        Args:
            queries: ``(B, L, Hq, D)`` array.
            keys: ``(B, L, Hk, D)`` array.
            query_weight: optional ``(D,)`` scale of the query norm, or
                ``(Hq * D,)``: one norm over each token's heads (see above).
            key_weight: optional ``(D,)`` scale of the key norm, or
                ``(Hk * D,)``.
            offset: position of the first of the ``L`` tokens: an int, or an
                integer ``mx.array`` (scalar or ``(B,)``), as mlx-lm's
                ``cache.offset``.
            freqs: the frequency table of an object made with
                ``base=None`` (required there, refused otherwise): an
                ``mx.array`` of shape ``(dims // 2,)``, as ``mx.fast.rope``'s
                ``freqs``.
            stream: stream or device to run on; the default stream if None.

        Returns:
            ``(rotated_queries, rotated_keys)``, lazy, of shapes
            ``(B, Hq, L, D)`` and ``(B, Hk, L, D)``.

        Raises:
            TypeError: an argument of the wrong type.
            DualHeadNormValueError: (a ``ValueError``) an input
                ``mx.fast.rms_norm``, the transpose or ``mx.fast.rope``
                rejects, or this object is closed.
            MlxCError: MLX failed while building the graph.
        """
        if stream is not None:
            with _composite._default_stream(stream, DUAL_HEAD_NORM_ROPE_OPERATION):
                return self(queries, keys, query_weight, key_weight, offset=offset, freqs=freqs)
        # The local keeps the C object alive for the whole call.
        native, address = self._handle
        if not address:
            raise self._uninitialized_error()
        graph_outputs = apply_compiled_dual_head_norm_rope(
            address, queries, keys, query_weight, key_weight, offset, freqs
        )
        # The C builders' fixed order, queries then keys: the tuple as is.
        if len(graph_outputs) != 2:
            raise _composite._output_count_error(graph_outputs, DUAL_HEAD_NORM_ROPE_OPERATION)
        return graph_outputs

    def apply_with_cache(
        self,
        queries: ArrayLike,
        keys: ArrayLike,
        values: ArrayLike,
        query_weight: Optional[ArrayLike] = None,
        key_weight: Optional[ArrayLike] = None,
        *,
        key_cache: ArrayLike,
        value_cache: ArrayLike,
        offset: Offset = 0,
        write_offset: Optional[int] = None,
        freqs: Optional[mx.array] = None,
        fetch: bool = False,
        stream: StreamLike = None,
    ) -> tuple[mx.array, ...]:
        """The norm + RoPE of this call and the KV-cache write of
        mlx-lm's ``KVCache.update_and_fetch``, in one call.

        Returns ``(rotated_queries, key_cache_written, value_cache_written)``:
        the queries as ``self(queries, keys, ...)`` returns them, and the two
        buffers with rows ``[w, w + L)`` of axis 2 set to the rotated keys
        and to ``values.transpose(0, 2, 1, 3)``, where ``w`` is
        ``write_offset``: the buffers ``cache.keys[..., w:w+L, :] = keys``
        and ``cache.values[..., w:w+L, :] = values`` leave, bit for bit.
        With ``fetch=True``, also ``key_cache_written[..., :w + L, :]`` and
        ``value_cache_written[..., :w + L, :]``: the rows attention reads,
        as ``update_and_fetch`` returns them (on the fused route, views of
        the written buffers made in the same launch, so no slicing is left
        to do).

        Args:
            queries, keys, query_weight, key_weight: as for ``__call__``.
            values: ``(B, L, Hk, Dv)`` array.
            key_cache: the key buffer, ``(B, Hk, capacity, D)``.
            value_cache: the value buffer, ``(B, Hk, capacity, Dv)``.
            offset: the RoPE offset, as for ``__call__``.
            write_offset: the first row written (an int, ``0 <= w`` and
                ``w + L`` within each buffer); ``offset`` when omitted, which
                must then be an int (mlx-lm's ``KVCache``: both are
                ``cache.offset``).
            freqs: the frequency table, as for ``__call__``.
            fetch: also return the rows written so far of both buffers.
            stream: stream or device to run on; the default stream if None.

        The buffers are not modified: the results are new lazy arrays. MLX
        writes into a buffer's memory instead of copying it when nothing
        else references the buffer at evaluation, so a cache that replaces
        its buffers with the results (``cache.keys = key_cache_written``)
        pays for the rows written, not a copy of the buffer; a caller that
        keeps the old buffer keeps its contents, and pays for the copy.

        Raises:
            TypeError: an argument of the wrong type.
            DualHeadNormValueError: (a ``ValueError``) an input the norm +
                RoPE or the write rejects (shapes that do not match, rows
                outside a buffer), or this object is closed.
            MlxCError: MLX failed while building the graph.
        """
        operation = DUAL_HEAD_NORM_ROPE_WITH_CACHE_OPERATION
        if type(fetch) is not bool:
            raise TypeError(f"[{operation}] fetch must be a bool, not {type(fetch).__name__}")
        if stream is not None:
            with _composite._default_stream(stream, operation):
                return self.apply_with_cache(
                    queries, keys, values, query_weight, key_weight, key_cache=key_cache,
                    value_cache=value_cache, offset=offset, write_offset=write_offset,
                    freqs=freqs, fetch=fetch,
                )
        row = _as_write_offset(offset if write_offset is None else write_offset,
                               write_offset is None)
        # The local keeps the C object alive for the whole call.
        native, address = self._handle
        if not address:
            raise self._uninitialized_error(operation)
        graph_outputs = apply_compiled_dual_head_norm_rope_with_cache(
            address, queries, keys, values, query_weight, key_weight, offset, freqs, key_cache,
            value_cache, row, fetch,
        )
        # The C call's fixed order: queries, key buffer, value buffer (then
        # the key rows and the value rows fetched).
        expected = 5 if fetch else 3
        if len(graph_outputs) != expected:
            raise _composite._output_count_error(graph_outputs, operation, expected)
        return graph_outputs

    def _constants_repr(self) -> str:
        float32_repr = _composite._float32_repr
        base, input_scale = self.base, self.input_scale
        constants = [
            f"eps={float32_repr(self.eps)}",
            f"dims={self.dims!r}",
            f"base={None if base is None else float32_repr(base)}",
            f"traditional={self.traditional!r}",
            f"scale={float32_repr(self.scale)}",
        ]
        if input_scale is not None:
            constants.append(f"input_scale={float32_repr(input_scale)}")
        return ", ".join([*constants, f"mode={self.mode!r}"])


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
