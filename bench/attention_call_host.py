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
building: the part of a decode step the patch changes. A Llama layer at
Llama-3.2-1B's head counts (32 query heads, 8 key/value heads of width 64,
``llama3`` rope_scaling) with a ``KVCache`` is timed too: attention without
q/k norms, whose prework the patch makes one call (the RoPE-only call).
Patched and unpatched run in alternating rounds; each round's
median goes into the report, which prints per layer the median over rounds,
their range, and patched / unpatched (lower is better; a layer the patch
leaves alone should be at 1.0x).

    python bench/attention_call_host.py [--rounds 7] [--calls 2000] [--profile]

``--profile`` then runs each engaged layer patched under cProfile and prints
the Python functions by their own time: where the patched call's host time
goes.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import mlx.core as mx
from mlx_lm.models import llama, qwen3
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
LLAMA = "llama"  # the layer's key: Llama-3.2-1B's attention
LLAMA_HIDDEN = 2048
LLAMA_ARGUMENTS = {
    "model_type": "llama", "hidden_size": LLAMA_HIDDEN, "num_hidden_layers": 1,
    "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "rms_norm_eps": 1e-5, "vocab_size": 1024, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0,
                     "low_freq_factor": 1.0, "original_max_position_embeddings": 8192},
}


def attention_layer(rope_scaling):
    if rope_scaling == LLAMA:
        layer = llama.Attention(llama.ModelArgs.from_dict(LLAMA_ARGUMENTS))
    else:
        layer = qwen3.Attention(
            qwen3.ModelArgs.from_dict({**ARGUMENTS, "rope_scaling": rope_scaling})
        )
    layer.set_dtype(mx.bfloat16)
    mx.eval(layer.parameters())
    return layer


CALLS_PER_EVALUATION = 50
CACHE_ROW = 100


def microseconds_per_call(layer, x, calls: int, with_cache: bool = False) -> float:
    cache = KVCache() if with_cache else None
    if cache is not None:  # a buffer written at one row, never grown while timed
        layer(mx.zeros((1, CACHE_ROW + 1, x.shape[-1]), mx.bfloat16), cache=cache)
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
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--only", choices=("patched", "unpatched"),
        help="time one path alone (for a native profiler such as perf); no ratios",
    )
    options = parser.parse_args()
    inputs = {
        width: mx.random.normal((1, 1, width)).astype(mx.bfloat16)
        for width in (HIDDEN, LLAMA_HIDDEN)
    }
    layers = {
        "plain nn.RoPE (engaged)": None,
        "YaRN rope_scaling (engaged)": YARN,
        "dynamic rope_scaling (left alone)": DYNAMIC,
        "plain nn.RoPE, KVCache (engaged)": None,
        "llama, KVCache (engaged)": LLAMA,
    }

    def timed(name: str, calls: int) -> float:
        layer = attention_layer(layers[name])
        x = inputs[LLAMA_HIDDEN if layers[name] == LLAMA else HIDDEN]
        return microseconds_per_call(layer, x, calls, "KVCache" in name)

    times: dict = {(name, patched): [] for name in layers for patched in (False, True)}
    for round_index in range(options.rounds):
        order = (False, True) if round_index % 2 == 0 else (True, False)
        if options.only:
            order = (options.only == "patched",)
        for patched in order:
            integration.unpatch()
            if patched:
                integration.patch()
            for name in layers:
                # A fresh layer each round, so the patched round decides it anew.
                times[(name, patched)].append(timed(name, options.calls))
    integration.unpatch()
    print(f"host us per attention call ({options.rounds} rounds x {options.calls} calls, "
          f"{mx.default_device()}); lower is better")
    print(f"{'layer':32} {'unpatched':>22} {'patched':>22} {'patched/unpatched':>18}")
    for name in layers:
        unpatched, patched = times[(name, False)], times[(name, True)]
        if options.only:  # one path: its median and range
            alone = patched or unpatched
            print(f"{name:32} {options.only} {statistics.median(alone):7.1f} "
                  f"({min(alone):.1f}-{max(alone):.1f})")
            continue
        ratios = [p / u for p, u in zip(patched, unpatched)]
        print(
            f"{name:32} {statistics.median(unpatched):7.1f} ({min(unpatched):.1f}-{max(unpatched):.1f})"
            f"  {statistics.median(patched):7.1f} ({min(patched):.1f}-{max(patched):.1f})"
            f"  {statistics.median(patched) / statistics.median(unpatched):7.3f}x"
            f" ({min(ratios):.3f}-{max(ratios):.3f})"
        )
    if options.profile:
        integration.patch()
        for name in layers:
            if "left alone" in name:
                continue
            profiler = cProfile.Profile()
            profiler.runcall(timed, name, options.calls)
            print(f"\n== patched, {name}: Python functions by own time, {options.calls} calls")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
        integration.unpatch()


if __name__ == "__main__":
    main()
