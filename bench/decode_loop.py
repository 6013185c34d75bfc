"""One path's decode-like tokens in a loop, for a sampling profiler.

Runs tokens of 28 layers of q/k head norms at the full-attention decode
shape (q ``(1, 1, 16, 256)``, k ``(1, 1, 2, 256)`` bf16, weighted) for a
few seconds, each token evaluated through one array that depends on all
its outputs, as ``gpu_bounds.py`` times them, and prints µs per token.
Nothing else runs, so a profiler attached to the process sees where one
path's host time goes: this package, MLX, the CUDA driver, the allocator.

    perf record -e cpu-clock -F 20000 -- python bench/decode_loop.py --path fused --layout chained
    perf report --no-children --sort dso

``--path fused`` needs the fused mode (a CUDA build on an MLX CUDA GPU).
"""
import argparse
import time

import mlx.core as mx

from mlx_dualnorm import CompiledDualHeadNorm

EPS = 1e-6
LAYERS = 28


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=("fused", "compiled", "composed"), default="fused")
    parser.add_argument("--layout", choices=("independent", "chained"), default="independent")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()

    layers = [
        (mx.random.normal((1, 1, 16, 256), key=mx.random.key(2 * index)).astype(mx.bfloat16),
         mx.random.normal((1, 1, 2, 256), key=mx.random.key(2 * index + 1)).astype(mx.bfloat16))
        for index in range(LAYERS)
    ]
    query_weight = mx.random.normal((256,), key=mx.random.key(100)).astype(mx.bfloat16)
    key_weight = mx.random.normal((256,), key=mx.random.key(101)).astype(mx.bfloat16)
    anchor = mx.array(0.0)
    mx.eval(layers, query_weight, key_weight, anchor)

    if args.path == "composed":
        def call(queries, keys):
            return (mx.fast.rms_norm(queries, query_weight, EPS),
                    mx.fast.rms_norm(keys, key_weight, EPS))
    else:
        dual_head_norm = CompiledDualHeadNorm(EPS, mode=args.path)

        def call(queries, keys):
            return dual_head_norm(queries, keys, query_weight, key_weight)

    def token():
        if args.layout == "chained":
            queries, keys = layers[0]
            for _ in layers:
                queries, keys = call(queries, keys)
            outputs = [queries, keys]
        else:
            outputs = [output for queries, keys in layers for output in call(queries, keys)]
        mx.eval(mx.depends([anchor], outputs)[0])

    for _ in range(200):  # warm-up: kernel loading, graph caches
        token()
    tokens = 0
    started = time.perf_counter()
    while time.perf_counter() - started < args.seconds:
        token()
        tokens += 1
    elapsed = time.perf_counter() - started
    print(f"{args.path}, {LAYERS} layers {args.layout}: {tokens} tokens, "
          f"{elapsed / tokens * 1e6:.1f} µs per token")


if __name__ == "__main__":
    main()
