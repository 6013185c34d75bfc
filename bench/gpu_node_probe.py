"""Device experiment: where a decode token's eval time goes on MLX CUDA.

Times 48 layers per token, chained (each layer feeds the next) and
independent, for the composed path, the fused mode, and two floors: one
and two trivial elementwise MLX kernels per layer (``mx.negative``), which
show what MLX charges for a graph step whatever the kernel does.

    python3 bench/gpu_node_probe.py                 # the timing table
    python3 bench/gpu_node_probe.py split           # eval split into host encode and GPU wait
    python3 bench/gpu_node_probe.py ncu             # a few calls, for ncu
    python3 bench/gpu_node_probe.py trace PATH N    # N chained tokens of PATH, for nsys
"""
import statistics
import sys
import time

import mlx.core as mx

from mlx_dualnorm import CompiledDualHeadNorm, composed_dual_head_norm

EPS = 1e-6
LAYERS = 48
fused = CompiledDualHeadNorm(EPS, "fused")
# Inputs held here are not donatable: the fused kernel then writes fresh
# buffers instead of its inputs' (cleared after every token).
HELD_INPUTS = []


def fused_without_donation(queries, keys):
    HELD_INPUTS.extend((queries, keys))
    return fused(queries, keys)

PATHS = {
    "composed": lambda q, k: composed_dual_head_norm(q, k, None, None, EPS),
    "fused": lambda q, k: fused(q, k),
    "floor-1-kernel": lambda q, k: (mx.negative(q), k),
    "floor-2-kernels": lambda q, k: (mx.negative(q), mx.negative(k)),
    "rms-norm-1-kernel": lambda q, k: (mx.fast.rms_norm(q, None, EPS), k),
    "fused-no-donation": fused_without_donation,
}
start_queries = mx.random.normal((1, 1, 16, 128)).astype(mx.bfloat16)
start_keys = mx.random.normal((1, 1, 16, 128)).astype(mx.bfloat16)
mx.eval(start_queries, start_keys)


def build_token(path, chained):
    """The lazy outputs of one token: LAYERS calls, each fed by the last
    (chained) or all fed the same start inputs (independent)."""
    queries, keys = start_queries, start_keys
    outputs = []
    for _ in range(LAYERS):
        if chained:
            queries, keys = path(queries, keys)
        else:
            outputs.extend(path(start_queries, start_keys))
    return [queries, keys] if chained else outputs


def token(path, chained):
    results = build_token(path, chained)
    built = time.perf_counter()
    mx.eval(results)
    HELD_INPUTS.clear()
    return built


def measure(path, chained, tokens=300, warmup=30):
    builds, evals = [], []
    for index in range(tokens + warmup):
        started = time.perf_counter()
        built = token(path, chained)
        finished = time.perf_counter()
        if index >= warmup:
            builds.append((built - started) * 1e6)
            evals.append((finished - built) * 1e6)
    return statistics.median(builds), statistics.median(evals)


def split_token(path, chained):
    """One token's (build, encode, wait) in us: mx.async_eval returns once
    the host has encoded every node and launched the CUDA graph, so the
    wait after it is GPU work the host did not hide."""
    started = time.perf_counter()
    results = build_token(path, chained)
    built = time.perf_counter()
    mx.async_eval(results)
    encoded = time.perf_counter()
    mx.eval(results)
    finished = time.perf_counter()
    HELD_INPUTS.clear()
    return (built - started) * 1e6, (encoded - built) * 1e6, (finished - encoded) * 1e6


def measure_split(path, chained, tokens=300, warmup=30):
    samples = [split_token(path, chained) for _ in range(tokens + warmup)][warmup:]
    return [statistics.median(column) for column in zip(*samples)]


def main(argv):
    if argv[:1] == ["split"]:
        for _ in range(3):
            for chained in (True, False):
                for name, path in PATHS.items():
                    build, encode, wait = measure_split(path, chained)
                    print(f"{name:17s} chained={chained!s:5s} build {build:6.1f} "
                          f"encode {encode:6.1f} wait {wait:6.1f} "
                          f"total {build + encode + wait:6.1f} us/token")
        return
    if argv[:1] == ["ncu"]:
        for name in ("composed", "fused", "floor-1-kernel"):
            for _ in range(3):
                path = PATHS[name]
                mx.eval(path(start_queries, start_keys))
        return
    if argv[:1] == ["trace"]:
        path, tokens = PATHS[argv[1]], int(argv[2])
        for _ in range(tokens):
            token(path, True)
        return
    for _ in range(3):
        for chained in (True, False):
            for name, path in PATHS.items():
                build, evaluation = measure(path, chained)
                print(f"{name:16s} chained={chained!s:5s} build {build:7.1f} "
                      f"eval {evaluation:7.1f} total {build + evaluation:7.1f} us/token")


if __name__ == "__main__":
    main(sys.argv[1:])
