"""Device check: is patched decode across a KV-cache growth reproducible?

Greedy decode of the tests' small qwen3 (random weights) from a 250-token
prompt for 12 steps, so that a step crosses the cache's 256-row buffer;
unpatched four times and patched four times, each against the first
unpatched run: logits bits differing per step, then (keys, values) bits
differing per layer at the end. Every row should be all zeros.

    python3 bench/growth_determinism.py     # from the project root
"""

from __future__ import annotations

import pathlib
import sys

TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "mlx_lm_integration")]  # the helpers, the two test files

from mlx_lm.models import cache as cache_module  # noqa: E402
from test_mlx_lm_cache_write import greedy_decode, prompt_tokens  # noqa: E402
from test_mlx_lm_full_attention import build_model  # noqa: E402

from mlx_dualnorm.bits import count_bit_differences  # noqa: E402
from mlx_dualnorm.integrations import mlx_lm as integration  # noqa: E402


def main():
    model = build_model("qwen3")

    def run():
        cache = cache_module.make_prompt_cache(model)
        _, logits = greedy_decode(model, prompt_tokens(250), 12, cache)
        return logits, cache

    def differences(run_result, reference):
        logits, cache = run_result
        return (
            [count_bit_differences(a, e) for a, e in zip(logits, reference[0])],
            [(count_bit_differences(a.keys, e.keys), count_bit_differences(a.values, e.values))
             for a, e in zip(cache, reference[1])],
        )

    reference = run()
    for repeat in range(4):
        print("unpatched", repeat, *differences(run(), reference))
    with integration.patch():
        for repeat in range(4):
            print("patched  ", repeat, *differences(run(), reference))


if __name__ == "__main__":
    main()
