"""q/k prework of full-attention layers per decode token: one
CompiledDualHeadNormRope call against the composed ops.

    python bench/norm_rope_prework.py                 # 28 layers, 15 rounds
    python bench/norm_rope_prework.py --layers 36 --rounds 9 --tokens 100
    python bench/norm_rope_prework.py --independent   # no chain between layers

The composed prework of a layer is mlx-lm's Qwen3 attention's: two
mx.fast.rms_norm, two transposes to (B, H, L, D), two mx.fast.rope at the
token's offset. Each token runs a chain of --layers layers (each layer's
inputs are the previous layer's outputs transposed back, a view, the same
in both paths) and evaluates once, as a decode step does. With
--independent, each layer reads inputs of its own instead (as a model's
layers read their own projections), so a token holds the prework nodes and
nothing else; all its outputs are evaluated once. Rounds interleave
the paths (composed, compiled, and fused where the CUDA kernel is
available; the order rotates each round) in one process; each round times
--tokens tokens per path. Prints µs per token of each path and each
path's ratio to composed (lower is better): medians and min-max over
rounds. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from mlx_dualnorm import (
    CompiledDualHeadNormRope,
    available_modes,
    composed_dual_head_norm_rope,
)

EPS = 1e-6
BASE = 1_000_000.0


def make_layers(layers, width, dtype):
    weights = []
    for index in range(layers):
        query_key, key_key = mx.random.split(mx.random.key(index))
        weights.append((
            (1 + 0.1 * mx.random.normal((width,), key=query_key)).astype(dtype),
            (1 + 0.1 * mx.random.normal((width,), key=key_key)).astype(dtype),
        ))
    mx.eval(weights)
    return weights


def run_token(prework, layer_inputs, weights, offset, independent):
    """One token: `prework(queries, keys, query_weight, key_weight, offset)`
    per layer, chained through transposes back to (B, L, H, D) or on each
    layer's own inputs, then one evaluation."""
    queries, keys = layer_inputs[0]
    outputs = []
    for layer, (query_weight, key_weight) in enumerate(weights):
        if independent:
            queries, keys = layer_inputs[layer]
        rotated_queries, rotated_keys = prework(queries, keys, query_weight, key_weight, offset)
        outputs += [rotated_queries, rotated_keys]
        queries, keys = rotated_queries.transpose(0, 2, 1, 3), rotated_keys.transpose(0, 2, 1, 3)
    mx.eval(outputs[-2:] if not independent else outputs)


def time_tokens(token_of, tokens, first_offset):
    started = time.perf_counter()
    for step in range(tokens):
        token_of(first_offset + step)
    return 1e6 * (time.perf_counter() - started) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--query-heads", type=int, default=16)
    parser.add_argument("--key-heads", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--independent", action="store_true",
                        help="each layer reads its own inputs: no chain between layers")
    args = parser.parse_args()

    dtype = mx.bfloat16
    width = args.width
    layer_inputs = [
        (mx.random.normal((1, 1, args.query_heads, width), key=mx.random.key(2 * layer + 1))
         .astype(dtype),
         mx.random.normal((1, 1, args.key_heads, width), key=mx.random.key(2 * layer + 2))
         .astype(dtype))
        for layer in range(args.layers)
    ]
    weights = make_layers(args.layers, width, dtype)
    mx.eval(layer_inputs)
    modes = [mode for mode in ("compiled", "fused") if mode in available_modes()]
    norm_ropes = {mode: CompiledDualHeadNormRope(EPS, width, base=BASE, mode=mode)
                  for mode in modes}

    def composed(queries, keys, query_weight, key_weight, offset):
        return composed_dual_head_norm_rope(queries, keys, query_weight, key_weight, eps=EPS,
                                            dims=width, base=BASE, offset=offset)

    def calling(norm_rope):
        return lambda queries, keys, query_weight, key_weight, offset: norm_rope(
            queries, keys, query_weight, key_weight, offset=offset)

    preworks = {"composed": composed, **{mode: calling(norm_rope)
                                         for mode, norm_rope in norm_ropes.items()}}
    paths = {name: (lambda offset, prework=prework:
                    run_token(prework, layer_inputs, weights, offset, args.independent))
             for name, prework in preworks.items()}
    for token_of in paths.values():  # warm-up: traces, kernels
        time_tokens(token_of, 20, 0)

    per_token: dict[str, list[float]] = {name: [] for name in paths}
    ratios: dict[str, list[float]] = {mode: [] for mode in modes}
    names = list(paths)
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            per_token[name].append(time_tokens(paths[name], args.tokens, 100 * round_index))
        for mode in modes:
            ratios[mode].append(per_token[mode][-1] / per_token["composed"][-1])

    layout = "independent layers" if args.independent else "layers chained through transposes"
    print(f"q/k norm + RoPE prework, {args.layers} {layout}, q (1,1,{args.query_heads},{width}) "
          f"k (1,1,{args.key_heads},{width}) bf16, {mx.default_device()}, "
          f"{args.rounds} interleaved rounds of {args.tokens} tokens")
    for name, values in per_token.items():
        print(f"  {name:9s} µs/token  median {statistics.median(values):8.1f}  "
              f"range {min(values):8.1f} - {max(values):8.1f}")
    for mode, values in ratios.items():
        print(f"  {mode} / composed (lower is better)  median {statistics.median(values):.3f}  "
              f"range {min(values):.3f} - {max(values):.3f}")


if __name__ == "__main__":
    main()
