"""Device experiment: how much of the reachable decode gain the patch takes.

Times mlx-lm greedy decode of a qwen3-like model at released dimensions
(random bfloat16 weights, ``mlx_dualnorm.commands.shared.synthetic``) three
ways, round-robin within each round:

  mlx-lm       mlx-lm's own attention
  patched      ``mlx_dualnorm.integrations.mlx_lm.patch()``: q/k norm and
               RoPE in one call per layer
  no-prework   the ceiling: the attention with the q/k norms and RoPE
               removed altogether (wrong tokens; for timing only). No
               replacement of those four ops can be cheaper than nothing.

Ratios are per round against mlx-lm, median [min-max]. Then, with
``--split``, each path's decode steps run one at a time, unpipelined, each
split into the graph build (the model's forward call), the host's encoding
(``mx.async_eval``) and the wait for the GPU after it: generation overlaps
the next step's build with the GPU's work, so where the time of a step
goes says which of the host's or the GPU's savings can show.

    python3 bench/decode_ceiling.py [--model qwen3-1024] [--rounds 15] [--steps 64] [--split]
"""

from __future__ import annotations

import contextlib
import statistics
import time

import mlx.core as mx
from mlx_lm.models import qwen3

from mlx_dualnorm.integrations import mlx_lm as integration
from mlx_dualnorm.integrations.mlx_lm import cache_update
from mlx_dualnorm.commands.shared.generation import timed_greedy_decode
from mlx_dualnorm.commands.shared.synthetic import decode_model_config

from decode_rounds import decode_parser, network_and_prompt, round_robin


def attention_without_prework(self, x, mask=None, cache=None):
    """qwen3's attention minus q_norm, k_norm and both RoPE calls."""
    batch, length, _ = x.shape
    queries = self.q_proj(x).reshape(batch, length, self.n_heads, -1).transpose(0, 2, 1, 3)
    keys = self.k_proj(x).reshape(batch, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    values = self.v_proj(x).reshape(batch, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    output = cache_update.attention_output(self, queries, keys, values, cache, mask, batch, length)
    return self.o_proj(output)


@contextlib.contextmanager
def attention_of(path):
    """qwen3's attention as ``path`` runs it, restored afterwards."""
    original = qwen3.Attention.__call__
    with integration.patch() if path == "patched" else integration.unpatch():
        if path == "no-prework":
            qwen3.Attention.__call__ = attention_without_prework
        try:
            yield
        finally:
            qwen3.Attention.__call__ = original


def run(path, network, prompt, steps):
    with attention_of(path):
        return timed_greedy_decode(network, prompt, steps)[1]


def split_steps(path, network, prompt, steps):
    """Median µs of (build, encode, wait) over ``steps`` unpipelined greedy
    decode steps after the prompt."""
    from mlx_lm.models.cache import make_prompt_cache

    with attention_of(path):
        cache = make_prompt_cache(network)
        token = mx.argmax(network(prompt[None], cache=cache)[:, -1], axis=-1)
        mx.eval(token)
        parts = []
        for _ in range(steps):
            started = time.perf_counter()
            logits = network(token[:, None], cache=cache)
            token = mx.argmax(logits[:, -1], axis=-1)
            built = time.perf_counter()
            mx.async_eval(token)
            encoded = time.perf_counter()
            mx.eval(token)
            finished = time.perf_counter()
            parts.append((built - started, encoded - built, finished - encoded))
    return [1e6 * statistics.median(part) for part in zip(*parts)]


def main():
    parser = decode_parser(__doc__, rounds=15)
    parser.add_argument("--split", action="store_true", help="also split unpipelined steps")
    args = parser.parse_args()
    config = decode_model_config(args.model, **({"layers": args.layers} if args.layers else {}))
    network, prompt = network_and_prompt(config)
    paths = ["mlx-lm", "patched", "no-prework"]
    for path in paths:
        run(path, network, prompt, 4)
    times = round_robin(paths, args.rounds, lambda path: run(path, network, prompt, args.steps))
    print(f"{args.model}: ms per decode token, {args.rounds} rounds of {args.steps} steps, "
          f"MLX {mx.__version__} on {mx.default_device()}")
    for path in paths:
        ratios = [time / reference for time, reference in zip(times[path], times["mlx-lm"])]
        print(f"  {path:11s} {statistics.median(times[path]):7.3f} ms   vs mlx-lm "
              f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}]")
    if not args.split:
        return
    print("unpipelined steps, µs (median over rounds of the median step):")
    splits = round_robin(
        paths, max(3, args.rounds // 3), lambda path: split_steps(path, network, prompt, args.steps)
    )
    for path in paths:
        build, encode, wait = (statistics.median(part) for part in zip(*splits[path]))
        print(f"  {path:11s} build {build:7.1f}  encode {encode:7.1f}  wait {wait:7.1f}  "
              f"total {build + encode + wait:7.1f}")


if __name__ == "__main__":
    main()
