"""Device benchmark: the decoder-layer replay against the patch without it
and against mlx-lm, in one process.

Greedy decode (random weights at released dimensions; bfloat16, or 4-bit
affine quantized with --bits 4; --batch rows) of a qwen3 at Qwen3-0.6B's
size and a llama at Llama-3.2-1B's (bench/layer_ceilings.py's MODELS),
three paths round-robin within each round, ratios per round against
mlx-lm's own code:

  mlx-lm          mlx-lm as it is
  attention-only  ``patch()`` with the decoder layer classes left out (the
                  package before the replay)
  patched         ``patch()``: the attention classes and the decoder layers

Before timing, each path's tokens and per-step log-probabilities are
compared bit for bit with mlx-lm's.

    python3 bench/decoder_layer_replay.py [--models qwen3-1024,llama-2048] [--bits 0|4]
                                          [--batch 1] [--rounds 7] [--steps 64] [--layers N]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import mlx.core as mx
import mlx.nn as nn

from layer_ceilings import MODELS, PROMPT_TOKENS, build, decode
from mlx_dualnorm.integrations import mlx_lm as integration
# Internals, to run the package as it was before the decoder layers joined.
from mlx_dualnorm.integrations.mlx_lm import registry

PATHS = ("mlx-lm", "attention-only", "patched")


@contextlib.contextmanager
def path_of(path: str):
    if path == "mlx-lm":
        with integration.unpatch():
            yield
        return
    families = registry._attention_families
    kept = list(families)
    if path == "attention-only":
        families[:] = [f for f in kept if f.kind == registry.ATTENTION]
    try:
        with integration.patch():
            yield
    finally:
        families[:] = kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3-1024,llama-2048")
    parser.add_argument("--bits", type=int, default=0, choices=(0, 4))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--layers", type=int, help="fewer layers (a dry run on CPU)")
    args = parser.parse_args()
    print(f"MLX {mx.__version__} on {mx.default_device()}; bits {args.bits or 'bf16'}, batch "
          f"{args.batch}; {args.rounds} rounds of {args.steps} steps, ms per decode step, "
          "ratio to mlx-lm per round: median [range]")
    for name in args.models.split(","):
        _, model, prompt = build(MODELS[name], args.layers)
        if args.bits:
            nn.quantize(model, group_size=64, bits=args.bits)
            mx.eval(model.parameters())
        rows = mx.stack([mx.roll(prompt, row) for row in range(args.batch)])
        assert rows.shape == (args.batch, PROMPT_TOKENS)
        reference = None
        for path in PATHS:
            with path_of(path):
                tokens, hashes, _ = decode(model, rows, min(args.steps, 16), path)
                if path == "patched":
                    print(f"  {name} {integration.report().summary()}")
            reference = reference or (tokens, hashes)
            same = (tokens, hashes) == reference
            print(f"  {name} {path:15s} "
                  + ("tokens and log-probs bit-identical" if same else "DIFFERS"))
        times: dict[str, list[float]] = {path: [] for path in PATHS}
        for round_index in range(args.rounds):
            for path in PATHS if round_index % 2 == 0 else PATHS[::-1]:
                with path_of(path):
                    times[path].append(decode(model, rows, args.steps, path)[2])
        for path in PATHS:
            ratios = [t / r for t, r in zip(times[path], times["mlx-lm"])]
            print(f"  {name} {path:15s} {statistics.median(times[path]):7.3f} ms  "
                  f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}]")
        del model


if __name__ == "__main__":
    main()
