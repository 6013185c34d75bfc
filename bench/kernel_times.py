"""Device experiment, run under ncu: a few launches of each fused kernel and
of the MLX kernels it replaces, at the decode shapes.

    ncu --clock-control none --cache-control none \\
        --metrics gpu__time_duration.sum python3 bench/kernel_times.py
"""
import mlx.core as mx

from mlx_dualnorm import CompiledDualHeadNorm, CompiledDualHeadNormRope, composed_dual_head_norm
from mlx_dualnorm import composed_dual_head_norm_rope

EPS = 1e-6
ROPE = {"dims": 128, "base": 1e6}


def heads(shape):
    return mx.random.normal(shape).astype(mx.bfloat16)


gated_q, gated_k = heads((1, 1, 16, 128)), heads((1, 1, 16, 128))
attn_q, attn_k, attn_w = heads((1, 1, 16, 256)), heads((1, 1, 2, 256)), heads((256,))
rope_q, rope_k, rope_w = heads((1, 1, 16, 128)), heads((1, 1, 8, 128)), heads((128,))
mx.eval(gated_q, gated_k, attn_q, attn_k, attn_w, rope_q, rope_k, rope_w)
norm = CompiledDualHeadNorm(EPS, "fused")
norm_rope = CompiledDualHeadNormRope(EPS, mode="fused", **ROPE)
for _ in range(4):
    mx.eval(norm(gated_q, gated_k), composed_dual_head_norm(gated_q, gated_k, None, None, EPS))
    mx.eval(norm(attn_q, attn_k, attn_w, attn_w))
    mx.eval(composed_dual_head_norm(attn_q, attn_k, attn_w, attn_w, EPS))
    mx.eval(norm_rope(rope_q, rope_k, rope_w, rope_w, offset=37))
    mx.eval(composed_dual_head_norm_rope(rope_q, rope_k, rope_w, rope_w, eps=EPS, offset=37, **ROPE))
