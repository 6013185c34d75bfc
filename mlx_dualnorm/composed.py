"""The composed paths the package's composites replace, op for op: the
references every parity check compares them with, and what a user calls
to see the bits a composite must give.

``composed_dual_head_norm`` is two ``mx.fast.rms_norm`` calls;
``composed_dual_head_norm_rope`` adds, per side, the transpose to ``(B, H,
L, D)``, the optional input scale and ``mx.fast.rope``, as mlx-lm's
attention and RoPE classes call them.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from mlx_dualnorm import _composite
from mlx_dualnorm._composite import Offset, StreamLike

__all__ = ["composed_dual_head_norm", "composed_dual_head_norm_rope"]

# The labels of these functions' errors, ``[label] message``.
COMPOSED_DUAL_HEAD_NORM_OPERATION = "composed_dual_head_norm"
COMPOSED_DUAL_HEAD_NORM_ROPE_OPERATION = "composed_dual_head_norm_rope"


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
    rms_norm_epsilon = _composite._as_epsilon(eps, COMPOSED_DUAL_HEAD_NORM_OPERATION)
    return (
        mx.fast.rms_norm(queries, query_weight, rms_norm_epsilon, stream=stream),
        mx.fast.rms_norm(keys, key_weight, rms_norm_epsilon, stream=stream),
    )


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
    norms: bool = True,
    stream: StreamLike = None,
) -> tuple[mx.array, mx.array]:
    """The reference path: ``rms_norm``, transpose to ``(B, H, L, D)``, then
    ``x.at[..., :dims].multiply(input_scale)`` where ``input_scale`` is not
    None, and ``rope`` (with ``base``, or with ``freqs`` when ``base`` is
    None), for each side, as mlx-lm's attention and RoPE classes call them.
    ``eps`` is required, by position (as in :func:`composed_dual_head_norm`)
    or by keyword. With ``norms=False`` there is no ``rms_norm``: the
    reference of an object made with ``eps=None``, and of mlx-lm's attention
    without q/k norms; ``eps`` and the weights must then be None."""
    operation = COMPOSED_DUAL_HEAD_NORM_ROPE_OPERATION
    if type(norms) is not bool:
        raise TypeError(f"[{operation}] norms must be a bool, not {type(norms).__name__}")
    if not norms:
        if eps is not None or query_weight is not None or key_weight is not None:
            raise TypeError(f"[{operation}] norms=False takes no eps and no weights")
    elif eps is None:
        raise TypeError(f"[{operation}] missing the required argument eps")
    rms_norm_epsilon = 0.0 if eps is None else _composite._as_epsilon(eps, operation)

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
        normalized = normalized_heads(inputs, weight) if norms else inputs
        head_major = normalized.transpose(0, 2, 1, 3, stream=stream)
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
