"""Greedy-decode replay: each dual head norm path inside a small model, its
token ids and the hidden state that chose each token compared bit for bit with
the composed path's. Hidden-state bits show one ulp off in one element at once,
while the argmax may hold for the whole run. The ``rope_*`` paths replace the
full-attention layer's whole q/k prework instead: the norms, transposes and RoPE
in one CompiledDualHeadNormRope call, or the RoPE alone in one call of the object
made without norms."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence, cast

import mlx.core as mx

from mlx_dualnorm import CompiledDualHeadNormRope, Mode, composed_dual_head_norm
from mlx_dualnorm.bits import bit_difference_mask
from mlx_dualnorm.commands.replay.model import (
    FULL_ATTENTION_LAYER, GATED_DELTA_LAYER, LayerCache, NormRope, ReplayModelConfig,
    build_replay_model, forward,
)
from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.paths import (
    REFERENCE_PATH, ROPE_BASE, DualNormPath, DualNormPathFactory, PathSelection, build_path,
    describe_paths, make_composed_path, refuse_unavailable, routinely_checked_paths,
    skipped_path_lines, unavailable_modes, unavailable_paths,
)

DEFAULT_DECODE_STEPS = 128
MAX_DECODE_STEPS = 4096  # bounds the hidden states kept per path and the attention cache
PATH_FACTORIES: dict[str, DualNormPathFactory] = routinely_checked_paths()
_DTYPES_BY_NAME = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
# The full-attention prework paths: name -> (mode, whether the call normalizes too).
ROPE_PATHS: dict[str, tuple[Mode, bool]] = {
    "rope_compiled": ("compiled", True), "rope_fused": ("fused", True),
    "rope_only_compiled": ("compiled", False), "rope_only_fused": ("fused", False),
}
_WITH_NORMS = "the full-attention layer's norms, transposes and RoPE in one call"
_WITHOUT_NORMS = ("the full-attention layer's norms composed, then its transposes and RoPE in "
                  "one call of the object without norms")
ROPE_PATH_DESCRIPTIONS = {
    "rope_compiled": f"mlx_dualnorm.CompiledDualHeadNormRope(mode='compiled'): {_WITH_NORMS}",
    "rope_fused": f"mlx_dualnorm.CompiledDualHeadNormRope(mode='fused'): {_WITH_NORMS}",
    "rope_only_compiled":
        f"mlx_dualnorm.CompiledDualHeadNormRope(mode='compiled'): {_WITHOUT_NORMS}",
    "rope_only_fused": f"mlx_dualnorm.CompiledDualHeadNormRope(mode='fused'): {_WITHOUT_NORMS}",
}


def rope_path_reasons(names: Sequence[str]) -> dict[str, str]:
    """Of the ``rope_*`` paths named, those this build or device cannot run, with the reason."""
    unknown = [name for name in names if name not in ROPE_PATHS]
    if unknown:
        raise ValueError(f"[replay] unknown rope paths {unknown}; the rope paths are "
                         f"{', '.join(ROPE_PATHS)}")
    return unavailable_modes({name: ROPE_PATHS[name][0] for name in names})


def build_norm_rope_path(name: str, config: ReplayModelConfig) -> NormRope:
    """The full-attention prework of the ``rope_*`` path ``name`` for ``config``;
    PathUnavailable where its mode cannot run here."""
    refuse_unavailable(rope_path_reasons([name]))
    mode, norms = ROPE_PATHS[name]
    eps = config.rms_norm_eps
    norm_rope = CompiledDualHeadNormRope(
        eps if norms else None, config.attention_rotary_width, base=ROPE_BASE,
        traditional=False, scale=1.0, mode=mode,
    )

    def prework(queries: mx.array, keys: mx.array, query_weight: mx.array,
                key_weight: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        if norms:
            return norm_rope(queries, keys, query_weight, key_weight, offset=offset)
        # The norms composed; the object made without norms rotates their outputs.
        queries, keys = composed_dual_head_norm(queries, keys, query_weight, key_weight, eps)
        return norm_rope(queries, keys, offset=offset)

    return prework


@dataclass(frozen=True)
class GreedyDecodeTrace:
    """One greedy decode: the tokens, and the final normalized hidden state
    that chose each token, stacked ``(steps, model_width)``."""

    path_name: str
    token_ids: tuple[int, ...]
    step_hidden_states: mx.array
    elapsed_seconds: float


def greedy_decode(
    dual_head_norm: DualNormPath, parameters: Mapping[str, mx.array],
    config: ReplayModelConfig = ReplayModelConfig(), *, steps: int = DEFAULT_DECODE_STEPS,
    path_name: str = "path under test", progress: Optional[Callable[[str], None]] = None,
    norm_rope: Optional[NormRope] = None,
) -> GreedyDecodeTrace:
    """Prefills the fixed prompt, then picks ``steps`` tokens by argmax,
    evaluating once per token as a server would; ``norm_rope`` replaces the
    full-attention layer's q/k prework."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    started = time.perf_counter()
    caches: list[LayerCache] = [{} for _ in config.layer_kinds]
    prompt_key = mx.random.key(config.seed ^ 0x9E3779B9)
    tokens = mx.random.randint(0, config.vocabulary_size, (1, config.prompt_length), key=prompt_key)
    token_ids: list[int] = []
    step_hidden_states: list[mx.array] = []
    for step in range(steps):
        logits, final_hidden = forward(
            tokens, parameters, caches, config, dual_head_norm, norm_rope
        )
        tokens = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
        step_hidden_states.append(final_hidden[0, -1, :])
        mx.eval(tokens, step_hidden_states[-1], caches)
        token_ids.append(int(tokens))
        if progress is not None:
            progress(f"{path_name} token {step + 1}/{steps}")
    hidden_states = mx.stack(step_hidden_states)
    mx.eval(hidden_states)
    elapsed = time.perf_counter() - started
    return GreedyDecodeTrace(path_name, tuple(token_ids), hidden_states, elapsed)


@dataclass(frozen=True)
class ReplayComparison:
    """A path's decode against the composed path's."""

    path_name: str
    tokens_identical: bool
    final_hidden_state_identical: bool
    first_divergent_token_step: Optional[int]
    first_divergent_hidden_step: Optional[int]
    elapsed_seconds: float

    @property
    def diverged(self) -> bool:
        return not self.tokens_identical or self.first_divergent_hidden_step is not None

    @property
    def first_divergence_step(self) -> Optional[int]:
        steps = (self.first_divergent_token_step, self.first_divergent_hidden_step)
        return min((step for step in steps if step is not None), default=None)


def compare_decode_traces(
    trace: GreedyDecodeTrace, reference: GreedyDecodeTrace
) -> ReplayComparison:
    """Tokens compared as ids; hidden states compared as bit patterns (a
    NaN equals only the same NaN), step by step."""
    token_pairs = enumerate(zip(trace.token_ids, reference.token_ids))
    token_steps = [step for step, (token, expected) in token_pairs if token != expected]
    hidden, expected_hidden = trace.step_hidden_states, reference.step_hidden_states
    rows_differ = [True]  # hidden states of another shape or dtype differ from the first step
    if hidden.shape == expected_hidden.shape and hidden.dtype == expected_hidden.dtype:
        # The hidden states are (steps, width): one flag per step.
        row_flags = mx.any(bit_difference_mask(hidden, expected_hidden), axis=-1)
        rows_differ = cast(list[bool], row_flags.tolist())
    hidden_steps = [step for step, differs in enumerate(rows_differ) if differs]
    return ReplayComparison(
        path_name=trace.path_name,
        tokens_identical=trace.token_ids == reference.token_ids,
        final_hidden_state_identical=not rows_differ[-1],
        first_divergent_token_step=token_steps[0] if token_steps else None,
        first_divergent_hidden_step=hidden_steps[0] if hidden_steps else None,
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
    path_factories: Mapping[str, DualNormPathFactory] = PATH_FACTORIES, *,
    config: ReplayModelConfig = ReplayModelConfig(), steps: int = DEFAULT_DECODE_STEPS,
    progress: Optional[Callable[[str], None]] = None, rope_paths: Sequence[str] = (),
) -> ReplayReport:
    """Decodes with the composed path, then with each path and each of the
    ``rope_paths`` (names of :data:`ROPE_PATHS`), and compares. Ctrl-C after the
    reference decode raises InterruptedWithPartialResult carrying the report of
    the paths compared so far."""
    composed = make_composed_path(config.rms_norm_eps)
    # Built before decoding: a path that cannot run here refuses at once.
    paths: dict[str, tuple[DualNormPath, Optional[NormRope]]] = {
        path_name: (build_path(path_name, path_factory, config.rms_norm_eps), None)
        for path_name, path_factory in path_factories.items()
    }
    paths.update({name: (composed, build_norm_rope_path(name, config)) for name in rope_paths})
    parameters = build_replay_model(config)
    reference = greedy_decode(
        composed, parameters, config, steps=steps, path_name=REFERENCE_PATH, progress=progress
    )
    report = ReplayReport(config, steps, reference)
    try:
        for path_name, (path, norm_rope) in paths.items():
            trace = greedy_decode(
                path, parameters, config, steps=steps, path_name=path_name, progress=progress,
                norm_rope=norm_rope,
            )
            report.comparisons.append(compare_decode_traces(trace, reference))
    except KeyboardInterrupt:
        raise command.InterruptedWithPartialResult(report) from None
    return report


def format_replay_report(report: ReplayReport) -> str:
    config, reference = report.config, report.reference
    lines = [
        f"replay: {len(config.layer_kinds)}-layer decoder "
        f"({config.layer_kinds.count(GATED_DELTA_LAYER)} gated-delta, "
        f"q/k {config.gated_delta_key_heads}x{config.gated_delta_head_width} weightless; "
        f"{config.layer_kinds.count(FULL_ATTENTION_LAYER)} full attention, "
        f"q/k {config.attention_query_heads}/{config.attention_key_value_heads}x"
        f"{config.attention_head_width} weighted), {str(config.dtype).removeprefix('mlx.core.')}, "
        f"{config.prompt_length}-token prompt + {report.steps} greedy tokens, "
        f"seed {config.seed}",
        f"  {REFERENCE_PATH + ' (reference)':<24} {reference.elapsed_seconds:6.2f} s  "
        f"{len(set(reference.token_ids))} distinct tokens, first {list(reference.token_ids[:8])}",
    ]
    for comparison in report.comparisons:
        verdict = "tokens identical, every hidden state bit-identical"
        if comparison.diverged:
            tokens = (
                "identical" if comparison.tokens_identical
                else f"differ from step {comparison.first_divergent_token_step}"
            )
            final_state = "bit-identical" if comparison.final_hidden_state_identical else "differs"
            verdict = (
                f"DIVERGED at step {comparison.first_divergence_step}: tokens {tokens}, "
                f"hidden states differ from step {comparison.first_divergent_hidden_step}, "
                f"final hidden state {final_state}"
            )
        lines.append(f"  {comparison.path_name:<24} {comparison.elapsed_seconds:6.2f} s  {verdict}")
    path_names = [REFERENCE_PATH, *(comparison.path_name for comparison in report.comparisons)]
    descriptions = [
        f"{name}: {ROPE_PATH_DESCRIPTIONS[name]}" if name in ROPE_PATH_DESCRIPTIONS else line
        for name, line in zip(path_names, describe_paths(path_names))
    ]
    lines += ["  paths:", *(f"    {line}" for line in descriptions)]
    lines.append("  PASS" if report.passed else "  FAIL")
    return "\n".join(lines)


def build_parser(selection: Optional[PathSelection] = None) -> argparse.ArgumentParser:
    """The command line's parser, over ``selection`` (default: the registered paths)."""
    parser = command.tool_parser(
        "replay",
        "Greedy-decode a small gated-delta + attention model with each dual head norm "
        "path (or the rope_* paths: the attention layer's q/k prework, with or without its "
        "norms, in one call) and "
        "compare its tokens and hidden-state bits with the composed path's. "
        "Exit status 1 if any path diverges.",
    )
    (selection or _selection(None)).add_path_argument(parser, "replay")
    parser.add_argument("--steps", type=command.Count(1, MAX_DECODE_STEPS),
                        default=DEFAULT_DECODE_STEPS, help="greedy tokens to decode")
    parser.add_argument("--seed", type=command.seed, default=ReplayModelConfig.seed,
                        help="seed of the weights and prompt")
    parser.add_argument("--dtype", choices=sorted(_DTYPES_BY_NAME), default="bfloat16",
                        help="model dtype")
    command.add_device_argument(parser)
    return parser


def _selection(path_factories: Optional[Mapping[str, DualNormPathFactory]]) -> PathSelection:
    """The dual norm paths, and the rope paths that run here by default."""
    available_rope_paths = [name for name in ROPE_PATHS if not rope_path_reasons([name])]
    return PathSelection.of(path_factories, PATH_FACTORIES, extra_names=list(ROPE_PATHS),
                            extra_default_names=available_rope_paths)


def main(
    argv: Optional[Sequence[str]] = None, *,
    path_factories: Optional[Mapping[str, DualNormPathFactory]] = None,
) -> int:
    """``python -m mlx_dualnorm replay``: exits 1 if any path diverges.
    ``path_factories`` replaces the registered paths (for tests)."""
    selection = _selection(path_factories)

    def run(arguments: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        command.select_device(arguments.device, parser)
        path_names = selection.named(arguments)
        progress = command.StepProgress(
            "replay, tokens", (len(path_names) + 1) * arguments.steps, min_interval_s=2.0
        )
        config = ReplayModelConfig(seed=arguments.seed, dtype=_DTYPES_BY_NAME[arguments.dtype])
        try:
            report = run_replay(
                selection.factories_named(path_names), config=config, steps=arguments.steps,
                progress=progress.step,
                rope_paths=[name for name in path_names if name in ROPE_PATHS],
            )
        except command.InterruptedWithPartialResult as interrupted:
            if isinstance(interrupted.partial, ReplayReport):
                print(format_replay_report(interrupted.partial))
                print(f"replay: INTERRUPTED after {len(interrupted.partial.comparisons)} of "
                      f"{len(path_names)} paths; the report covers only those")
            raise
        print(format_replay_report(report))
        if not arguments.path_names and selection.registered:
            skipped = {**unavailable_paths(list(selection.factories)),
                       **rope_path_reasons(list(ROPE_PATHS))}
            for line in skipped_path_lines("replay", skipped):
                print(line)
        return command.EXIT_OK if report.passed else command.EXIT_MISMATCH

    return command.run_tool(build_parser(selection), run, argv)
