"""The compiled dual head norm.

``CompiledDualHeadNorm(eps)(queries, keys, query_weight, key_weight)``
returns the same two arrays, bit for bit, as::

    (mx.fast.rms_norm(queries, query_weight, eps),
     mx.fast.rms_norm(keys, key_weight, eps))

from one replay of a compiled MLX graph: one crossing into C per call, lazy
outputs, no copies of the inputs.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from mlx_dualnorm._binding import apply_compiled_dual_head_norm, call_native, ffi, lib
from mlx_dualnorm import _composite
from mlx_dualnorm._composite import ArrayLike, Mode, StreamLike, _NativeComposite

__all__ = ["CompiledDualHeadNorm", "Mode", "available_modes", "fused_outputs_in_device_pool"]

# The labels of this module's errors, ``[label] message``, as MLX's ops do
# (the C library reports the same ones); close()'s is the label + "_close".
DUAL_HEAD_NORM_OPERATION = "dual_head_norm"  # construct and call


def available_modes() -> tuple[str, ...]:
    """The modes that can run here: ``"fused"`` needs a build with the fused
    mode and MLX's CUDA backend with a GPU."""
    modes = ("composed", "compiled")
    return modes + ("fused",) if lib.mlx_dualnorm_fused_mode_available() else modes


def fused_outputs_in_device_pool() -> bool:
    """Whether the fused kernels take their outputs from MLX's
    stream-ordered device pool, as MLX's own CUDA kernels do. False in a
    build without the fused mode, and where the package runs over another
    MLX build than the one it was compiled against: the fused kernels then
    take MLX's public allocator (unified memory) and copy every cache write
    (the same bits, slower; docs/cuda-build.md). Needs no GPU."""
    return bool(lib.mlx_dualnorm_fused_outputs_in_device_pool())


class CompiledDualHeadNorm(_NativeComposite):
    """Query/key head RMS normalization as one compiled dual-output graph.

    Args:
        eps: the RMS epsilon, baked into the compiled graph. Must be finite,
            >= 0 and within float32's range, checked as given; it is then
            used as float32, as ``mx.fast.rms_norm`` does.
        mode: ``"compiled"``: one replay of the compiled dual-output graph
            (calls with more than 6144 elements in all, 48 rows of 128,
            build the composed graph, which MLX runs faster at that size).
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
    over 6144 elements, such as prefills, never trace.

    Thread-safe. ``close()`` (or leaving a ``with`` block) releases the
    compiled graphs at once; garbage collection does it otherwise.
    """

    __slots__ = ()  # _handle[0]: mlx_dualnorm_compiled_dual_head_norm*
    _c_functions = _composite._CFunctions.named("mlx_dualnorm_compiled_dual_head_norm")
    _operation = DUAL_HEAD_NORM_OPERATION

    def __init__(self, eps: float = 1e-6, mode: Mode = "auto") -> None:
        self._refuse_reinitialization()
        rms_norm_epsilon = _composite._as_epsilon(eps, DUAL_HEAD_NORM_OPERATION)
        mode_value = _composite._mode_value(mode, DUAL_HEAD_NORM_OPERATION)
        created = ffi.new("mlx_dualnorm_compiled_dual_head_norm **")
        call_native(
            lib.mlx_dualnorm_compiled_dual_head_norm_new, created, rms_norm_epsilon, mode_value
        )
        self._own(
            created[0], lib.mlx_dualnorm_compiled_dual_head_norm_free, (eps,), {"mode": mode}
        )

    def __call__(
        self, queries: ArrayLike, keys: ArrayLike,
        query_weight: Optional[ArrayLike] = None, key_weight: Optional[ArrayLike] = None,
        *, stream: StreamLike = None,
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
            with _composite._default_stream(stream, DUAL_HEAD_NORM_OPERATION):
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
            raise _composite._output_count_error(graph_outputs, DUAL_HEAD_NORM_OPERATION)
        return graph_outputs

    @property
    def eps(self) -> float:
        """The RMS epsilon baked into the graphs, as the float32 MLX uses."""
        return float(self._c_functions.epsilon(self._native))

    def _constants_repr(self) -> str:
        return f"eps={_composite._float32_repr(self.eps)}, mode={self.mode!r}"


def _as_array(value: object, argument_name: str, operation: str) -> mx.array:
    """The bridge's converter for this composite's arguments that are not
    ``mx.array``; ``operation`` labels its errors (the bridge passes the
    call's)."""
    return _composite._as_mx_array(value, argument_name, operation)
