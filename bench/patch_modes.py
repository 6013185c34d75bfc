"""Device experiment: mlx-lm decode per ``patch()`` mode, with each step's
host graph building timed apart.

For each model of ``bench/layer_ceilings.py`` (random bfloat16 weights at
released dimensions; ``--bits 4``: ``nn.quantize``, group 64), paths
round-robin within each round: mlx-lm as it is, then the package patched
in each mode. Prints ms per decode step (pipelined as mlx-lm's
generate_step) and host us per step spent building the step's graph
(the model call alone, evaluated after the clock stops), median over
rounds, ratio to mlx-lm per round: median [range]. Tokens and
log-probabilities are compared bit for bit with mlx-lm's first.

    python3 bench/patch_modes.py [--models llama-2048,qwen3-1024] [--modes fused,compiled]
                                 [--rounds 7] [--steps 64] [--bits 0|4] [--layers N]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import mlx.core as mx

import layer_ceilings
from mlx_dualnorm.integrations import mlx_lm as integration


def host_us_per_step(model, prompt, steps: int) -> float:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    token = mx.argmax(model(prompt, cache=cache)[:, -1], axis=-1)
    mx.eval(token)
    spent = []
    for _ in range(steps):
        started = time.perf_counter()
        logits = model(token[:, None], cache=cache)
        spent.append(time.perf_counter() - started)
        token = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(token)
    return 1e6 * statistics.median(spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-2048,qwen3-1024")
    parser.add_argument("--modes", default="fused,compiled")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--bits", type=int, default=0)
    parser.add_argument("--layers", type=int)
    args = parser.parse_args()
    paths = ["mlx-lm", *args.modes.split(",")]
    print(f"MLX {mx.__version__} on {mx.default_device()}; bits {args.bits or 'bf16'}; "
          f"{args.rounds} rounds of {args.steps} steps; median [range] of per-round ratios")

    def patched(path):
        return integration.unpatch() if path == "mlx-lm" else integration.patch(mode=path)

    for name in args.models.split(","):
        _, model, prompt = layer_ceilings.build(layer_ceilings.MODELS[name], args.layers, args.bits)
        reference = None
        for path in paths:
            with patched(path):
                tokens, hashes = layer_ceilings.decode(model, prompt, 16, "patched")[:2]
            reference = reference or (tokens, hashes)
            same = (tokens, hashes) == reference
            print(f"  {name} {path:9s} {'bit-identical' if same else 'DIFFERS'}")
        step_ms = {path: [] for path in paths}
        host_us = {path: [] for path in paths}
        for round_index in range(args.rounds):
            for path in paths if round_index % 2 == 0 else paths[::-1]:
                with patched(path):
                    step_ms[path].append(layer_ceilings.decode(model, prompt, args.steps, "patched")[2])
                    host_us[path].append(host_us_per_step(model, prompt, args.steps))
        for path in paths:
            cells = []
            for measured, unit in ((step_ms, "ms/step"), (host_us, "host us/step")):
                ratios = [v / r for v, r in zip(measured[path], measured["mlx-lm"])]
                cells.append(f"{statistics.median(measured[path]):8.3f} {unit} "
                             f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}]")
            print(f"  {name} {path:9s} " + "   ".join(cells))
        del model


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
