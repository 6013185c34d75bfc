"""Host time to build one mlx-lm attention call's graph, patched vs unpatched.

Three qwen3 attention layers at Qwen3-0.6B's head layout (16 query heads,
8 key/value heads of width 128): one with plain ``nn.RoPE`` and one with
YaRN ``rope_scaling`` (a frequency table and an input scale), which the
patch engages, and one with ``dynamic`` rope_scaling, which it leaves to
mlx-lm's own code. Each call builds the layer's graph for one decode
token (no evaluation, no cache), so the time is what the host spends in
Python and MLX's graph building: the part of a decode step the patch
changes. Patched and unpatched run in alternating rounds; each round's
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


def microseconds_per_call(layer, x, calls: int) -> float:
    for _ in range(50):  # the first call decides the layer; then warm
        layer(x)
    started = time.perf_counter()
    for _ in range(calls):
        layer(x)
    return (time.perf_counter() - started) / calls * 1e6


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
                times[(name, patched)].append(microseconds_per_call(layer, x, options.calls))
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
