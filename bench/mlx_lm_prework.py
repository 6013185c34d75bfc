"""mlx-lm's q/k prework and small random models' generation, unpatched against
patched, in interleaved rounds: the microbenchmarks beside ``mlx-lm-bench``'s
decode at released dimensions.

- ``prework_N_layers``: N chained calls of mlx-lm's ``gated_delta.normalize_qk``
  at the Qwen3-Next decode shape (bfloat16), one ``mx.eval`` per token;
- ``generation_MODEL_DTYPE``: ms per decode token of a small random mlx-lm
  model, greedy through ``generate_step``; every round must give the first
  round's tokens (else exit 1: the times would compare different work).

    python bench/mlx_lm_prework.py [--layers 36,48] [--models qwen3_next,qwen3_5] [--quick]

Exit status 0 done, 1 a generation round's tokens changed, 2 what cannot run
(a bad name, a mode this build lacks, an mlx-lm the patch does not support),
130 Ctrl-C (after printing what was measured); each failure one line.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time
from typing import Optional

import mlx.core as mx
import mlx_lm.models.gated_delta as gated_delta_module

from mlx_dualnorm import Mode
from mlx_dualnorm.commands.mlx_lm_bench.measurements import (
    PATCHED, PairedTiming, StepReport, timed_rounds,
)
from mlx_dualnorm.commands.mlx_lm_bench import table_header, table_row
from mlx_dualnorm.commands.mlx_lm_check import fixed_prompt
from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.generation import greedy_generate, refuse_what_cannot_patch
from mlx_dualnorm.integrations import mlx_lm as integration

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from helpers.mlx_lm_families import (  # noqa: E402  (the small models of every family)
    DEFAULT_DTYPES, SYNTHETIC_MODEL_TYPES, build_synthetic_model, synthetic_model_config,
)

DECODE_SHAPE = (1, 1, 16, 128)  # q and k at the Qwen3-Next decode shape, bfloat16
INV_SCALE = DECODE_SHAPE[-1] ** -0.5  # what qwen3_next / qwen3_5 pass
EPS = 1e-6
MAX_LAYERS = 512  # one prework token chains this many calls into one graph
MAX_LAYER_COUNTS = 8  # each a measurement
GATED_DELTA_MODEL_TYPES = ("qwen3_next", "qwen3_5")  # the synthetic models with gated-delta layers
PROMPT_TOKENS = 12


class GenerationMismatch(Exception):
    """A generation round gave other tokens than the first: the runs being
    timed no longer compute the same thing, so their times compare nothing."""


def run_prework(layers: int, tokens: int, repeats: int, mode: Optional[Mode],
                progress: StepReport) -> PairedTiming:
    """Microseconds per token of ``layers`` chained q/k normalizations, one
    ``mx.eval`` per token; ``progress`` hears of each path's round."""
    query_key, key_key = mx.random.split(mx.random.key(DECODE_SHAPE[-1]))
    queries = mx.random.normal(DECODE_SHAPE, key=query_key).astype(mx.bfloat16)
    keys = mx.random.normal(DECODE_SHAPE, key=key_key).astype(mx.bfloat16)
    mx.eval(queries, keys)

    def seconds_per_token(patched: bool, tokens: int) -> float:
        # What mlx-lm's layers call, inside the patch: the function patch() installs
        # runs mlx-lm's own once the patch is off, so it is timed only while it is on.
        with integration.patch(mode) if patched else integration.unpatch():
            normalize_qk = gated_delta_module.normalize_qk
            started = time.perf_counter()
            for _ in range(tokens):
                normalized_queries, normalized_keys = queries, keys
                for _ in range(layers):
                    normalized_queries, normalized_keys = normalize_qk(
                        normalized_queries, normalized_keys, inv_scale=INV_SCALE, eps=EPS
                    )
                mx.eval(normalized_queries, normalized_keys)
            return (time.perf_counter() - started) / tokens

    return timed_rounds(
        PairedTiming(f"prework_{layers}_layers", "us/token", [], []), repeats,
        warm_up=lambda patched: seconds_per_token(patched, max(tokens // 10, 3)),
        measure=lambda patched, *_: 1e6 * seconds_per_token(patched, tokens),
        progress=progress,
    )


def run_generation(model_type: str, tokens: int, repeats: int, mode: Optional[Mode],
                   progress: StepReport) -> PairedTiming:
    """Milliseconds per decode token of a synthetic model, greedy through mlx-lm's
    ``generate_step``; every round's token ids must be the first's (else GenerationMismatch)."""
    model = build_synthetic_model(model_type)
    prompt = fixed_prompt(synthetic_model_config(model_type), PROMPT_TOKENS)
    expected_tokens: Optional[list[int]] = None

    def one_round(patched: bool, *_: object) -> float:
        nonlocal expected_tokens
        with integration.patch(mode) if patched else integration.unpatch():
            trace = greedy_generate(model, prompt, tokens)
        if expected_tokens is None:
            expected_tokens = trace.token_ids
        elif trace.token_ids != expected_tokens:
            raise GenerationMismatch(f"{model_type}: greedy token ids changed between rounds")
        return trace.median_decode_ms

    dtype_name = str(DEFAULT_DTYPES[model_type]).rsplit(".", 1)[-1]
    timing = PairedTiming(f"generation_{model_type}_{dtype_name}", "ms/token", [], [])
    return timed_rounds(timing, repeats, one_round, one_round, progress)


def format_table(timings: list[PairedTiming]) -> str:
    return "\n".join([
        table_header("measurement", 34),
        *(table_row(t.name, 34, t.unit, t.summary(), digits=2) for t in timings),
        f"columns: median time per round, unpatched (mlx-lm's own code) and {PATCHED} "
        "(mlx_dualnorm.integrations.mlx_lm.patch());",
        "  ratio = median patched time / median unpatched time, then the per-round ratios' "
        "min..max: lower is better, below 1.00x the patch is faster",
        f"  prework_N_layers: N chained q/k normalizations at {DECODE_SHAPE} bfloat16, "
        "one eval per token",
        "  generation_MODEL_DTYPE: ms per decode token of a small random mlx-lm model",
    ])


def layer_count_list(text: str) -> list[int]:
    """The argparse ``type`` of ``--layers``: at most ``MAX_LAYER_COUNTS`` comma-separated
    counts of 1 to ``MAX_LAYERS``, each once; ``''`` is none, ``36,,48`` is refused."""
    texts = [part.strip() for part in text.split(",")]
    if text.strip() and not all(texts):
        raise argparse.ArgumentTypeError(f"an empty value in {text!r}")
    counts = list(dict.fromkeys(command.Count(1, MAX_LAYERS)(part) for part in texts if part))
    if len(counts) > MAX_LAYER_COUNTS:
        raise argparse.ArgumentTypeError(f"at most {MAX_LAYER_COUNTS} values, got {len(counts)}")
    return counts


def _run(arguments: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    command.select_device(arguments.device, parser)
    layer_counts = arguments.layers
    try:
        model_types = command.name_list("--models", arguments.models, SYNTHETIC_MODEL_TYPES)
    except ValueError as bad_names:
        parser.error(str(bad_names))
    if layer_counts and not hasattr(gated_delta_module, "normalize_qk"):
        raise command.Unavailable("this mlx-lm has no gated_delta.normalize_qk (mlx-lm 0.32.0 "
                                  "and later have it); --layers '' times the rest")
    refuse_what_cannot_patch(arguments.mode)
    # (prework tokens, prework rounds, generation tokens, generation rounds)
    prework_tokens, prework_rounds, tokens, rounds = (50, 3, 32, 2) if arguments.quick else (
        200, 7, 64, 5)
    stages = [(f"prework, {layers} layers", 2 * prework_rounds, functools.partial(
        run_prework, layers, prework_tokens, prework_rounds, arguments.mode))
        for layers in layer_counts]
    stages += [(f"generation, {name}", 2 * rounds, functools.partial(
        run_generation, name, tokens, rounds, arguments.mode)) for name in model_types]
    timings: list[PairedTiming] = []
    heading = (f"mlx-lm q/k prework and generation on {mx.default_device()} "
               f"(MLX {getattr(mx, '__version__')})")
    try:
        for number, (name, steps, measure) in enumerate(stages, 1):
            progress = command.StepProgress(f"[{number}/{len(stages)}] {name}", steps)
            timings.append(measure(progress=progress.step))
    except GenerationMismatch as mismatch:
        if timings:
            print(heading, format_table(timings), sep="\n", flush=True)
        print(f"TOKEN MISMATCH: {mismatch}", file=sys.stderr)
        return command.EXIT_MISMATCH
    except command.InterruptedWithPartialResult as interrupted:
        if isinstance(interrupted.partial, PairedTiming):  # its complete rounds
            timings.append(interrupted.partial)
        if timings:
            print(f"{heading}; INTERRUPTED: the rows hold the complete rounds",
                  format_table(timings), sep="\n", flush=True)
        raise
    print(heading, format_table(timings), sep="\n")
    return command.EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = command.ToolParser(prog="python bench/mlx_lm_prework.py", operation="mlx_lm_prework",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=command.DefaultShownOnceFormatter)
    parser.add_argument("--layers", type=layer_count_list, default="36,48",
                        help="comma-separated chained layer counts for the prework ('' for none)")
    parser.add_argument("--models", default=",".join(GATED_DELTA_MODEL_TYPES),
                        help="comma-separated synthetic models to generate with ('' for none)")
    parser.add_argument("--quick", action="store_true", help="fewer tokens and rounds")
    command.add_mode_argument(parser)
    command.add_device_argument(parser)
    return parser


if __name__ == "__main__":
    sys.exit(command.run_tool(build_parser(), _run, None))
