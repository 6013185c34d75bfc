"""Exhaustive parity sweep of the mlx-lm fold (minutes; a tool, not a test).

    python bench/mlx_lm_fold_sweep.py [--widths 2,3,128] [--quick]

Compares ``mlx_dualnorm.integrations.mlx_lm.normalize_qk`` (the scales folded
into constant weights, one dual call) with mlx-lm's own ``normalize_qk``
bit for bit, bit patterns of NaN included, over dtype x width x eps x
inv_scale x shape x value range x memory layout. Every input of a key
replays the same cached fold, and every call must take the fold (a call
that falls back to mlx-lm's function counts as a failure: the sweep is
about the fold). Exit status 1 if any case differs.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import mlx.core as mx

from mlx_dualnorm.bits import same_bits
from mlx_dualnorm.integrations import mlx_lm as integration

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
WIDTHS = (2, 3, 7, 16, 31, 64, 100, 128, 192, 256, 257, 512, 1000, 4096)
EPSILONS = (1e-6, 0.0, 1e-5, 1e-12, 0.5)
FIXED_INV_SCALES = (1.0, 0.1, 0.0883883, 3.7, 1 / 3, 1e-3, 300.0)
VALUE_RANGES = ("normal", "wide", "tiny", "huge", "special", "zeros")
LAYOUTS = ("contiguous", "transposed", "sliced", "reversed", "broadcast_heads", "broadcast_last")
SHAPES = ((1, 1, 16), (2, 7, 4), (3, 1, 2))  # leading axes; the width is appended
LARGE_WIDTH = 512  # above it, only every third (shape, values, layout) case runs


def values(shape: tuple[int, ...], value_range: str, key: mx.array) -> mx.array:
    normal_key, spread_key = mx.random.split(key)
    normal = mx.random.normal(shape, key=normal_key)
    if value_range == "normal":
        return normal
    if value_range == "wide":  # magnitudes over e**-9 .. e**9
        return normal * mx.exp(mx.random.uniform(-9, 9, shape, key=spread_key))
    if value_range == "tiny":
        return normal * 1e-7
    if value_range == "huge":
        return normal * 6e4
    if value_range == "special":
        position = mx.arange(normal.size).reshape(shape)
        normal = mx.where(position % 97 == 5, mx.array(float("inf")), normal)
        normal = mx.where(position % 89 == 3, mx.array(float("nan")), normal)
        return mx.where(position % 7 == 0, mx.array(-0.0), normal)
    if value_range == "zeros":
        return mx.zeros(shape)
    raise ValueError(value_range)


def laid_out(array: mx.array, layout: str) -> mx.array:
    """Same shape as ``array``, other memory layout (values may repeat)."""
    if layout == "contiguous":
        return array
    if layout == "transposed":
        return mx.swapaxes(mx.swapaxes(array, 1, 2) + 0, 1, 2)
    if layout == "sliced":
        padding = mx.zeros(array.shape[:-1] + (5,), dtype=array.dtype)
        return mx.concatenate([array, padding], axis=-1)[..., : array.shape[-1]]
    if layout == "reversed":
        return (array[..., ::-1] + 0)[..., ::-1]
    if layout == "broadcast_heads":
        return mx.broadcast_to(array[:, :, :1, :], array.shape)
    if layout == "broadcast_last":
        return mx.broadcast_to(array[..., :1], array.shape)
    raise ValueError(layout)


def sweep(widths, quick: bool) -> tuple[int, int, int, list]:
    def fallbacks() -> int:  # calls of the patched normalize_qk that ran mlx-lm's
        return integration.report().normalize_qk_original

    key = mx.random.key(20261129)
    cases = differing = folds = 0
    failures = []
    for dtype, width, eps in itertools.product(DTYPES, widths, EPSILONS):
        for inv_scale in sorted({width**-0.5, *FIXED_INV_SCALES}):
            folds += 1
            combinations = list(itertools.product(SHAPES, VALUE_RANGES, LAYOUTS))
            for index, (leading, value_range, layout) in enumerate(combinations):
                if (width > LARGE_WIDTH or quick) and index % 3:
                    continue
                key, query_key, key_key = mx.random.split(key, 3)
                shape = leading + (width,)
                key_range = "normal" if value_range == "special" else value_range
                queries = laid_out(values(shape, value_range, query_key).astype(dtype), layout)
                keys = laid_out(values(shape, key_range, key_key).astype(dtype), layout)
                before = fallbacks()
                expected = integration.ORIGINAL_NORMALIZE_QK(
                    queries, keys, inv_scale=inv_scale, eps=eps
                )
                actual = integration.normalize_qk(queries, keys, inv_scale=inv_scale, eps=eps)
                mx.eval(expected, actual)
                cases += 1
                identical = fallbacks() == before and all(
                    same_bits(a, e) for a, e in zip(actual, expected)
                )
                if not identical:
                    differing += 1
                    failures.append(
                        (str(dtype), width, eps, inv_scale, shape, value_range, layout,
                         "fell back" if fallbacks() != before else "bits differ")
                    )
        integration.clear_cache()  # keep the cache bounded across keys
    return folds, cases, differing, failures


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    parser.add_argument("--quick", action="store_true", help="every third case only")
    arguments = parser.parse_args(argv)
    widths = [int(text) for text in arguments.widths.split(",") if text.strip()]
    started = time.perf_counter()
    folds, cases, differing, failures = sweep(widths, arguments.quick)
    print(
        f"mlx-lm fold sweep on {mx.default_device()} (MLX {mx.__version__}): "
        f"{folds} folds, {cases} cases, {differing} differ "
        f"({time.perf_counter() - started:.0f} s)"
    )
    for failure in failures[:40]:
        print("  ", failure)
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
