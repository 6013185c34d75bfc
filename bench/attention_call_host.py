"""Host time to build one mlx-lm attention call's graph, patched vs unpatched.

Qwen3 attention layers at Qwen3-0.6B's head counts (16 query heads,
8 key/value heads of width 128): one with plain ``nn.RoPE`` and one with
YaRN ``rope_scaling`` (a frequency table and an input scale), which the
patch engages, one with ``dynamic`` rope_scaling, which it leaves to
mlx-lm's own code, and the plain one again with a ``KVCache`` (patched:
the norm + RoPE and the cache write in one call; unpatched: the class's
``update_and_fetch``). Each call builds the layer's graph for one decode
token (no evaluation: the cache's graph is evaluated every
``CALLS_PER_EVALUATION`` calls, outside the clock, with the write row
reset), so the time is what the host spends in Python and MLX's graph
building: the part of a decode step the patch changes. Patched and unpatched run in alternating rounds; each round's
median goes into the report, which prints per layer the median over rounds,
their range, and patched / unpatched (lower is better; a layer the patch
leaves alone should be at 1.0x).

    python bench/attention_call_host.py [--rounds 7] [--calls 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models import qwen3
from mlx_lm.models.cache import KVCache

from mlx_dualnorm.integrations import mlx_lm as integration

HIDDEN = 1024
ARGUMENTS = {
    "model_type": "qwen3", "hidden_size": HIDDEN, "num_hidden_layers": 1,
    "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-6, "vocab_size": 1024,
    "max_position_embeddings": 40960, "rope_theta": 1_000_000.0, "tie_word_embeddings": True,
}
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
        "mscale": 1.0, "mscale_all_dim": 0.5}
DYNAMIC = {"type": "dynamic", "factor": 2.0}


def attention_layer(rope_scaling):
    layer = qwen3.Attention(qwen3.ModelArgs.from_dict({**ARGUMENTS, "rope_scaling": rope_scaling}))
    layer.set_dtype(mx.bfloat16)
    mx.eval(layer.parameters())
    return layer


CALLS_PER_EVALUATION = 50
CACHE_ROW = 100


def microseconds_per_call(layer, x, calls: int, with_cache: bool = False) -> float:
    cache = KVCache() if with_cache else None
    if cache is not None:  # a buffer written at one row, never grown while timed
        layer(mx.zeros((1, CACHE_ROW + 1, HIDDEN), mx.bfloat16), cache=cache)
    elapsed = 0.0
    for call in range(50 + calls):  # the first calls decide the layer; then warm
        if cache is not None and call % CALLS_PER_EVALUATION == 0:
            mx.eval(cache.keys, cache.values)
            cache.offset = CACHE_ROW
        started = time.perf_counter()
        layer(x, cache=cache)
        if cache is not None:
            cache.offset = CACHE_ROW
        if call >= 50:
            elapsed += time.perf_counter() - started
    return elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    options = parser.parse_args()
    x = mx.random.normal((1, 1, HIDDEN)).astype(mx.bfloat16)
    layers = {
        "plain nn.RoPE (engaged)": None,
        "YaRN rope_scaling (engaged)": YARN,
        "dynamic rope_scaling (left alone)": DYNAMIC,
        "plain nn.RoPE, KVCache (engaged)": None,
    }
    times: dict = {(name, patched): [] for name in layers for patched in (False, True)}
    for round_index in range(options.rounds):
        order = (False, True) if round_index % 2 == 0 else (True, False)
        for patched in order:
            integration.unpatch()
            if patched:
                integration.patch()
            for name, rope_scaling in layers.items():
                # A fresh layer each round, so the patched round decides it anew.
                layer = attention_layer(rope_scaling)
                times[(name, patched)].append(
                    microseconds_per_call(layer, x, options.calls, "KVCache" in name))
    integration.unpatch()
    print(f"host us per attention call ({options.rounds} rounds x {options.calls} calls, "
          f"{mx.default_device()}); lower is better")
    print(f"{'layer':32} {'unpatched':>22} {'patched':>22} {'patched/unpatched':>18}")
    for name in layers:
        unpatched, patched = times[(name, False)], times[(name, True)]
        ratios = [p / u for p, u in zip(patched, unpatched)]
        print(
            f"{name:32} {statistics.median(unpatched):7.1f} ({min(unpatched):.1f}-{max(unpatched):.1f})"
            f"  {statistics.median(patched):7.1f} ({min(patched):.1f}-{max(patched):.1f})"
            f"  {statistics.median(patched) / statistics.median(unpatched):7.3f}x"
            f" ({min(ratios):.3f}-{max(ratios):.3f})"
        )


if __name__ == "__main__":
    main()
