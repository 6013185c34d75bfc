"""Bytes one qwen3 attention layer allocates for a decode step, by stage.

Every stage (the q/k/v prework with the cache write; then attention; then
the output projection) is built from a fresh cache after a 16-token prompt
and evaluated as one CUDA graph (both MLX graph limits set above a layer),
so its transient is every byte it allocates: MLX's allocator rounds a
request under 16 KiB up to a power of two. Each cell is read twice (the
two readings agree on the GPU).

    MLX_MAX_OPS_PER_BUFFER=1000000 MLX_MAX_MB_PER_BUFFER=1000000 \\
        python3 bench/layer_allocation.py [--model qwen3-1024]
"""

from __future__ import annotations

import argparse

import mlx.core as mx
from mlx_lm.models import qwen3
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

from mlx_dualnorm.integrations.mlx_lm import cache_update, norm_rope
from mlx_dualnorm.commands.shared.synthetic import decode_model_config

from cache_write import attention_of
from decode_rounds import network_and_prompt

PATHS = ("mlx-lm", "patched", "patched-no-write")
STAGES = ("prework", "attention", "layer")


def mlx_lm_prework(attention, x, cache):
    """qwen3's own code up to the attention call."""
    batch, length, _ = x.shape
    queries, keys, values = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
    queries = attention.q_norm(queries.reshape(batch, length, attention.n_heads, -1))
    queries = queries.transpose(0, 2, 1, 3)
    keys = attention.k_norm(keys.reshape(batch, length, attention.n_kv_heads, -1))
    keys = keys.transpose(0, 2, 1, 3)
    values = values.reshape(batch, length, attention.n_kv_heads, -1).transpose(0, 2, 1, 3)
    queries = attention.rope(queries, offset=cache.offset)
    keys = attention.rope(keys, offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, values)
    return queries, keys, values


def patched_prework(attention, x, cache):
    """The patched layer's code up to the attention call."""
    batch, length, _ = x.shape
    queries = attention.q_proj(x).reshape(batch, length, attention.n_heads, -1)
    keys = attention.k_proj(x).reshape(batch, length, attention.n_kv_heads, -1)
    values = attention.v_proj(x).reshape(batch, length, attention.n_kv_heads, -1)
    prework = norm_rope.layer_prework(attention)
    return cache_update.prework_and_cache_update(prework, queries, keys, values, cache)


def staged(path, stage, attention, x, cache):
    """The arrays ``stage`` ends with, as ``path`` computes them."""
    prework = mlx_lm_prework if path == "mlx-lm" else patched_prework
    queries, keys, values = prework(attention, x, cache)
    if stage == "prework":
        return [queries, keys, values]
    output = scaled_dot_product_attention(queries, keys, values, cache=cache,
                                          scale=attention.scale, mask=None)
    if stage == "attention":
        return [output]
    return [attention.o_proj(output.transpose(0, 2, 1, 3).reshape(1, 1, -1))]


def allocated(path, stage, attention, prompt_x, x):
    """Bytes allocated evaluating ``stage`` of a decode step after the prompt."""
    with attention_of(path):
        cache = KVCache()
        mx.eval(attention(prompt_x, mask="causal", cache=cache), cache.keys, cache.values)
        mx.synchronize()
        live = mx.get_active_memory()
        mx.reset_peak_memory()
        outputs = staged(path, stage, attention, x, cache)
        mx.eval(outputs)
        mx.synchronize()
        return mx.get_peak_memory() - live


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-1024")
    args = parser.parse_args()
    config = decode_model_config(args.model, layers=1, vocab_size=4096)
    network, _ = network_and_prompt(config)
    attention = network.model.layers[0].self_attn
    hidden = config["hidden_size"]
    prompt_x = mx.random.normal((1, 16, hidden), key=mx.random.key(1)).astype(mx.bfloat16)
    x = mx.random.normal((1, 1, hidden), key=mx.random.key(2)).astype(mx.bfloat16)
    mx.eval(prompt_x, x)
    print(f"{args.model}, one layer, bytes allocated by a decode step (MLX {mx.__version__}, "
          f"{mx.default_device()}):")
    print(f"  {'stage':10s}" + "".join(f"{path:>18s}" for path in PATHS))
    for stage in STAGES:
        readings = [[allocated(path, stage, attention, prompt_x, x) for path in PATHS]
                    for _ in range(2)]
        print(f"  {stage:10s}" + "".join(
            f"{first:>10,d}/{second:<7,d}" for first, second in zip(*readings)))


if __name__ == "__main__":
    main()
