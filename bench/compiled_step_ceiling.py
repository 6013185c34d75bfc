"""Device experiment: an exact replay of a whole decode step.

mlx-lm's own model code runs under one ``mx.compile(shapeless=True)``
with the model's arrays as implicit inputs (read at each call: nothing
served stale), the step's cache handed in as a stand-in whose
``update_and_fetch`` concatenates the rows cached so far (an input, the
buffer's rows ``[0, offset)``) with the step's new rows, and whose offset
is an array (RoPE takes it so); after the replay the new rows go into
mlx-lm's own ``KVCache`` by its ``update_and_fetch``. Attention then reads
the same key and value rows in the same order as mlx-lm's, and the run
says whether every step's log-probabilities keep mlx-lm's bits.

``compiled-padded`` is traced for its shapes instead, once per buffer
capacity rather than once per token: the stand-in holds mlx-lm's whole
buffers (capacity a multiple of 256 rows), writes the step's row at the
offset (an array) with ``mx.slice_update``, and attends over the whole
buffers with the rows past the offset masked out (``make_mask``, which
mlx-lm's ``create_attention_mask`` asks the cache for). The buffers grow
outside the trace as ``KVCache`` grows them. Exact only where masked
attention over the buffer gives the bits of attention over the written rows
(``bench/padded_attention_bits.py``); its bits are checked over
``CHECK_STEPS_PADDED`` steps, across a growth of the buffers.

``compiled-step-captured`` is the same replay with the model's arrays
captured in the trace (stale after any update: timing only, the cost of
reading them at each call); ``no-cache`` and ``no-cache-shapeless`` the
step without a cache (each token attends to itself: timing only) under
``mx.compile``, traced for its shape or shapeless. Each path's host call
(the graph building of a step, including the cache's slices and writes
around a replay) is timed apart. For the models of ``bench/layer_ceilings.py``,
paths round-robin per round, ratio to mlx-lm per round, median [range]:

    python3 bench/compiled_step_ceiling.py [--models qwen3-1024,llama-2048]
                                           [--rounds 7] [--steps 64] [--layers N]
"""

from __future__ import annotations

import argparse
import statistics

import mlx.core as mx

import layer_ceilings
from mlx_dualnorm.integrations import mlx_lm as integration


class _StepCache:
    """What one layer's attention sees of its cache inside the replay."""

    def __init__(self, offset: mx.array, keys: mx.array, values: mx.array) -> None:
        self.offset = offset
        self._past = (keys, values)
        self.written: tuple = ()

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.written = (keys, values)
        past_keys, past_values = self._past
        return (mx.concatenate([past_keys, keys], axis=2),
                mx.concatenate([past_values, values], axis=2))


class _PaddedStepCache:
    """One layer's cache inside the padded replay: mlx-lm's whole buffers,
    the step's row written at ``offset``, the rows past it masked."""

    def __init__(self, offset: mx.array, keys: mx.array, values: mx.array) -> None:
        self.offset = offset
        self.keys, self.values = keys, values

    def make_mask(self, length: int, return_array: bool = False, window_size=None):
        capacity = self.keys.shape[2]
        return (mx.arange(capacity) < self.offset + length)[None, None, None, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        start = mx.reshape(self.offset, (1,))
        self.keys = mx.slice_update(self.keys, keys, start, axes=(2,))
        self.values = mx.slice_update(self.values, values, start, axes=(2,))
        return self.keys, self.values


CHECK_STEPS_PADDED = 260  # past the first 256-row buffer of a 16-token prompt


def padded_decode(model, prompt, steps: int):
    """``timed_greedy`` of the padded replay (see the module's text)."""
    from mlx_lm.models.cache import make_prompt_cache

    def step(tokens, offset, buffers):
        caches = [_PaddedStepCache(offset, keys, values) for keys, values in buffers]
        logits = model(tokens, cache=caches)
        return logits, [(cache.keys, cache.values) for cache in caches]

    compiled = mx.compile(step, inputs=model.state)
    cache = make_prompt_cache(model)

    def forward(tokens):
        offset = cache[0].offset
        for layer_cache in cache:  # KVCache's own growth (a zero row written), outside the trace
            if offset + tokens.shape[1] > layer_cache.keys.shape[2]:
                layer_cache.update_and_fetch(mx.zeros_like(layer_cache.keys[..., :1, :]),
                                             mx.zeros_like(layer_cache.values[..., :1, :]))
                layer_cache.offset = offset
        buffers = [(layer_cache.keys, layer_cache.values) for layer_cache in cache]
        for layer_cache in cache:  # the trace's graph alone holds the old buffers
            layer_cache.keys = layer_cache.values = None
        logits, written = compiled(tokens, mx.array(offset, dtype=mx.int32), buffers)
        del buffers
        for layer_cache, (keys, values) in zip(cache, written):
            layer_cache.keys, layer_cache.values = keys, values
            layer_cache.offset = offset + tokens.shape[1]
        return logits

    return layer_ceilings.timed_greedy(forward, model(prompt, cache=cache), steps)


def replayed_step(model, captured: bool = False):
    """The replay; ``captured``: the model's arrays captured in the trace
    instead of read at each call (served stale after any update: timing
    only, the cost of reading them)."""

    def step(tokens, offset, pasts):
        caches = [_StepCache(offset, keys, values) for keys, values in pasts]
        logits = model(tokens, cache=caches)
        return logits, [cache.written for cache in caches]

    if captured:
        return mx.compile(step, shapeless=True)
    return mx.compile(step, inputs=model.state, shapeless=True)


def decode(model, prompt, steps: int, path: str):
    """``layer_ceilings.timed_greedy`` of ``path``'s step: the replay, the
    step without a cache compiled shapeless, or the paths of
    ``layer_ceilings.decode`` (``no-cache`` is its ``compiled-no-cache``)."""
    if path == "compiled-padded":
        return padded_decode(model, prompt, steps)
    if path == "no-cache-shapeless":  # timing only: each step attends to itself
        forward = mx.compile(model, shapeless=True)
        return layer_ceilings.timed_greedy(forward, forward(prompt), steps)
    if not path.startswith("compiled-step"):
        return layer_ceilings.decode(
            model, prompt, steps, "compiled-no-cache" if path == "no-cache" else path
        )
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    compiled = replayed_step(model, captured=path == "compiled-step-captured")

    def forward(tokens):
        offset = cache[0].offset
        pasts = [(c.keys[..., :offset, :], c.values[..., :offset, :]) for c in cache]
        logits, written = compiled(tokens, mx.array(offset, dtype=mx.int32), pasts)
        for c, (keys, values) in zip(cache, written):
            c.update_and_fetch(keys, values)
        return logits

    return layer_ceilings.timed_greedy(forward, model(prompt, cache=cache), steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3-1024,llama-2048")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--paths", help="paths to run (mlx-lm always); default: all")
    args = parser.parse_args()
    paths = ("mlx-lm", "patched", "compiled-padded", "compiled-step", "compiled-step-captured",
             "no-cache", "no-cache-shapeless")
    if args.paths:
        chosen = set(args.paths.split(",")) | {"mlx-lm"}
        paths = tuple(path for path in paths if path in chosen)
    print(f"MLX {mx.__version__} on {mx.default_device()}; {args.rounds} rounds of "
          f"{args.steps} steps, ms per step, ratio to mlx-lm per round: median [range]")
    for name in args.models.split(","):
        _, model, prompt = layer_ceilings.build(layer_ceilings.MODELS[name], args.layers)

        def run(path, steps, model=model):
            with integration.patch() if path == "patched" else integration.unpatch():
                return decode(model, prompt, steps, path)

        reference = run("mlx-lm", 24)[:2]
        for path in paths[1:]:
            if path.startswith("no-cache"):
                print(f"  {name} {path:22s} timing only")
                continue
            if path == "compiled-padded":  # checked across a growth of the buffers
                same = run(path, CHECK_STEPS_PADDED)[:2] == run("mlx-lm", CHECK_STEPS_PADDED)[:2]
                span = f"over {CHECK_STEPS_PADDED} steps: "
            else:
                same, span = run(path, 24)[:2] == reference, ""
            print(f"  {name} {path:22s} {span}"
                  f"{'tokens and log-probs bit-identical' if same else 'DIFFERS'}")
        times: dict[str, list[float]] = {path: [] for path in paths}
        host: dict[str, list[float]] = {path: [] for path in paths}
        for round_index in range(args.rounds):
            for path in paths if round_index % 2 == 0 else paths[::-1]:
                _, _, step_ms, host_us = run(path, args.steps)
                times[path].append(step_ms)
                host[path].append(host_us)
        for path in paths:
            ratios = [t / r for t, r in zip(times[path], times["mlx-lm"])]
            print(f"  {name} {path:22s} {statistics.median(times[path]):7.3f} ms  "
                  f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}]  "
                  f"host call {statistics.median(host[path]):8.1f} us")
        del model


if __name__ == "__main__":
    main()
