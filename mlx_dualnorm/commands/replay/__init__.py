"""Greedy-decode replay: a dual head norm path inside a small model.

The parity harness checks the norm in isolation; this replay checks it the
way a model uses it. A small deterministic decoder in the shape of a
Qwen3-Next / Qwen3.5 hybrid (three gated-delta layers, then one full
attention layer) runs its query/key head norms through the path under test
and greedily decodes; the run is repeated with the composed path
(two ``mx.fast.rms_norm`` calls) and the two are compared: the token ids,
the final hidden state bit for bit, and the first step whose hidden state
differs in any bit.

The model is :mod:`~mlx_dualnorm.commands.replay.model`.

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
from mlx_dualnorm.commands.replay.model import (
    FULL_ATTENTION_LAYER, GATED_DELTA_LAYER, LayerCache, ReplayModelConfig,
    build_replay_model, forward,
)
from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.paths import (
    REFERENCE_PATH, DualNormPath, DualNormPathFactory, PathSelection, build_path,
    describe_paths, make_composed_path, routinely_checked_paths, skipped_path_lines,
    unavailable_paths,
)

__all__ = [
    "DEFAULT_DECODE_STEPS", "GreedyDecodeTrace", "ReplayComparison", "ReplayModelConfig",
    "ReplayReport", "build_parser", "build_replay_model", "compare_decode_traces",
    "format_replay_report", "greedy_decode", "main", "run_replay",
]

DEFAULT_DECODE_STEPS = 128
PATH_FACTORIES: dict[str, DualNormPathFactory] = routinely_checked_paths()
"""The paths replayed when none is named (see tools.compared_paths)."""


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
    caches = [LayerCache() for _ in config.layer_kinds]
    logits, final_hidden = forward(
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
            logits, final_hidden = forward(
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
