"""The q/k head norm + RoPE of a full-attention layer.

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

``eps=None`` makes the same object without the norms: each call rotates
and transposes queries and keys as they are, ``mx.fast.rope(queries.
transpose(0, 2, 1, 3), ...)``, the q/k prework of attention without q/k
norms (mlx-lm's Llama, Mistral, Qwen2 and their kin), with the KV-cache
write of :meth:`CompiledDualHeadNormRope.apply_with_cache` as well.

Scaled RoPE (mlx-lm's ``Llama3RoPE``, ``YarnRoPE``, ``SuScaledRoPE``):
``base=None`` and the frequency table as ``freqs=`` of each call, as
``mx.fast.rope(..., base=None, freqs=freqs)``; ``input_scale=s`` multiplies
the first ``dims`` features of each normalized side first, as
``x.at[..., :dims].multiply(s)``.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, Optional, TypeVar, overload

import mlx.core as mx

from mlx_dualnorm._binding import (
    apply_compiled_dual_head_norm_rope,
    apply_compiled_dual_head_norm_rope_with_cache,
    call_native,
    ffi,
    lib,
)
from mlx_dualnorm import _composite
from mlx_dualnorm._composite import ArrayLike, Mode, Offset, StreamLike, _NativeComposite
from mlx_dualnorm._rope_arguments import (
    DUAL_HEAD_NORM_ROPE_OPERATION,
    DUAL_HEAD_NORM_ROPE_WITH_CACHE_OPERATION,
    _as_dims,
    _as_flag,
    _as_float32_argument,
    _as_write_offset,
)

__all__ = ["CompiledDualHeadNormRope"]

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
            None: no norms (see above); every call then takes no weights.
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
        eps: Optional[float],
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
        rms_norm_epsilon = None if eps is None else _composite._as_epsilon(eps, operation)
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
        if rms_norm_epsilon is None:
            call_native(
                lib.mlx_dualnorm_dual_head_norm_rope_new_without_norms, created, rope[0],
                mode_value,
            )
        else:
            call_native(
                lib.mlx_dualnorm_dual_head_norm_rope_new, created, rms_norm_epsilon, rope[0],
                mode_value,
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
    def eps(self) -> Optional[float]:
        """The RMS epsilon baked into the graphs, as the float32 MLX uses;
        None for an object made without norms."""
        native = self._native
        if not lib.mlx_dualnorm_dual_head_norm_rope_normalizes(native):
            return None
        return float(self._c_functions.epsilon(native))

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
        """Normalizes (unless made with ``eps=None``), transposes and
        rotates queries and keys.

        Args:
            queries: ``(B, L, Hq, D)`` array.
            keys: ``(B, L, Hk, D)`` array.
            query_weight: optional ``(D,)`` scale of the query norm, or
                ``(Hq * D,)``: one norm over each token's heads (see above).
                None for an object without norms.
            key_weight: optional ``(D,)`` scale of the key norm, or
                ``(Hk * D,)``; None for an object without norms.
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
        base, input_scale, eps = self.base, self.input_scale, self.eps
        constants = [
            f"eps={None if eps is None else float32_repr(eps)}",
            f"dims={self.dims!r}",
            f"base={None if base is None else float32_repr(base)}",
            f"traditional={self.traditional!r}",
            f"scale={float32_repr(self.scale)}",
        ]
        if input_scale is not None:
            constants.append(f"input_scale={float32_repr(input_scale)}")
        return ", ".join([*constants, f"mode={self.mode!r}"])
