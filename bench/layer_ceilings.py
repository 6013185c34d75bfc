"""Device experiment: what is left of a decoder layer's host cost, and
what an exact compiled replay of part of it takes.

Times mlx-lm greedy decode (batch 1 unless ``--batch``, the prompt in
every row; random bfloat16 weights at released dimensions, quantized by
``nn.quantize`` with group size 64 under ``--bits 4``) of a qwen3 at Qwen3-0.6B's size and a llama at
Llama-3.2-1B's, paths round-robin within each round, ratios per round
against mlx-lm's own code:

  mlx-lm          mlx-lm as it is
  patched         ``mlx_dualnorm.integrations.mlx_lm.patch()``
  compiled-halves patched, with each layer as two compiled replays around
                  its attention: ``rms_norm`` and the q/k/v projections,
                  then the output projection, residual add and the MLP
                  half; the q/k prework, cache write and attention
                  between them as the patched path runs them (exact only
                  if the run finds the same bits; plain Linear only:
                  "n/a" under ``--bits 4``)
  safe-halves     compiled-halves with what a replacement inside the
                  package must read at each call: the classes' ``__call__``
                  and ``mx.fast``'s functions checked by identity, the exact
                  types of the norms and projections, no biases, each norm's
                  own eps and mlx-lm's ``swiglu`` read per call (the replay
                  keyed by them and by the quantization), every array read
                  from the module's dict and passed in (nothing served stale);
                  the RoPE alone (llama) through the package's RoPE-only call
  no-layer-norms  patched, with both residual-block RMS norms of every
                  decoder layer removed: the ceiling of fusing them into
                  their residual adds (wrong tokens; timing only)
  no-residual-adds  patched, with both residual adds of every decoder
                  layer removed, each norm taking the sublayer's output
                  alone: the node count of fusing every add into the RMS
                  norm that follows it, the last layer's and the next
                  layer's input norm included (wrong tokens; timing only)
  no-attention-add  the same with only ``h = x + attn(...)`` removed: the
                  add a decoder-layer replacement could fuse into its own
                  post-attention norm (wrong tokens; timing only)
  compiled-mlp    patched, with each layer's ``h + mlp(norm(h))`` one
                  ``mx.compile`` replay whose inputs are the layer's
                  arrays of this call (nothing served stale from the
                  trace); exact only if its tokens and logits are the
                  patched path's bits, which the run checks (plain
                  Linear only: "n/a" under ``--bits 4``)
  compiled-residual-mlp  patched, with the attention call as it is and then
                  ``h = x + r; out = h + down(swiglu(gate(n), up(n)))``,
                  ``n = rms_norm(h)``, one ``mx.compile`` replay of the
                  layer's arrays (mlx-lm's ``swiglu`` inside; each
                  projection ``n @ W.T``, or ``mx.quantized_matmul`` of
                  its weight, scales and biases when quantized), cached
                  per (eps, quantization); checked as ``compiled-mlp`` is
  step-no-cache   each decode step without a KV cache (attends to itself
                  only; timing only): the cache handling's share
  compiled-no-cache  the same step under ``mx.compile`` of the whole model:
                  the ceiling of replaying a whole step

Before timing, every exact path's tokens and per-step log-probabilities
are compared bit for bit with mlx-lm's; the timing-only paths say so.

    python3 bench/layer_ceilings.py [--models qwen3-1024,llama-2048] [--rounds 5] [--steps 64]
                                    [--layers N] [--bits 0|4] [--batch N] [--paths a,b,..]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_dualnorm.integrations import mlx_lm as integration
# The package's own q/k prework and attention step, for the replays around
# them (internals: this experiment restates a layer the package does not
# replace yet).
from mlx_dualnorm.integrations.mlx_lm import cache_update, norm_rope
from mlx_lm.models.activations import swiglu

MODELS = {
    # Qwen3-0.6B's dimensions.
    "qwen3-1024": {
        "model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28,
        "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-6, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
    },
    # Llama-3.2-1B's dimensions (its RoPE scaling left out: plain RoPE).
    "llama-2048": {
        "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
        "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "rms_norm_eps": 1e-5, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500_000.0,
        "tie_word_embeddings": True,
    },
}
PROMPT_TOKENS = 16
EXACT_PATHS = (
    "mlx-lm", "patched", "compiled-mlp", "compiled-residual-mlp", "compiled-halves", "safe-halves",
)
PATHS = EXACT_PATHS + (
    "no-layer-norms", "no-residual-adds", "no-attention-add", "step-no-cache", "compiled-no-cache"
)


def build(config: dict, layers: int | None, bits: int = 0, batch: int = 1):
    config = dict(config, **({"num_hidden_layers": layers} if layers else {}))
    architecture = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    model = architecture.Model(architecture.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
    mx.eval(model.parameters())
    model.eval()
    prompt = np.random.default_rng(0).integers(0, config["vocab_size"], PROMPT_TOKENS)
    prompt = mx.array(np.tile(prompt, (batch, 1)))
    return architecture, model, prompt


def _mlp_half(eps: float):
    """``h + down(silu(gate(n)) * up(n))`` with ``n = rms_norm(h)``: the
    second half of a qwen3 / llama decoder layer, as its modules compute
    it, compiled once per eps; every array is an input of each call."""

    def half(h, norm_weight, gate_weight, up_weight, down_weight):
        normed = mx.fast.rms_norm(h, norm_weight, eps)
        gate = normed @ gate_weight.T
        up = normed @ up_weight.T
        return h + (nn.silu(gate) * up) @ down_weight.T

    return mx.compile(half)


_compiled_halves: dict = {}


def compiled_mlp_block(self, x, mask=None, cache=None):
    h = x + self.self_attn(self.input_layernorm(x), mask, cache)
    norm, mlp = self.post_attention_layernorm, self.mlp
    half = _compiled_halves.get(norm.eps)
    if half is None:
        half = _compiled_halves[norm.eps] = _mlp_half(norm.eps)
    return half(h, norm.weight, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)


def _residual_mlp(key: tuple):
    """``h = x + r`` and the MLP half after it (see the module doc) as one
    compiled replay; ``key`` is (eps,) for plain Linear projections,
    (eps, group_size, bits, mode) for quantized ones, whose weights then
    come as (weight, scales, biases) triples."""
    eps = key[0]
    if len(key) == 1:
        project = lambda n, w: n @ w.T  # noqa: E731
    else:
        _, group_size, bits, mode = key

        def project(n, w):
            weight, scales, biases = w
            return mx.quantized_matmul(n, weight, scales=scales, biases=biases, transpose=True,
                                       group_size=group_size, bits=bits, mode=mode)

    def replay(x, r, norm_weight, gate, up, down):
        h = x + r
        n = mx.fast.rms_norm(h, norm_weight, eps)
        return h + project(swiglu(project(n, gate), project(n, up)), down)

    return mx.compile(replay)


_compiled_residual: dict = {}


def _projection(linear):
    if isinstance(linear, nn.QuantizedLinear):
        return (linear.group_size, linear.bits, linear.mode), (
            linear["weight"], linear["scales"], linear.get("biases"))
    return (), linear.weight


def compiled_residual_mlp_block(self, x, mask=None, cache=None):
    r = self.self_attn(self.input_layernorm(x), mask, cache)
    norm, mlp = self.post_attention_layernorm, self.mlp
    quantization, gate = _projection(mlp.gate_proj)
    _, up = _projection(mlp.up_proj)
    _, down = _projection(mlp.down_proj)
    key = (norm.eps, *quantization)
    replay = _compiled_residual.get(key)
    if replay is None:
        replay = _compiled_residual[key] = _residual_mlp(key)
    return replay(x, r, norm.weight, gate, up, down)


def _halves(eps: float):
    """The two replays of a layer around its attention (see the module
    doc), compiled once per eps."""

    def before(x, norm_weight, query_weight, key_weight, value_weight):
        normed = mx.fast.rms_norm(x, norm_weight, eps)
        return normed @ query_weight.T, normed @ key_weight.T, normed @ value_weight.T

    def after(x, attended, output_weight, norm_weight, gate_weight, up_weight, down_weight):
        h = x + attended @ output_weight.T
        normed = mx.fast.rms_norm(h, norm_weight, eps)
        return h + (nn.silu(normed @ gate_weight.T) * (normed @ up_weight.T)) @ down_weight.T

    return mx.compile(before), mx.compile(after)


_compiled_around: dict = {}


def compiled_halves_block(self, x, mask=None, cache=None):
    attention, mlp = self.self_attn, self.mlp
    eps = self.input_layernorm.eps
    halves = _compiled_around.get(eps)
    if halves is None:
        halves = _compiled_around[eps] = _halves(eps)
    before, after = halves
    batch, length, _ = x.shape
    queries, keys, values = before(
        x, self.input_layernorm.weight, attention.q_proj.weight, attention.k_proj.weight,
        attention.v_proj.weight,
    )
    heads, kv_heads = attention.n_heads, attention.n_kv_heads
    queries = queries.reshape(batch, length, heads, -1)
    keys = keys.reshape(batch, length, kv_heads, -1)
    values = values.reshape(batch, length, kv_heads, -1)
    prepared = None
    if "q_norm" in attention:  # qwen3: the package's norm + RoPE + cache write
        prepared = cache_update.prework_and_cache_update(
            norm_rope.layer_prework(attention), queries, keys, values, cache
        )
    if prepared is None:  # llama: mlx-lm's RoPE and cache update
        queries = attention.rope(queries.transpose(0, 2, 1, 3), offset=cache.offset)
        keys = attention.rope(keys.transpose(0, 2, 1, 3), offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values.transpose(0, 2, 1, 3))
    else:
        queries, keys, values = prepared
    attended = cache_update.attended(attention, queries, keys, values, cache, mask, batch, length)
    return after(
        x, attended, attention.o_proj.weight, self.post_attention_layernorm.weight,
        mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
    )


def _safe_halves(key: tuple):
    """The two replays of ``safe_halves_block``; ``key`` is (input eps,
    post-attention eps, swiglu, quantization), the quantization () for
    plain Linear or (group_size, bits, mode), whose projections then take
    (weight, scales, biases) triples."""
    input_eps, post_eps, activation, quantization = key
    if not quantization:
        project = lambda n, w: n @ w.T  # noqa: E731
    else:
        group_size, bits, mode = quantization

        def project(n, w):
            weight, scales, biases = w
            return mx.quantized_matmul(n, weight, scales=scales, biases=biases, transpose=True,
                                       group_size=group_size, bits=bits, mode=mode)

    def before(x, norm_weight, query, key, value):
        normed = mx.fast.rms_norm(x, norm_weight, input_eps)
        return project(normed, query), project(normed, key), project(normed, value)

    def after(x, attended, output, norm_weight, gate, up, down):
        h = x + project(attended, output)
        normed = mx.fast.rms_norm(h, norm_weight, post_eps)
        return h + project(activation(project(normed, gate), project(normed, up)), down)

    return mx.compile(before), mx.compile(after)


_safe_replays: dict = {}
_SAFE_CHECKS: list = []  # (owner, attribute, value) as decided; read at every call
_ORIGINAL_BLOCKS: dict = {}  # block class -> its own __call__, for every fallback


def _decide_safe_checks(architecture) -> None:
    """What the replay restates, held by identity: checked at every call,
    so a class or function replaced after the first call is followed."""
    owners = (architecture.Attention, architecture.MLP, nn.RMSNorm, nn.Linear, nn.QuantizedLinear)
    _SAFE_CHECKS[:] = [
        *((owner, "__call__", owner.__call__) for owner in owners),
        *((owner.__call__, "__code__", owner.__call__.__code__) for owner in owners),
        (mx.fast, "rms_norm", mx.fast.rms_norm), (mx.fast, "rope", mx.fast.rope),
    ]


def _safe_projection(linear):
    """(quantization, arrays) of a projection read as its class reads it,
    or None where its type or a bias is not what the replay computes."""
    kind = type(linear)
    if kind is nn.Linear and "bias" not in linear:
        return (), linear["weight"]
    if kind is nn.QuantizedLinear and "bias" not in linear:
        return (linear.group_size, linear.bits, linear.mode), (
            linear["weight"], linear["scales"], linear.get("biases"))
    return None


def safe_halves_block(self, x, mask=None, cache=None):
    for owner, attribute, value in _SAFE_CHECKS:
        if getattr(owner, attribute, None) is not value:
            return _ORIGINAL_BLOCKS[type(self)](self, x, mask, cache)
    get = dict.get
    attention, mlp = get(self, "self_attn"), get(self, "mlp")
    input_norm, post_norm = get(self, "input_layernorm"), get(self, "post_attention_layernorm")
    projections = [
        _safe_projection(get(owner, name))
        for owner, name in ((attention, "q_proj"), (attention, "k_proj"), (attention, "v_proj"),
                            (attention, "o_proj"), (mlp, "gate_proj"), (mlp, "up_proj"),
                            (mlp, "down_proj"))
    ]
    if (cache is None or type(input_norm) is not nn.RMSNorm or type(post_norm) is not nn.RMSNorm
            or any(p is None for p in projections)
            or len({p[0] for p in projections}) != 1):
        return _ORIGINAL_BLOCKS[type(self)](self, x, mask, cache)
    activation = type(mlp).__call__.__globals__.get("swiglu")
    key = (input_norm.eps, post_norm.eps, activation, projections[0][0])
    replays = _safe_replays.get(key)
    if replays is None:
        replays = _safe_replays[key] = _safe_halves(key)
    before, after = replays
    query, key_, value, output, gate, up, down = (p[1] for p in projections)
    batch, length, _ = x.shape
    queries, keys, values = before(x, input_norm["weight"], query, key_, value)
    queries = queries.reshape(batch, length, attention.n_heads, -1)
    keys = keys.reshape(batch, length, attention.n_kv_heads, -1)
    values = values.reshape(batch, length, attention.n_kv_heads, -1)
    if "q_norm" in attention:  # qwen3: the package's norm + RoPE + cache write
        prework = norm_rope.layer_prework(attention)
    else:  # llama: the package's RoPE-only call + cache write
        prework = norm_rope.LayerPrework(attention["rope"], None, None, None, None, None)
    prepared = cache_update.prework_and_cache_update(prework, queries, keys, values, cache)
    if prepared is None:  # the attention's prework is not what the package computes
        return _ORIGINAL_BLOCKS[type(self)](self, x, mask, cache)
    queries, keys, values = prepared
    attended = cache_update.attended(attention, queries, keys, values, cache, mask, batch, length)
    return after(x, attended, output, post_norm["weight"], gate, up, down)


def block_without_norms(self, x, mask=None, cache=None):
    h = x + self.self_attn(x, mask, cache)
    return h + self.mlp(h)


def block_without_adds(self, x, mask=None, cache=None):
    h = self.self_attn(self.input_layernorm(x), mask, cache)
    return self.mlp(self.post_attention_layernorm(h))


def block_without_attention_add(self, x, mask=None, cache=None):
    h = self.self_attn(self.input_layernorm(x), mask, cache)
    return h + self.mlp(self.post_attention_layernorm(h))


@contextlib.contextmanager
def path_of(architecture, path: str):
    block = architecture.TransformerBlock
    original = block.__call__
    with integration.unpatch() if path == "mlx-lm" else integration.patch():
        if path == "compiled-mlp":
            block.__call__ = compiled_mlp_block
        elif path == "compiled-residual-mlp":
            block.__call__ = compiled_residual_mlp_block
        elif path == "compiled-halves":
            block.__call__ = compiled_halves_block
        elif path == "safe-halves":
            _ORIGINAL_BLOCKS[block] = original
            _decide_safe_checks(architecture)
            block.__call__ = safe_halves_block
        elif path == "no-layer-norms":
            block.__call__ = block_without_norms
        elif path == "no-residual-adds":
            block.__call__ = block_without_adds
        elif path == "no-attention-add":
            block.__call__ = block_without_attention_add
        try:
            yield
        finally:
            block.__call__ = original


def decode(model, prompt, steps: int, path: str):
    """:func:`timed_greedy` of ``path``'s step (a step without a cache for
    the no-cache paths, else mlx-lm's ``model`` with a prompt cache)."""
    if path in ("step-no-cache", "compiled-no-cache"):
        forward = mx.compile(model) if path == "compiled-no-cache" else model
        step = lambda tokens: forward(tokens)  # noqa: E731
        logits = forward(prompt)
    else:
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        step = lambda tokens: model(tokens, cache=cache)  # noqa: E731
        logits = model(prompt, cache=cache)
    return timed_greedy(step, logits, steps)


def timed_greedy(step, logits, steps: int):
    """Greedy decode from the prompt's ``logits``, ``step(tokens)`` giving
    each next step's: (token ids, a hash per step of its log-probabilities'
    bits, median ms per step, median us of the host's ``step`` call),
    pipelined as mlx-lm's generate_step is."""
    logprobs = logits[:, -1] - mx.logsumexp(logits[:, -1], keepdims=True)
    token = mx.argmax(logprobs, axis=-1)
    mx.async_eval(token, logprobs)
    tokens, hashes, seconds, host = [], [], [], []
    previous = time.perf_counter()
    for _ in range(steps + 1):
        started = time.perf_counter()
        logits = step(token[:, None])
        host.append(time.perf_counter() - started)
        next_logprobs = logits[:, -1] - mx.logsumexp(logits[:, -1], keepdims=True)
        next_token = mx.argmax(next_logprobs, axis=-1)
        mx.async_eval(next_token, next_logprobs)
        tokens.append(tuple(token.tolist()))
        hashes.append(hashlib.sha1(np.array(logprobs.view(mx.uint16)).tobytes()).hexdigest()[:12])
        now = time.perf_counter()
        if len(tokens) > 1:
            seconds.append(now - previous)
        previous = now
        token, logprobs = next_token, next_logprobs
    return tokens, hashes, 1e3 * statistics.median(seconds), 1e6 * statistics.median(host)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3-1024,llama-2048")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--layers", type=int, help="fewer layers (a dry run on CPU)")
    parser.add_argument("--bits", type=int, default=0, help="0: bfloat16; 4: nn.quantize, group 64")
    parser.add_argument("--batch", type=int, default=1, help="rows, each the same prompt")
    parser.add_argument("--paths", default=",".join(PATHS), help="paths to run (mlx-lm always)")
    args = parser.parse_args()
    chosen = set(args.paths.split(",")) | {"mlx-lm"}
    if args.bits:  # compiled-halves and compiled-mlp read plain Linear weights
        chosen -= {"compiled-halves", "compiled-mlp"}
    paths = tuple(path for path in PATHS if path in chosen)
    print(f"MLX {mx.__version__} on {mx.default_device()}; bits {args.bits or 'bf16'}, batch "
          f"{args.batch}; {args.rounds} rounds of {args.steps} steps, ms per decode token, ratio to mlx-lm per round: median [range]")
    for name in args.models.split(","):
        architecture, model, prompt = build(MODELS[name], args.layers, args.bits, args.batch)
        reference = None
        for path in PATHS:
            if path not in paths:
                if args.bits and path in ("compiled-halves", "compiled-mlp"):
                    print(f"  {name} {path:21s} n/a (plain Linear only)")
                continue
            with path_of(architecture, path):
                tokens, hashes = decode(model, prompt, min(args.steps, 16), path)[:2]
            if path == "mlx-lm":
                reference = (tokens, hashes)
            verdict = "timing only"
            if path in EXACT_PATHS:
                same = (tokens, hashes) == reference
                verdict = "tokens and log-probs bit-identical" if same else (
                    f"DIFFERS (tokens equal: {tokens == reference[0]})")
            print(f"  {name} {path:21s} {verdict}")
        times: dict[str, list[float]] = {path: [] for path in paths}
        for round_index in range(args.rounds):
            for path in paths if round_index % 2 == 0 else paths[::-1]:
                with path_of(architecture, path):
                    times[path].append(decode(model, prompt, args.steps, path)[2])
        for path in paths:
            ratios = [t / r for t, r in zip(times[path], times["mlx-lm"])]
            print(f"  {name} {path:21s} {statistics.median(times[path]):7.3f} ms  "
                  f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}]")
        del model


if __name__ == "__main__":
    main()
