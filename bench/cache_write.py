"""Decode with the KV-cache write in the package's call, against its peers.

Times mlx-lm greedy decode of a qwen3-like model at released dimensions
(random weights, ``mlx_dualnorm.commands.shared.synthetic``) four ways,
round-robin within each round:

  mlx-lm            mlx-lm's own attention
  patched           ``patch()``: the q/k norm + RoPE and the KV-cache write
                    of a decode step in one call per layer
  patched-no-write  ``patch()`` with caches of a subclass of ``KVCache``
                    (a class the patch has not proven, so it keeps its own
                    ``update_and_fetch``): the norm + RoPE call, then the
                    cache's two slice writes
  ceiling           the attention with the q/k norms, RoPE and the cache
                    write removed (decode steps attend over rows never
                    written; wrong tokens, for timing only)

Ratios are per round against mlx-lm, median [min-max]. Then per path, over
unpipelined decode steps: the bytes MLX allocates beyond what is live when
a step's evaluation starts (median step: its transient peak, where a copy
of the cache buffers would show), the peak memory while the prompt is
processed, and the peak memory of the whole run.

With ``--cache-step N`` the caches grow N rows at a time (mlx-lm's
``KVCache.step``, 256 by default): large buffers make a copy of them stand
out in the transient column (a per-layer copy costs a whole buffer there).

On CUDA, MLX keeps every input of the kernels it has recorded into a
command graph alive until that graph has run, and starts a new graph every
``MLX_MAX_OPS_PER_BUFFER`` kernels or ``MLX_MAX_MB_PER_BUFFER`` MB of inputs
(100 and 1000 on an H100/H200). The transient there is the largest set of
intermediates one graph holds, so it moves with where the graph boundaries
fall, not only with what a path allocates. With both limits set above one
decode step (``MLX_MAX_OPS_PER_BUFFER=1000000 MLX_MAX_MB_PER_BUFFER=1000000``)
a step is one graph and its transient is every byte the step allocates:
the per-token allocation. ``--memory-only`` skips the timings for such a run.

    python3 bench/cache_write.py [--model qwen3-1024] [--rounds 9] [--steps 64] [--vocab N]
                                 [--cache-step N] [--quick] [--memory-only]
"""

from __future__ import annotations

import contextlib
import os
import statistics

import mlx.core as mx
from mlx_lm.models import qwen3
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlx_dualnorm.integrations import mlx_lm as integration
from mlx_dualnorm.commands.mlx_lm_bench import DECODE_DTYPE_OF_WEIGHTS
from mlx_dualnorm.commands.shared.generation import timed_greedy_decode
from mlx_dualnorm.commands.shared.synthetic import decode_model_config

from decode_rounds import decode_parser, network_and_prompt, round_robin

PATHS = ("mlx-lm", "patched", "patched-no-write", "ceiling")


def unwritten_rows(cache, keys, values):
    """The cache's rows as attention reads them, with the decode step's
    write skipped (the class's own update where the buffer must grow)."""
    length = keys.shape[2]
    if type(cache) is not KVCache or cache.keys is None or (
        cache.offset + length > cache.keys.shape[2]
    ):
        return cache.update_and_fetch(keys, values)
    cache.offset += length
    return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]


def attention_ceiling(self, x, mask=None, cache=None):
    """qwen3's attention minus q_norm, k_norm, both RoPE calls and the
    cache write."""
    batch, length, _ = x.shape
    queries = self.q_proj(x).reshape(batch, length, self.n_heads, -1).transpose(0, 2, 1, 3)
    keys = self.k_proj(x).reshape(batch, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    values = self.v_proj(x).reshape(batch, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if cache is not None:
        keys, values = unwritten_rows(cache, keys, values)
    output = qwen3.scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=self.scale, mask=mask
    )
    return self.o_proj(output.transpose(0, 2, 1, 3).reshape(batch, length, -1))


class UsersKVCache(KVCache):
    """A user's subclass of mlx-lm's KVCache with an ``update_and_fetch`` of
    its own (the same work): code the patch has not proven, so it keeps its
    own update. (A subclass that overrides nothing resolves to KVCache's
    proven methods and is written by the one call.)"""

    def update_and_fetch(self, keys, values):
        return super().update_and_fetch(keys, values)


def users_caches(network):
    return [UsersKVCache() for _ in network.layers]


@contextlib.contextmanager
def attention_of(path, network):
    """qwen3's attention as ``path`` runs it, restored afterwards."""
    original_call = qwen3.Attention.__call__
    with integration.patch() if path.startswith("patched") else integration.unpatch():
        if path == "ceiling":
            qwen3.Attention.__call__ = attention_ceiling
        if path == "patched-no-write":  # mlx-lm's make_prompt_cache asks the model first
            network.make_cache = lambda: users_caches(network)
        try:
            yield
        finally:
            qwen3.Attention.__call__ = original_call
            network.__dict__.pop("make_cache", None)


def timed(path, network, prompt, steps):
    with attention_of(path, network):
        return timed_greedy_decode(network, prompt, steps)


def memory_of(path, network, prompt, steps):
    """(median transient bytes of a step's evaluation, peak bytes while the
    prompt is processed, peak bytes of the run) over the prompt and then
    ``steps`` unpipelined greedy steps."""
    with attention_of(path, network):
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        cache = make_prompt_cache(network)
        token = mx.argmax(network(prompt[None], cache=cache)[:, -1], axis=-1)
        mx.eval(token)
        transients = []
        prompt_peak = run_peak = mx.get_peak_memory()
        for _ in range(steps):
            token = mx.argmax(network(token[:, None], cache=cache)[:, -1], axis=-1)
            mx.synchronize()
            live = mx.get_active_memory()
            run_peak = max(run_peak, mx.get_peak_memory())
            mx.reset_peak_memory()
            mx.eval(token)
            transients.append(mx.get_peak_memory() - live)
        run_peak = max(run_peak, mx.get_peak_memory())
    return statistics.median(transients), prompt_peak, run_peak


def main():
    parser = decode_parser(__doc__, rounds=9)
    parser.add_argument("--vocab", type=int, help="a smaller vocabulary (on CPU the output "
                        "projection of 151936 rows drowns the layers' differences)")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 16 steps")
    parser.add_argument("--cache-step", type=int,
                        help="rows the caches grow by (mlx-lm's KVCache.step)")
    parser.add_argument("--memory-only", action="store_true",
                        help="check the tokens, then measure memory only")
    args = parser.parse_args()
    if args.cache_step:
        KVCache.step = args.cache_step
    rounds, steps = (3, 16) if args.quick else (args.rounds, args.steps)
    config = decode_model_config(args.model, layers=args.layers, vocab_size=args.vocab)
    network, prompt = network_and_prompt(config)
    tokens = {}
    for path in PATHS:
        tokens[path] = timed(path, network, prompt, 4)[0]
    if tokens["patched"] != tokens["mlx-lm"] or tokens["patched-no-write"] != tokens["mlx-lm"]:
        raise SystemExit("patched tokens differ from mlx-lm's: not a valid comparison")
    if not args.memory_only:
        print_times(args, config, network, prompt, rounds, steps)
    limits = ", ".join(f"{name}={os.environ.get(name, 'default')}"
                       for name in ("MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER"))
    print(f"memory over {steps} unpipelined decode steps of {args.model} (bytes; {limits}):")
    for path in PATHS:
        transient, prompt_peak, peak = memory_of(path, network, prompt, steps)
        print(f"  {path:17s} per-step transient {transient:12,.0f}   "
              f"prompt peak {prompt_peak:14,d}   run peak {peak:14,d}")


def print_times(args, config, network, prompt, rounds, steps):
    """ms per decode token of every path, ``rounds`` rounds of ``steps``."""
    times = round_robin(PATHS, rounds, lambda path: timed(path, network, prompt, steps)[1])
    print(f"{args.model} ({config['num_hidden_layers']} layers, vocabulary "
          f"{config['vocab_size']}, cache step {KVCache.step}): ms per "
          f"decode token, {rounds} rounds of {steps} steps, MLX {mx.__version__} on "
          f"{mx.default_device()}, weights {DECODE_DTYPE_OF_WEIGHTS}")
    for path in PATHS:
        ratios = [time / reference for time, reference in zip(times[path], times["mlx-lm"])]
        print(f"  {path:17s} {statistics.median(times[path]):8.3f} ms   vs mlx-lm "
              f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}]")


if __name__ == "__main__":
    main()
