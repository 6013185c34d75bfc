"""Greedy-decode replay: a dual head norm path inside a small model.

The parity harness checks the norm in isolation; this replay checks it the
way a model uses it. A small deterministic decoder in the shape of a
Qwen3-Next / Qwen3.5 hybrid (three gated-delta layers, then one full
attention layer) runs its query/key head norms through the path under test
and greedily decodes; the run is repeated with the composed path
(two ``mx.fast.rms_norm`` calls) and the two are compared: the token ids,
the final hidden state bit for bit, and the first step whose hidden state
differs in any bit.

What keeps it honest about the real thing, while staying under a few
seconds on two CPU cores:

- the head widths are the real ones: 128 for the gated-delta q/k heads,
  normalized weightless as mlx-lm does (``rms_norm(x, None, 1e-6)``, then
  scaled by 1/d and 1/sqrt(d)), and 256 for the full-attention heads,
  normalized with q/k norm weights (4 query heads sharing 1 key head);
- the norms see prefill shapes (the prompt at once) and decode shapes (one
  token per step), in bfloat16 by default;
- the gated-delta recurrence is the delta rule with a per-head decay and
  write strength: ``S = g * S``, ``S += k (beta * (v - S^T k))^T``,
  ``o = S^T q``, state kept in float32;
- everything else (embedding, widths, vocabulary of 512) is small, and every
  weight comes from one fixed ``mx.random.key``.

Hidden-state bits are a far finer detector than tokens: a path that is off
by one ulp in one element changes the hidden state at once, while the
argmax may hold for the whole run.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence, cast

import mlx.core as mx

from mlx_dualnorm.bits import bit_difference_mask
from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.paths import (
    REFERENCE_PATH,
    DualNormPath,
    DualNormPathFactory,
    PathSelection,
    build_path,
    describe_paths,
    make_composed_path,
    routinely_checked_paths,
    skipped_path_lines,
    unavailable_paths,
)

__all__ = [
    "DEFAULT_DECODE_STEPS",
    "GreedyDecodeTrace",
    "ReplayComparison",
    "ReplayModelConfig",
    "ReplayReport",
    "build_parser",
    "build_replay_model",
    "compare_decode_traces",
    "format_replay_report",
    "greedy_decode",
    "main",
    "run_replay",
]

DEFAULT_DECODE_STEPS = 128
PATH_FACTORIES: dict[str, DualNormPathFactory] = routinely_checked_paths()
"""The paths replayed when none is named (see tools.compared_paths)."""
GATED_DELTA_LAYER = "gated_delta"
FULL_ATTENTION_LAYER = "full_attention"


@dataclass(frozen=True)
class ReplayModelConfig:
    """The replay model's shape. Head widths are the production ones; the
    rest is as small as keeps every code path meaningful."""

    vocabulary_size: int = 512
    model_width: int = 256
    layer_kinds: tuple[str, ...] = (
        GATED_DELTA_LAYER,
        GATED_DELTA_LAYER,
        GATED_DELTA_LAYER,
        FULL_ATTENTION_LAYER,
    )
    gated_delta_key_heads: int = 2
    gated_delta_value_heads: int = 4  # two value heads per q/k head, as in Qwen3-Next
    gated_delta_head_width: int = 128
    gated_delta_value_width: int = 64
    attention_query_heads: int = 4
    attention_key_value_heads: int = 1
    attention_head_width: int = 256
    attention_rotary_width: int = 64  # partial rotary, as in Qwen3-Next
    rms_norm_eps: float = 1e-6
    dtype: mx.Dtype = mx.bfloat16
    prompt_length: int = 8
    seed: int = 20261129


# ---- Weights ----------------------------------------------------------------------


def _parameter_shapes(config: ReplayModelConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, initialization) for every weight, in a fixed order:
    the order is what ties each weight to its slice of the seed."""
    width = config.model_width
    shapes: list[tuple[str, tuple[int, ...], str]] = [
        ("embedding", (config.vocabulary_size, width), "embedding"),
    ]
    for layer_index, layer_kind in enumerate(config.layer_kinds):
        prefix = f"layers.{layer_index}."
        shapes.append((prefix + "input_norm_weight", (width,), "norm_weight"))
        if layer_kind == GATED_DELTA_LAYER:
            key_projection_width = config.gated_delta_key_heads * config.gated_delta_head_width
            value_projection_width = config.gated_delta_value_heads * config.gated_delta_value_width
            value_heads = config.gated_delta_value_heads
            shapes += _query_key_value_shapes(
                prefix, width, key_projection_width, key_projection_width, value_projection_width
            )
            shapes += [
                (prefix + "decay_projection", (width, value_heads), "projection"),
                (prefix + "write_strength_projection", (width, value_heads), "projection"),
                (prefix + "decay_log_rate", (value_heads,), "decay_log_rate"),
                (prefix + "decay_time_bias", (value_heads,), "small"),
                (prefix + "output_projection", (value_projection_width, width), "projection"),
            ]
        elif layer_kind == FULL_ATTENTION_LAYER:
            head_width = config.attention_head_width
            query_projection_width = config.attention_query_heads * head_width
            key_value_projection_width = config.attention_key_value_heads * head_width
            shapes += _query_key_value_shapes(
                prefix, width, query_projection_width, key_value_projection_width,
                key_value_projection_width,
            )
            shapes += [
                (prefix + "query_norm_weight", (head_width,), "norm_weight"),
                (prefix + "key_norm_weight", (head_width,), "norm_weight"),
                (prefix + "output_projection", (query_projection_width, width), "projection"),
            ]
        else:
            raise ValueError(f"unknown layer kind {layer_kind!r}")
    shapes += [
        ("final_norm_weight", (width,), "norm_weight"),
        ("language_model_head", (width, config.vocabulary_size), "projection"),
    ]
    return shapes


def _query_key_value_shapes(
    prefix: str, width: int, query_width: int, key_width: int, value_width: int
) -> list[tuple[str, tuple[int, ...], str]]:
    """The first weights of every layer kind: its query, key and value
    projections, in that order."""
    return [
        (prefix + "query_projection", (width, query_width), "projection"),
        (prefix + "key_projection", (width, key_width), "projection"),
        (prefix + "value_projection", (width, value_width), "projection"),
    ]


def build_replay_model(config: ReplayModelConfig = ReplayModelConfig()) -> dict[str, mx.array]:
    """Every weight of the replay model, from ``mx.random.key(config.seed)``."""
    shapes = _parameter_shapes(config)
    parameter_keys = mx.random.split(mx.random.key(config.seed), len(shapes))
    parameters = {}
    for (name, shape, initialization), parameter_key in zip(shapes, parameter_keys):
        standard_normal = mx.random.normal(shape, key=parameter_key)
        if initialization == "embedding":
            value = standard_normal
        elif initialization == "projection":
            value = standard_normal * (shape[0] ** -0.5)
        elif initialization == "norm_weight":
            value = 1.0 + 0.1 * standard_normal
        elif initialization == "decay_log_rate":
            # log of rates in about [0.4, 2.7]: decays from near 1 to ~0.1.
            value = 0.3 * standard_normal
        elif initialization == "small":
            value = 0.1 * standard_normal
        else:
            raise AssertionError(f"unhandled initialization {initialization!r}")
        parameters[name] = value.astype(config.dtype)
    mx.eval(parameters)
    return parameters


# ---- The model ----------------------------------------------------------------------


@dataclass
class _LayerCache:
    """A gated-delta layer's recurrent state, or an attention layer's keys
    and values so far."""

    recurrent_state: Optional[mx.array] = None
    cached_keys: Optional[mx.array] = None
    cached_values: Optional[mx.array] = None

    def arrays(self) -> list[mx.array]:
        return [
            array
            for array in (self.recurrent_state, self.cached_keys, self.cached_values)
            if array is not None
        ]


@dataclass(frozen=True)
class _MixerInput:
    """What one layer's mixer reads: its normalized input, its weights (the
    model's under ``prefix``), its cache, and the path under test."""

    normalized_input: mx.array
    parameters: Mapping[str, mx.array]
    prefix: str
    cache: _LayerCache
    config: ReplayModelConfig
    dual_head_norm: DualNormPath

    def weight(self, name: str) -> mx.array:
        return self.parameters[self.prefix + name]

    def query_key_value(
        self, query_heads: int, key_heads: int, value_heads: int
    ) -> tuple[mx.array, mx.array, mx.array]:
        """The query, key and value projections of the input, each split
        into its heads: ``(batch, sequence, heads, projection width / heads)``."""
        batch, sequence_length, _ = self.normalized_input.shape

        def heads_of(projection: str, heads: int) -> mx.array:
            projected = self.normalized_input @ self.weight(projection)
            return projected.reshape(batch, sequence_length, heads, -1)

        return (
            heads_of("query_projection", query_heads),
            heads_of("key_projection", key_heads),
            heads_of("value_projection", value_heads),
        )


def _gated_delta_mixer(layer: _MixerInput) -> mx.array:
    normalized_input, cache, config = layer.normalized_input, layer.cache, layer.config
    batch, sequence_length, _ = normalized_input.shape
    key_heads = config.gated_delta_key_heads
    value_heads = config.gated_delta_value_heads
    head_width = config.gated_delta_head_width
    value_width = config.gated_delta_value_width

    queries, keys, values = layer.query_key_value(key_heads, key_heads, value_heads)
    # The path under test, as mlx-lm's gated-delta layers call it:
    # weightless, then scaled (queries by 1/d, keys by 1/sqrt(d)).
    normalized_queries, normalized_keys = layer.dual_head_norm(queries, keys, None, None)
    inverse_scale = head_width**-0.5
    scaled_queries = normalized_queries * (inverse_scale * inverse_scale)
    scaled_keys = normalized_keys * inverse_scale
    value_heads_per_key_head = value_heads // key_heads
    scaled_queries = mx.repeat(scaled_queries, value_heads_per_key_head, axis=2).astype(mx.float32)
    scaled_keys = mx.repeat(scaled_keys, value_heads_per_key_head, axis=2).astype(mx.float32)
    values = values.astype(mx.float32)

    decay_input = (normalized_input @ layer.weight("decay_projection")).astype(mx.float32)
    decay_rate = mx.exp(layer.weight("decay_log_rate").astype(mx.float32))
    decay_time_bias = layer.weight("decay_time_bias").astype(mx.float32)
    softplus = mx.logaddexp(decay_input + decay_time_bias, 0.0)
    decay = mx.exp(-decay_rate * softplus)  # (batch, sequence, value heads), in (0, 1)
    write_strength = mx.sigmoid(
        (normalized_input @ layer.weight("write_strength_projection")).astype(mx.float32)
    )

    state = cache.recurrent_state
    if state is None:
        state = mx.zeros((batch, value_heads, head_width, value_width), dtype=mx.float32)
    step_outputs = []
    for position in range(sequence_length):
        step_key = scaled_keys[:, position, :, :, None]  # (batch, heads, head width, 1)
        state = state * decay[:, position, :, None, None]
        remembered_values = (state * step_key).sum(axis=-2)
        step_write_strength = write_strength[:, position, :, None]
        correction = (values[:, position] - remembered_values) * step_write_strength
        state = state + step_key * correction[:, :, None, :]
        step_outputs.append((state * scaled_queries[:, position, :, :, None]).sum(axis=-2))
    cache.recurrent_state = state
    mixed = mx.stack(step_outputs, axis=1).astype(config.dtype)
    return mixed.reshape(batch, sequence_length, value_heads * value_width) @ layer.weight(
        "output_projection"
    )


def _full_attention_mixer(layer: _MixerInput) -> mx.array:
    cache, config = layer.cache, layer.config
    batch, sequence_length, _ = layer.normalized_input.shape
    head_width = config.attention_head_width
    key_value_heads = config.attention_key_value_heads
    queries, keys, values = layer.query_key_value(
        config.attention_query_heads, key_value_heads, key_value_heads
    )
    # The path under test with q/k norm weights, as full-attention layers use it.
    normalized_queries, normalized_keys = layer.dual_head_norm(
        queries, keys, layer.weight("query_norm_weight"), layer.weight("key_norm_weight")
    )
    position_offset = 0 if cache.cached_keys is None else cache.cached_keys.shape[2]

    def rotated(normalized: mx.array) -> mx.array:
        """Head-major, RoPE at the cache's position."""
        return mx.fast.rope(
            normalized.transpose(0, 2, 1, 3),
            config.attention_rotary_width,
            traditional=False,
            base=10000.0,
            scale=1.0,
            offset=position_offset,
        )

    rotated_queries, rotated_keys = rotated(normalized_queries), rotated(normalized_keys)
    head_major_values = values.transpose(0, 2, 1, 3)
    if cache.cached_keys is not None and cache.cached_values is not None:
        rotated_keys = mx.concatenate([cache.cached_keys, rotated_keys], axis=2)
        head_major_values = mx.concatenate([cache.cached_values, head_major_values], axis=2)
    cache.cached_keys, cache.cached_values = rotated_keys, head_major_values
    attended = mx.fast.scaled_dot_product_attention(
        rotated_queries,
        rotated_keys,
        head_major_values,
        scale=head_width**-0.5,
        mask="causal" if sequence_length > 1 else None,
    )
    attended = attended.transpose(0, 2, 1, 3).reshape(
        batch, sequence_length, config.attention_query_heads * head_width
    )
    return attended @ layer.weight("output_projection")


def _forward(
    token_ids: mx.array,
    parameters: Mapping[str, mx.array],
    caches: Sequence[_LayerCache],
    config: ReplayModelConfig,
    dual_head_norm: DualNormPath,
) -> tuple[mx.array, mx.array]:
    """(logits, final normalized hidden states) for ``token_ids`` of shape
    ``(batch, sequence)``, advancing the caches."""
    hidden = parameters["embedding"][token_ids]
    for layer_index, (layer_kind, cache) in enumerate(zip(config.layer_kinds, caches)):
        prefix = f"layers.{layer_index}."
        normalized_input = mx.fast.rms_norm(
            hidden, parameters[prefix + "input_norm_weight"], config.rms_norm_eps
        )
        mixer = _gated_delta_mixer if layer_kind == GATED_DELTA_LAYER else _full_attention_mixer
        hidden = hidden + mixer(
            _MixerInput(normalized_input, parameters, prefix, cache, config, dual_head_norm)
        )
    final_hidden = mx.fast.rms_norm(hidden, parameters["final_norm_weight"], config.rms_norm_eps)
    return final_hidden @ parameters["language_model_head"], final_hidden


# ---- Decoding and comparing ---------------------------------------------------------


@dataclass(frozen=True)
class GreedyDecodeTrace:
    """One greedy decode: the tokens, and the final normalized hidden state
    that chose each token, stacked ``(steps, model_width)``."""

    path_name: str
    token_ids: tuple[int, ...]
    step_hidden_states: mx.array
    elapsed_seconds: float

    @property
    def final_hidden_state(self) -> mx.array:
        return self.step_hidden_states[-1]


def _prompt_token_ids(config: ReplayModelConfig) -> mx.array:
    prompt_key = mx.random.key(config.seed ^ 0x9E3779B9)
    return mx.random.randint(0, config.vocabulary_size, (1, config.prompt_length), key=prompt_key)


def greedy_decode(
    dual_head_norm: DualNormPath,
    parameters: Mapping[str, mx.array],
    config: ReplayModelConfig = ReplayModelConfig(),
    *,
    steps: int = DEFAULT_DECODE_STEPS,
    path_name: str = "path under test",
    progress: Optional[Callable[[str], None]] = None,
) -> GreedyDecodeTrace:
    """Prefills the fixed prompt, then picks ``steps`` tokens by argmax,
    evaluating once per token as a server would; ``progress`` hears of
    each token."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    started = time.perf_counter()
    caches = [_LayerCache() for _ in config.layer_kinds]
    logits, final_hidden = _forward(
        _prompt_token_ids(config), parameters, caches, config, dual_head_norm
    )
    token_ids: list[int] = []
    step_hidden_states: list[mx.array] = []
    for step in range(steps):
        next_token = mx.argmax(logits[:, -1, :], axis=-1)
        chooser_hidden = final_hidden[0, -1, :]
        cached_arrays = [array for cache in caches for array in cache.arrays()]
        mx.eval(next_token, chooser_hidden, *cached_arrays)
        token_ids.append(int(next_token))
        step_hidden_states.append(chooser_hidden)
        if progress is not None:
            progress(f"{path_name} token {step + 1}/{steps}")
        if step + 1 < steps:
            logits, final_hidden = _forward(
                next_token[:, None], parameters, caches, config, dual_head_norm
            )
    stacked_hidden_states = mx.stack(step_hidden_states)
    mx.eval(stacked_hidden_states)
    return GreedyDecodeTrace(
        path_name, tuple(token_ids), stacked_hidden_states, time.perf_counter() - started
    )


@dataclass(frozen=True)
class ReplayComparison:
    """A path's decode against the composed path's."""

    path_name: str
    steps: int
    tokens_identical: bool
    final_hidden_state_identical: bool
    first_divergent_token_step: Optional[int]
    first_divergent_hidden_step: Optional[int]
    elapsed_seconds: float = 0.0

    @property
    def diverged(self) -> bool:
        return not self.tokens_identical or self.first_divergent_hidden_step is not None

    @property
    def first_divergence_step(self) -> Optional[int]:
        steps = [
            step
            for step in (self.first_divergent_token_step, self.first_divergent_hidden_step)
            if step is not None
        ]
        return min(steps) if steps else None


def compare_decode_traces(
    trace: GreedyDecodeTrace, reference: GreedyDecodeTrace
) -> ReplayComparison:
    """Tokens compared as ids; hidden states compared as bit patterns (a
    NaN equals only the same NaN), step by step."""
    steps = min(len(trace.token_ids), len(reference.token_ids))
    first_divergent_token_step = next(
        (
            step
            for step in range(steps)
            if trace.token_ids[step] != reference.token_ids[step]
        ),
        None,
    )
    tokens_identical = trace.token_ids == reference.token_ids
    first_divergent_hidden_step: Optional[int] = None
    final_hidden_state_identical = False
    if (
        trace.step_hidden_states.shape == reference.step_hidden_states.shape
        and trace.step_hidden_states.dtype == reference.step_hidden_states.dtype
    ):
        # The hidden states are (steps, width): one flag per step.
        rows_differ = cast(
            list[bool],
            mx.any(
                bit_difference_mask(trace.step_hidden_states, reference.step_hidden_states),
                axis=-1,
            ).tolist(),
        )
        first_divergent_hidden_step = next(
            (step for step, differs in enumerate(rows_differ) if differs), None
        )
        final_hidden_state_identical = not rows_differ[-1]
    else:
        first_divergent_hidden_step = 0
    return ReplayComparison(
        path_name=trace.path_name,
        steps=steps,
        tokens_identical=tokens_identical,
        final_hidden_state_identical=final_hidden_state_identical,
        first_divergent_token_step=first_divergent_token_step,
        first_divergent_hidden_step=first_divergent_hidden_step,
        elapsed_seconds=trace.elapsed_seconds,
    )


@dataclass
class ReplayReport:
    config: ReplayModelConfig
    steps: int
    reference: GreedyDecodeTrace
    comparisons: list[ReplayComparison] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(not comparison.diverged for comparison in self.comparisons)


def run_replay(
    path_factories: Mapping[str, DualNormPathFactory] = PATH_FACTORIES,
    *,
    config: ReplayModelConfig = ReplayModelConfig(),
    steps: int = DEFAULT_DECODE_STEPS,
    progress: Optional[Callable[[str], None]] = None,
) -> ReplayReport:
    """Decodes with the composed path, then with each path, and compares.
    ``progress`` hears of every token of every decode. Ctrl-C after the
    reference decode raises InterruptedWithPartialResult carrying the
    report of the paths compared so far."""
    paths = {  # built before decoding: a path that cannot run here refuses at once
        path_name: build_path(path_name, path_factory, config.rms_norm_eps)
        for path_name, path_factory in path_factories.items()
    }
    parameters = build_replay_model(config)
    reference = greedy_decode(
        make_composed_path(config.rms_norm_eps),
        parameters,
        config,
        steps=steps,
        path_name=REFERENCE_PATH,
        progress=progress,
    )
    report = ReplayReport(config, steps, reference)
    try:
        for path_name, path in paths.items():
            trace = greedy_decode(
                path, parameters, config, steps=steps, path_name=path_name, progress=progress
            )
            report.comparisons.append(compare_decode_traces(trace, reference))
    except KeyboardInterrupt:
        raise command.InterruptedWithPartialResult(report) from None
    return report


def format_replay_report(report: ReplayReport) -> str:
    config = report.config
    gated_delta_count = config.layer_kinds.count(GATED_DELTA_LAYER)
    attention_count = config.layer_kinds.count(FULL_ATTENTION_LAYER)
    reference = report.reference
    lines = [
        f"replay: {len(config.layer_kinds)}-layer decoder ({gated_delta_count} gated-delta, "
        f"q/k {config.gated_delta_key_heads}x{config.gated_delta_head_width} weightless; "
        f"{attention_count} full attention, q/k {config.attention_query_heads}/"
        f"{config.attention_key_value_heads}x{config.attention_head_width} weighted), "
        f"{str(config.dtype).removeprefix('mlx.core.')}, "
        f"{config.prompt_length}-token prompt + {report.steps} greedy tokens, "
        f"seed {config.seed}",
        f"  {REFERENCE_PATH + ' (reference)':<24} {reference.elapsed_seconds:6.2f} s  "
        f"{len(set(reference.token_ids))} distinct tokens, first {list(reference.token_ids[:8])}",
    ]
    for comparison in report.comparisons:
        if comparison.diverged:
            tokens = (
                "identical"
                if comparison.tokens_identical
                else f"differ from step {comparison.first_divergent_token_step}"
            )
            final_state = (
                "bit-identical" if comparison.final_hidden_state_identical else "differs"
            )
            verdict = (
                f"DIVERGED at step {comparison.first_divergence_step}: tokens {tokens}, "
                f"hidden states differ from step {comparison.first_divergent_hidden_step}, "
                f"final hidden state {final_state}"
            )
        else:
            verdict = "tokens identical, every hidden state bit-identical"
        lines.append(f"  {comparison.path_name:<24} {comparison.elapsed_seconds:6.2f} s  {verdict}")
    path_names = [REFERENCE_PATH, *(comparison.path_name for comparison in report.comparisons)]
    lines += ["  paths:", *(f"    {line}" for line in describe_paths(path_names))]
    lines.append("  PASS" if report.passed else "  FAIL")
    return "\n".join(lines)


PROGRESS_INTERVAL_SECONDS = 2.0
# Each step adds a hidden state per path and a position to the attention
# layer's cache: this bounds both.
MAX_DECODE_STEPS = 4096
_DTYPES_BY_NAME = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def _replay_parser(selection: PathSelection) -> argparse.ArgumentParser:
    parser = command.tool_parser(
        "replay",
        "Greedy-decode a small gated-delta + attention model with each dual head norm "
        "path and compare its tokens and hidden-state bits with the composed path's. "
        "Exit status 1 if any path diverges.",
    )
    selection.add_path_argument(parser, "replay")
    parser.add_argument(
        "--steps", type=command.Count(1, MAX_DECODE_STEPS), default=DEFAULT_DECODE_STEPS,
        help="greedy tokens to decode",
    )
    parser.add_argument(
        "--seed", type=command.seed, default=ReplayModelConfig.seed,
        help="seed of the weights and prompt",
    )
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES_BY_NAME), default="bfloat16", help="model dtype"
    )
    command.add_device_argument(parser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser, over the registered paths."""
    return _replay_parser(PathSelection.of(None, PATH_FACTORIES))


def main(
    argv: Optional[Sequence[str]] = None,
    *,
    path_factories: Optional[Mapping[str, DualNormPathFactory]] = None,
) -> int:
    """``python -m mlx_dualnorm replay``: exits 1 if any path's decode
    differs from the composed path's in any token or hidden bit.
    ``path_factories`` replaces the registered paths (for tests)."""
    selection = PathSelection.of(path_factories, PATH_FACTORIES)

    def run(arguments: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        command.select_device(arguments.device, parser)
        path_names = selection.named(arguments)
        progress = command.StepProgress(
            "replay, tokens", (len(path_names) + 1) * arguments.steps,
            min_interval_s=PROGRESS_INTERVAL_SECONDS,
        )
        try:
            report = run_replay(
                selection.factories_named(path_names),
                config=ReplayModelConfig(
                    seed=arguments.seed, dtype=_DTYPES_BY_NAME[arguments.dtype]
                ),
                steps=arguments.steps,
                progress=progress.step,
            )
        except command.InterruptedWithPartialResult as interrupted:
            if isinstance(interrupted.partial, ReplayReport):
                print(format_replay_report(interrupted.partial))
                print(f"replay: INTERRUPTED after {len(interrupted.partial.comparisons)} of "
                      f"{len(path_names)} paths; the report covers only those")
            raise
        print(format_replay_report(report))
        if not arguments.path_names and selection.registered:
            for line in skipped_path_lines("replay", unavailable_paths(list(selection.factories))):
                print(line)
        return command.EXIT_OK if report.passed else command.EXIT_MISMATCH

    return command.run_tool(_replay_parser(selection), run, argv)


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
