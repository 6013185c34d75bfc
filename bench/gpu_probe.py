"""Device probe: fused/compiled parity against the composed path on the
default device, and a first decode-token timing. Run on the GPU machine by
bench/run_device.sh; prints a compact report."""

from __future__ import annotations

import statistics
import sys
import time

import mlx.core as mx

from mlx_dualnorm import CompiledDualHeadNorm, available_modes, composed_dual_head_norm


def parity_cases():
    widths = [64, 80, 96, 128, 200, 256, 512, 1000, 1024, 2048, 4096, 8192, 16384]
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        for width in widths:
            for query_heads, key_heads in ((16, 16), (24, 4), (32, 2)):
                for weighted in ("none", "both", "query"):
                    yield dtype, width, query_heads, key_heads, weighted


def check_parity(mode: str) -> tuple[int, list[str]]:
    eps = 1e-6
    norm = CompiledDualHeadNorm(eps, mode)
    key = mx.random.key(7)
    failures = []
    cases = 0
    for dtype, width, query_heads, key_heads, weighted in parity_cases():
        k1, k2, k3, k4, key = mx.random.split(key, 5)
        rows = 1 if width > 2048 else 3
        queries = (mx.random.normal((2, rows, query_heads, width), key=k1) * 0.05).astype(dtype)
        keys = (mx.random.normal((2, rows, key_heads, width), key=k2) * 3).astype(dtype)
        query_weight = mx.random.normal((width,), key=k3).astype(dtype) if weighted in ("both", "query") else None
        key_weight = mx.random.normal((width,), key=k4).astype(dtype) if weighted == "both" else None
        actual = norm(queries, keys, query_weight, key_weight)
        expected = composed_dual_head_norm(queries, keys, query_weight, key_weight, eps)
        cases += 1
        for name, a, e in zip(("q", "k"), actual, expected):
            if a.dtype != e.dtype or a.shape != e.shape or not mx.array_equal(a, e, equal_nan=True).item():
                diff = int((a != e).sum().item()) if a.shape == e.shape else -1
                failures.append(f"{mode} {dtype} D={width} {query_heads}/{key_heads} w={weighted} {name}: {diff} differ")
    # Special values.
    specials = mx.array([0.0, float("nan"), float("inf"), -float("inf"), 1e-40, 6e4, -6e4, 1e-7] * 16)
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        x = specials.astype(dtype).reshape(1, 128)
        zero_row = mx.zeros((1, 128), dtype=dtype)
        for q in (x, zero_row, mx.concatenate([x, zero_row])):
            actual = norm(q, q)
            expected = composed_dual_head_norm(q, q, None, None, eps)
            cases += 1
            if not all(mx.array_equal(a, e, equal_nan=True).item() for a, e in zip(actual, expected)):
                failures.append(f"{mode} {dtype} specials shape {q.shape}")
    # Non-contiguous inputs.
    base = mx.random.normal((4, 128, 16)).astype(mx.bfloat16)
    transposed = base.transpose(0, 2, 1)
    sliced = mx.random.normal((4, 16, 256)).astype(mx.bfloat16)[..., ::2]
    weight = mx.broadcast_to(mx.array(1.5, dtype=mx.bfloat16), (128,))
    for q in (transposed, sliced):
        actual = norm(q, q, weight, weight)
        expected = composed_dual_head_norm(q, q, weight, weight, eps)
        cases += 1
        if not all(mx.array_equal(a, e, equal_nan=True).item() for a, e in zip(actual, expected)):
            failures.append(f"{mode} non-contiguous {q.shape}")
    return cases, failures


def decode_microseconds_per_token(path, layers=48, tokens=300, weighted=False):
    queries = mx.random.normal((1, 1, 16, 256 if weighted else 128)).astype(mx.bfloat16)
    keys = mx.random.normal((1, 1, 2 if weighted else 16, 256 if weighted else 128)).astype(mx.bfloat16)
    width = queries.shape[-1]
    query_weight = mx.ones((width,), dtype=mx.bfloat16) if weighted else None
    key_weight = mx.ones((width,), dtype=mx.bfloat16) if weighted else None
    mx.eval(queries, keys)
    totals, builds = [], []
    for token in range(tokens + 20):
        start = time.perf_counter()
        q, k = queries, keys
        for _ in range(layers):
            q, k = path(q, k, query_weight, key_weight)
        built = time.perf_counter()
        mx.eval(q, k)
        if token >= 20:
            totals.append((time.perf_counter() - start) * 1e6)
            builds.append((built - start) * 1e6)
    return statistics.median(totals), statistics.median(builds)


def host_microseconds_per_call(path, calls=20000):
    queries = mx.random.normal((1, 1, 16, 128)).astype(mx.bfloat16)
    mx.eval(queries)
    for _ in range(1000):
        path(queries, queries, None, None)
    start = time.perf_counter_ns()
    for _ in range(calls):
        path(queries, queries, None, None)
    return (time.perf_counter_ns() - start) / calls / 1000


def main() -> int:
    print("device", mx.default_device(), "modes", available_modes())
    status = 0
    for mode in [m for m in ("compiled", "fused") if m in available_modes()]:
        cases, failures = check_parity(mode)
        print(f"parity {mode}: {cases} cases, {len(failures)} mismatching")
        for failure in failures[:30]:
            print("  ", failure)
        status |= bool(failures)
    eps = 1e-6
    paths = {"composed": lambda q, k, wq, wk: composed_dual_head_norm(q, k, wq, wk, eps)}
    compiled_python = mx.compile(lambda q, k: composed_dual_head_norm(q, k, None, None, eps), shapeless=True)
    paths["mx.compile"] = lambda q, k, wq, wk: compiled_python(q, k) if wq is None else composed_dual_head_norm(q, k, wq, wk, eps)
    for mode in available_modes():
        if mode != "composed":
            paths[mode] = CompiledDualHeadNorm(eps, mode)
    rows = []
    for repeat in range(2):
        for name, path in paths.items():
            gated, gated_build = decode_microseconds_per_token(path)
            full, full_build = decode_microseconds_per_token(path, weighted=True)
            rows.append((name, gated, gated_build, full, full_build, host_microseconds_per_call(path)))
    base = {row[0]: row for row in rows[: len(paths)]}
    print(f"{'path':12s} {'us/tok gd':>10s} {'(build)':>8s} {'ratio':>6s} {'us/tok fa':>10s} {'(build)':>8s} {'ratio':>6s} {'host us':>8s}")
    for name, gated, gated_build, full, full_build, host in rows:
        print(f"{name:12s} {gated:10.1f} {gated_build:8.1f} {gated / base['composed'][1]:6.2f} {full:10.1f} {full_build:8.1f} {full / base['composed'][3]:6.2f} {host:8.2f}")
    return status


if __name__ == "__main__":
    sys.exit(main())
