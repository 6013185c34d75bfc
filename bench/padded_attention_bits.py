"""Does attention over a fixed-capacity, masked KV buffer give the bits of
attention over the written rows alone?

mlx-lm's decode step attends over ``cache.keys[..., :n, :]``, whose length
grows by one each token, so a step compiled for its shapes (``mx.compile``
without ``shapeless``) would be traced anew every token. A step traced once
per buffer capacity would instead attend over the whole buffer with the
rows past ``n`` masked out. That route is exact only if MLX's
``scaled_dot_product_attention`` of one query gives the same bits both
ways, for every ``n``. This script checks that on the default device: for
each ``n`` up to ``--max-rows``, the capacity mlx-lm's ``KVCache`` would hold
(the next multiple of its 256-row step), ``sdpa(q, K[:n], V[:n])`` against
``sdpa(q, K, V, mask)`` with a boolean mask and with an additive one, the
rows past ``n`` holding zeros (as mlx-lm's buffers do) or random values.

    python bench/padded_attention_bits.py [--max-rows 2304] [--stride 1]
"""

from __future__ import annotations

import argparse
import math

import mlx.core as mx
import numpy as np

STEP = 256  # mlx-lm's KVCache grows its buffers by this many rows
SHAPES = {  # (query heads, key/value heads, head width)
    "qwen3-0.6b": (16, 8, 128),
    "llama-3.2-1b": (32, 8, 64),
}


def same_bits(a: mx.array, b: mx.array) -> bool:
    return bool(np.array_equal(np.asarray(a.view(mx.uint16)), np.asarray(b.view(mx.uint16))))


def check(shape: tuple, dtype, max_rows: int, stride: int, filler: str) -> dict:
    """Per mask kind, the row counts whose masked attention differs."""
    query_heads, kv_heads, width = shape
    capacity_max = math.ceil(max_rows / STEP) * STEP
    mx.random.seed(7)
    keys = mx.random.normal((1, kv_heads, capacity_max, width)).astype(dtype)
    values = mx.random.normal((1, kv_heads, capacity_max, width)).astype(dtype)
    query = mx.random.normal((1, query_heads, 1, width)).astype(dtype)
    scale = width ** -0.5
    differing: dict = {"boolean": [], "additive": []}
    for rows in range(1, max_rows + 1, stride):
        capacity = math.ceil(rows / STEP) * STEP
        buffer_keys, buffer_values = keys[:, :, :capacity], values[:, :, :capacity]
        if filler == "zeros":
            written = (mx.arange(capacity) < rows)[None, None, :, None]
            buffer_keys = mx.where(written, buffer_keys, mx.zeros_like(buffer_keys))
            buffer_values = mx.where(written, buffer_values, mx.zeros_like(buffer_values))
        exact = mx.fast.scaled_dot_product_attention(
            query, keys[:, :, :rows], values[:, :, :rows], scale=scale
        )
        boolean = (mx.arange(capacity) < rows)[None, None, None, :]
        additive = mx.where(boolean, mx.array(0.0, dtype), mx.array(-mx.inf, dtype))
        for kind, mask in (("boolean", boolean), ("additive", additive)):
            padded = mx.fast.scaled_dot_product_attention(
                query, buffer_keys, buffer_values, scale=scale, mask=mask
            )
            if not same_bits(exact, padded):
                differing[kind].append(rows)
    return differing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-rows", type=int, default=2304)
    parser.add_argument("--stride", type=int, default=1)
    options = parser.parse_args()
    print(f"MLX {mx.__version__} on {mx.default_device()}; rows 1..{options.max_rows} "
          f"step {options.stride}; capacity the next multiple of {STEP}")
    checked = len(range(1, options.max_rows + 1, options.stride))
    for name, shape in SHAPES.items():
        for dtype in (mx.bfloat16, mx.float16):
            for filler in ("zeros", "random"):
                differing = check(shape, dtype, options.max_rows, options.stride, filler)
                for kind, rows in differing.items():
                    shown = rows[:8] + (["..."] if len(rows) > 8 else [])
                    print(f"  {name:13} {str(dtype):14} rows past n {filler:6} {kind:8} mask: "
                          f"{checked - len(rows)}/{checked} bit-identical; differing at {shown}")


if __name__ == "__main__":
    main()
