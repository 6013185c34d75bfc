"""Device experiment, run under ncu: a few greedy decode steps of a small
model at released per-layer dimensions, mlx-lm as it is or patched, so that
ncu's per-kernel GPU times of the two can be compared (the host left out).

    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum \\
        python3 bench/decode_kernels.py llama-2048 patched | python3 bench/ncu_durations.py

Arguments: a model of ``bench/layer_ceilings.py`` and ``mlx-lm`` or
``patched``; 2 layers, a 512-token vocabulary, 8 decode steps after the
prompt (ncu's report holds the prompt's kernels too, alike in both).
"""
import sys

import layer_ceilings
from mlx_dualnorm.integrations import mlx_lm as integration

STEPS = 8


def main() -> None:
    name, path = sys.argv[1], sys.argv[2]
    config = dict(layer_ceilings.MODELS[name], vocab_size=512)
    _, model, prompt = layer_ceilings.build(config, layers=2)
    with integration.unpatch() if path == "mlx-lm" else integration.patch():
        layer_ceilings.decode(model, prompt, STEPS, path)


if __name__ == "__main__":
    main()
