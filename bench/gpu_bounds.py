"""Device experiment: what bounds the fused modes' ratios on MLX CUDA.

Every path below is timed per token of ``--layers`` layers, in turns (a
round runs each path's tokens back to back, as decode does, the order
reversed every other round; ``--interleaved`` alternates token by token
instead), and each token is split into the graph build, the host's encoding
(``mx.async_eval`` returns once every node is encoded and the CUDA graph
launched) and the wait for the GPU after that. A token's outputs are
evaluated through one array that depends on them all (``mx.depends``), as
decode evaluates only its logits: ``mx.eval`` charges about 1.4 µs for
every unevaluated array handed to it on an H200, which would bill a path
for returning two outputs per layer where a reference returns one. Ratios
are per round against the composed path of the same case, reported as
median [min-max].

Beside the package's paths, each case runs a floor: one trivial MLX kernel
per layer (``mx.negative`` of the queries), the cheapest node MLX can add.
No single-launch replacement of the composed ops can cost less than one
such node per layer, so floor / composed bounds every fused ratio from below.
A second reference keeps one of MLX's own nodes of the kind the fused
kernel subsumes: the queries' rms_norm alone (``one-norm``), or their rope
alone (``one-rope``); a fused node does at least that node's work. The
dual-norm cases also run MLX's own node with two outputs, ``mx.divmod`` of
the queries by themselves (``two-output``): one kernel that writes two
arrays, as any single launch returning both normalized inputs must be. Its
build and encoding, plus the floor's GPU wait, is what such a node costs
MLX before it does any work (its own kernel's wait is not part of that).

Cases:
  gated-delta   q, k (1,1,16,128) bf16, no weights: 2 rms_norm vs 1 launch
  full-attn     q (1,1,16,256), k (1,1,2,256) bf16, weighted: the same
  norm-rope     q (1,1,16,128), k (1,1,8,128) bf16, weighted, RoPE at an
                int offset, one more each token as in decode (every layer of
                a token at the same): rms_norm, transpose and rope per side (the six
                composed ops) vs 1 launch; layers independent (each reads
                inputs of its own), since the outputs are (B, H, L, D)

Then host µs per call (graph build only, batches of 100 calls): the package's
calls and single MLX ops for scale.

    python3 bench/gpu_bounds.py [--layers 28] [--rounds 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from mlx_dualnorm import (
    CompiledDualHeadNorm,
    CompiledDualHeadNormRope,
    composed_dual_head_norm,
    fused_outputs_in_device_pool,
)
from mlx_dualnorm import composed_dual_head_norm_rope

EPS = 1e-6
ROPE = {"dims": 128, "base": 1_000_000.0, "traditional": False, "scale": 1.0}
OFFSET = 37


# An evaluated array that each token's outputs are attached to (mx.depends).
TOKEN_ANCHOR = mx.zeros((1,))


def heads(shape, seed):
    return (mx.random.normal(shape, key=mx.random.key(seed)) * 0.5).astype(mx.bfloat16)


class Case:
    """One shape: its inputs per layer and the per-layer calls of each path."""

    def __init__(self, name, query_shape, key_shape, weighted, rope, layers, mode):
        self.name = name
        self.rope = rope
        self.offset = OFFSET
        width = query_shape[-1]
        self.layer_inputs = [
            (heads(query_shape, 2 * layer), heads(key_shape, 2 * layer + 1))
            for layer in range(layers)
        ]
        self.query_weight = heads((width,), 1000) if weighted else None
        self.key_weight = heads((width,), 1001) if weighted else None
        mx.eval(self.layer_inputs, self.query_weight, self.key_weight)
        if rope:
            fused = CompiledDualHeadNormRope(EPS, mode=mode, **ROPE)
            composed = lambda q, k: composed_dual_head_norm_rope(
                q, k, self.query_weight, self.key_weight, eps=EPS, offset=self.offset, **ROPE
            )
            self.paths = {
                "composed": composed,
                "fused": lambda q, k: fused(
                    q, k, self.query_weight, self.key_weight, offset=self.offset
                ),
                "floor": lambda q, k: (mx.negative(q),),
                "one-rope": lambda q, k: (
                    mx.fast.rope(
                        q, 128, traditional=False, base=1e6, scale=1.0, offset=self.offset
                    ),
                ),
            }
        else:
            fused = CompiledDualHeadNorm(EPS, mode=mode)
            self.paths = {
                "composed": lambda q, k: composed_dual_head_norm(
                    q, k, self.query_weight, self.key_weight, EPS
                ),
                "fused": lambda q, k: fused(q, k, self.query_weight, self.key_weight),
                "floor": lambda q, k: (mx.negative(q), k),
                "one-norm": lambda q, k: (mx.fast.rms_norm(q, self.query_weight, EPS), k),
                "two-output": lambda q, k: mx.divmod(q, q),
            }

    def build_token(self, path, chained):
        """The lazy outputs of one token: every layer's, or the last
        layer's where each layer feeds the next."""
        call = self.paths[path]
        self.offset += 1  # a token's position, as in decode: a new offset each token
        if chained:
            queries, keys = self.layer_inputs[0]
            for _ in self.layer_inputs:
                queries, keys = call(queries, keys)
            return [queries, keys]
        outputs = []
        for queries, keys in self.layer_inputs:
            outputs.extend(call(queries, keys))
        return outputs


def split_token(case, path, chained):
    started = time.perf_counter()
    outputs = case.build_token(path, chained)
    built = time.perf_counter()
    # One array to evaluate, as decode evaluates only its logits. mx.eval
    # waits on every array it is handed, about 1.4 µs each on an H200
    # whatever made it, so handing it all outputs would charge a path for
    # how many it returns (2 per layer against the references' 1).
    token = mx.depends([TOKEN_ANCHOR], outputs)[0]
    mx.async_eval(token)
    encoded = time.perf_counter()
    mx.eval(token)
    finished = time.perf_counter()
    return (built - started) * 1e6, (encoded - built) * 1e6, (finished - encoded) * 1e6


def spread(values):
    return f"{statistics.median(values):.3f}x [{min(values):.3f}-{max(values):.3f}]"


def time_case(case, chained, rounds, interleaved, tokens_per_round=20, warmup=20):
    paths = list(case.paths)
    for path in paths:
        for _ in range(warmup):
            split_token(case, path, chained)
    samples = {path: [] for path in paths}  # per round: median (build, encode, wait)
    for round_index in range(rounds):
        order = paths if round_index % 2 == 0 else paths[::-1]
        round_samples = {path: [] for path in paths}
        if interleaved:
            for _ in range(tokens_per_round):
                for path in order:
                    round_samples[path].append(split_token(case, path, chained))
        else:
            for path in order:
                for _ in range(tokens_per_round):
                    round_samples[path].append(split_token(case, path, chained))
        for path in paths:
            samples[path].append([statistics.median(part) for part in zip(*round_samples[path])])
    layout = "chained" if chained else "independent"
    print(f"\n{case.name}, {len(case.layer_inputs)} layers, {layout}: µs per token, "
          f"median of {rounds} rounds of {tokens_per_round} tokens"
          + (", paths alternating token by token" if interleaved else ""))
    totals = {path: [sum(parts) for parts in samples[path]] for path in paths}
    for path in paths:
        parts = list(zip(*samples[path]))
        ratios = [total / reference for total, reference in zip(totals[path], totals["composed"])]
        print(f"  {path:10s} build {statistics.median(parts[0]):7.1f}  encode "
              f"{statistics.median(parts[1]):7.1f}  wait {statistics.median(parts[2]):7.1f}  "
              f"total {statistics.median(totals[path]):7.1f}  vs composed {spread(ratios)}")


def host_us_per_call(call, batches=200, calls_per_batch=100):
    """Median over batches of the build time of one call (outputs released
    outside the clock)."""
    per_call = []
    for _ in range(batches):
        kept = []
        started = time.perf_counter()
        for _ in range(calls_per_batch):
            kept.append(call())
        per_call.append((time.perf_counter() - started) * 1e6 / calls_per_batch)
        del kept
    return statistics.median(per_call)


def _mlx_lm_layer_calls(queries, keys, mode):
    """One qwen3 layer's q/k prework as mlx-lm's own code builds it, and as
    the patch does in ``mode`` (its glue, then the package's call), at the
    same inputs. Leaves mlx-lm patched: the timing runs afterwards."""
    from mlx_lm.models import qwen3

    from mlx_dualnorm.integrations import mlx_lm as integration
    from mlx_dualnorm.integrations.mlx_lm import norm_rope

    arguments = qwen3.ModelArgs(
        model_type="qwen3", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=EPS,
        vocab_size=512, max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=True,
    )
    integration.patch(mode=mode)
    attention = qwen3.Attention(arguments)
    attention.set_dtype(mx.bfloat16)
    mx.eval(attention.parameters())

    class Position:  # what the prework reads of a KV cache
        offset = OFFSET

    def mlx_lm_prework():
        rotated_queries = attention.rope(
            attention.q_norm(queries).transpose(0, 2, 1, 3), offset=Position.offset
        )
        rotated_keys = attention.rope(
            attention.k_norm(keys).transpose(0, 2, 1, 3), offset=Position.offset
        )
        return rotated_queries, rotated_keys

    return {
        "mlx-lm layer prework, its own code": mlx_lm_prework,
        "patched layer prework (glue + call)": lambda: norm_rope.rotated_queries_and_keys(
            attention, queries, keys, Position
        ),
    }


def time_host_calls(mode):
    gated_q, gated_k = heads((1, 1, 16, 128), 1), heads((1, 1, 16, 128), 2)
    attn_q, attn_k = heads((1, 1, 16, 256), 3), heads((1, 1, 2, 256), 4)
    attn_w = heads((256,), 5)
    rope_q, rope_k, rope_w = heads((1, 1, 16, 128), 6), heads((1, 1, 8, 128), 7), heads((128,), 8)
    mx.eval(gated_q, gated_k, attn_q, attn_k, attn_w, rope_q, rope_k, rope_w)
    fused = CompiledDualHeadNorm(EPS, mode=mode)
    fused_rope = CompiledDualHeadNormRope(EPS, mode=mode, **ROPE)
    calls = {
        "mx.negative (one trivial op)": lambda: mx.negative(gated_q),
        "mx.divmod (two outputs)": lambda: mx.divmod(attn_q, attn_q),
        "mx.fast.rms_norm, weighted": lambda: mx.fast.rms_norm(attn_q, attn_w, EPS),
        "mx.fast.rms_norm, no weight": lambda: mx.fast.rms_norm(gated_q, None, EPS),
        "mx.fast.rope, int offset": lambda: mx.fast.rope(
            rope_q, 128, traditional=False, base=1e6, scale=1.0, offset=OFFSET
        ),
        "composed dual norm, gated-delta": lambda: composed_dual_head_norm(
            gated_q, gated_k, None, None, EPS
        ),
        "fused dual norm, gated-delta": lambda: fused(gated_q, gated_k),
        "composed dual norm, full-attn": lambda: composed_dual_head_norm(
            attn_q, attn_k, attn_w, attn_w, EPS
        ),
        "fused dual norm, full-attn": lambda: fused(attn_q, attn_k, attn_w, attn_w),
        "composed norm + rope (6 ops)": lambda: composed_dual_head_norm_rope(
            rope_q, rope_k, rope_w, rope_w, eps=EPS, offset=OFFSET, **ROPE
        ),
        "fused norm + rope": lambda: fused_rope(rope_q, rope_k, rope_w, rope_w, offset=OFFSET),
    }
    calls.update(_mlx_lm_layer_calls(rope_q, rope_k, mode))
    for call in calls.values():
        host_us_per_call(call, batches=5)
    print("\nhost µs per call (graph build only), median of 3 passes over every call:")
    results = {name: [] for name in calls}
    for _ in range(3):
        for name, call in calls.items():
            results[name].append(host_us_per_call(call))
    for name, values in results.items():
        low, high = min(values), max(values)
        print(f"  {name:36s} {statistics.median(values):6.2f}  [{low:.2f}-{high:.2f}]")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--mode", default="fused", help="the package's mode to time ('compiled': CPU dry run)"
    )
    parser.add_argument(
        "--interleaved", action="store_true",
        help="alternate the paths token by token instead of running each path's tokens of a "
        "round back to back (MLX then re-points its cached CUDA graph to another path's "
        "kernels every token: about twice the encoding for every path on an H200)",
    )
    args = parser.parse_args()
    print(f"MLX {mx.__version__}, {mx.default_device()}")
    mx.eval(TOKEN_ANCHOR)
    cases = [
        Case("gated-delta", (1, 1, 16, 128), (1, 1, 16, 128), False, False, args.layers, args.mode),
        Case("full-attn", (1, 1, 16, 256), (1, 1, 2, 256), True, False, args.layers, args.mode),
        Case("norm-rope", (1, 1, 16, 128), (1, 1, 8, 128), True, True, args.layers, args.mode),
    ]
    for case in cases:
        for chained in ((True, False) if not case.rope else (False,)):
            time_case(case, chained, args.rounds, args.interleaved)
    print(f"\nthe package's paths ran in mode {args.mode!r}")
    pool = fused_outputs_in_device_pool()
    print(
        "fused outputs from "
        + ("MLX's stream-ordered device pool" if pool else "MLX's public allocator (unified memory)")
    )
    time_host_calls(args.mode)


if __name__ == "__main__":
    main()
