"""Device probe: fused/compiled parity against the composed path on the
default device, over widths up to 16384 (past the parity matrix's 8192, so
MLX's large-row kernel regime is reached for every dtype). Timing lives in
``python -m mlx_dualnorm bench``. Run on the GPU machine by
bench/run_device.sh; prints a compact report."""

from __future__ import annotations

import sys

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


def main() -> int:
    print("device", mx.default_device(), "modes", available_modes())
    status = 0
    for mode in [m for m in ("compiled", "fused") if m in available_modes()]:
        cases, failures = check_parity(mode)
        print(f"parity {mode}: {cases} cases, {len(failures)} mismatching")
        for failure in failures[:30]:
            print("  ", failure)
        status |= bool(failures)
    return status


if __name__ == "__main__":
    sys.exit(main())
