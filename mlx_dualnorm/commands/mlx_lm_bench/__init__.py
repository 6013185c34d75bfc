"""``python -m mlx_dualnorm mlx-lm-bench``: mlx-lm unpatched against patched
in interleaved rounds (:mod:`.measurements`), every round's greedy tokens
compared (a mismatch exits 1); its tables, JSON and ``--ranks N`` (decode
models tensor-parallel over N loopback ranks): :mod:`.report`."""

from __future__ import annotations

import argparse
import functools
import sys
import time
from typing import Any, Callable, Collection, Optional, Sequence

import mlx.core as mx
import mlx_lm.models.gated_delta as gated_delta_module

from mlx_dualnorm.commands.mlx_lm_bench.measurements import (
    DECODE_DTYPE_OF_WEIGHTS, DECODE_PROMPT_TOKENS, QUICK_DECODE_VOCABULARY, DecodeMeasurement,
    GenerationMismatch, PairedTiming, decode_progress_steps, first_token_mismatch, run_decode,
    run_generation, run_prework,
)
from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.synthetic import (
    DECODE_MODELS, GATED_DELTA_MODEL_TYPES, SYNTHETIC_MODEL_TYPES,
)
from mlx_dualnorm.integrations import mlx_lm as integration

# The command, and what bench/'s scripts (DECODE_*) and the tests import.
__all__ = [
    "DECODE_DTYPE_OF_WEIGHTS", "DECODE_PROMPT_TOKENS", "QUICK_DECODE_VOCABULARY",
    "DecodeMeasurement", "PairedTiming", "first_token_mismatch", "main", "run_decode",
]

# Each count: (the full run's default, the reduced run's, the most it may be). A round holds
# one time per token or step, a decode model's cache grows by a position per step, and a
# prework token chains that many layers into one graph, so the most bounds the run's memory.
COUNTS = {
    "prework_tokens": (200, 50, 10000), "prework_repeats": (7, 3, 100),
    "tokens": (64, 32, 1024), "generation_repeats": (5, 2, 100),
    "decode_steps": (32, 4, 1024), "decode_rounds": (5, 2, 100),
}


def _add_workload(
    parser: argparse.ArgumentParser, flag: str, counts: dict[str, str], **options: Any
) -> None:
    """A workload's list argument, then its counts, each help stating both defaults."""
    parser.add_argument(flag, **options)
    for count_flag, what in counts.items():
        full, reduced, most = COUNTS[count_flag.lstrip("-").replace("-", "_")]
        parser.add_argument(
            count_flag, type=command.Count(1, most),
            help=f"{what} (default: {full}, or {reduced} reduced)",
        )


def build_parser() -> argparse.ArgumentParser:
    from mlx_dualnorm.commands.mlx_lm_bench.report import MAX_RANKS

    parser = command.tool_parser(
        "mlx-lm-bench",
        "mlx-lm unpatched against patched by mlx_dualnorm: the q/k prework at the Qwen3-Next "
        "decode shape, per-token generation time of small random models, and decode time of "
        "random models at released dimensions (or, with --ranks, of those tensor-parallel over "
        "loopback ranks). Ratios are patched time / unpatched time: lower is better.",
    )
    _add_workload(
        parser, "--layers",
        {"--prework-tokens": "tokens per prework round", "--prework-repeats": "prework rounds"},
        # Up to 8 layer counts, each a prework measurement, of at most 512 layers.
        type=command.CountList(command.Count(1, 512), 8), default="36,48",
        help="comma-separated chained layer counts for the prework ('' for none)",
    )
    _add_workload(
        parser, "--models",
        {"--tokens": "greedy tokens per generation round",
         "--generation-repeats": "generation rounds"},
        default=",".join(GATED_DELTA_MODEL_TYPES),
        help="comma-separated synthetic models to generate with ('' for none; any of "
        f"{', '.join(SYNTHETIC_MODEL_TYPES)})",
    )
    _add_workload(
        parser, "--decode-models",
        {"--decode-steps": "greedy decode steps per round",
         "--decode-rounds": "decode rounds, each path once per round"},
        default=",".join(DECODE_MODELS),
        help="comma-separated models at released dimensions to time decode tokens with "
        f"({', '.join(DECODE_MODELS)}; '' for none)",
    )
    command.add_mode_argument(parser)
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", action="store_true",
        help="the reduced run: the smaller defaults above; decode models keep their layer "
        f"shapes but get fewer layers and a vocabulary of {QUICK_DECODE_VOCABULARY} "
        "(the default on a CPU)",
    )
    size.add_argument(
        "--full-size", action="store_true",
        help="the full run even on a CPU: the larger defaults and decode models at their released "
        "sizes (over an hour on 2 CPU cores; the default on a GPU)",
    )
    parser.add_argument(
        "--json", metavar="PATH", type=command.output_file,
        help="also write the report as JSON to PATH (its folder must exist; checked before "
        "the run)",
    )
    parser.add_argument(
        "--ranks", type=command.Count(2, MAX_RANKS), default=None,
        help="instead: the decode models whose mlx-lm family has Model.shard, tensor-parallel "
        "over this many ranks that this command starts on loopback (ring backend), patched vs "
        "unpatched ms/token; the count must divide every model's head counts and MLP widths",
    )
    command.add_device_argument(parser)
    return parser


def _known_names(
    parser: argparse.ArgumentParser, flag: str, text: str, known: Collection[str]
) -> list[str]:
    """The comma-separated names of ``flag``, each one of ``known`` and each once, so the
    list cannot make the run longer than all of ``known``; an unknown or empty name exits 2."""
    parts = [name.strip() for name in text.split(",")]
    if text.strip() and not all(parts):
        parser.error(f"{flag}: an empty name in {text!r}")
    names = list(dict.fromkeys(name for name in parts if name))
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"{flag}: unknown {unknown}; choose from {', '.join(known)}")
    return names


def _run(arguments: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    command.select_device(arguments.device, parser)
    model_types = _known_names(parser, "--models", arguments.models, SYNTHETIC_MODEL_TYPES)
    decode_models = _known_names(parser, "--decode-models", arguments.decode_models, DECODE_MODELS)
    # Full-size decode on a CPU takes over an hour (bfloat16 matmuls on 2 cores): a CPU
    # gets the reduced run unless --full-size asks otherwise.
    on_cpu = mx.default_device().type == mx.cpu
    arguments.reduced = arguments.quick or (on_cpu and not arguments.full_size)
    for name, (full, reduced, _) in COUNTS.items():
        if getattr(arguments, name) is None:
            setattr(arguments, name, reduced if arguments.reduced else full)
    try:
        with integration.patch(arguments.mode):
            pass  # a mode that cannot run here fails before any measurement
    except ValueError as error:
        parser.error(str(error))
    except RuntimeError as unsupported_mlx_lm:  # patch() names the supported releases
        raise command.Unavailable(str(unsupported_mlx_lm)) from unsupported_mlx_lm
    if arguments.layers and not hasattr(gated_delta_module, "normalize_qk"):
        raise command.Unavailable(
            "the q/k prework rows (--layers) time mlx-lm's gated_delta.normalize_qk, which "
            "this mlx-lm lacks (mlx-lm 0.32.0 and later have it); --layers '' times the rest"
        )
    # The rank program's module, so imported only here: ``python -m`` runs it.
    from mlx_dualnorm.commands.mlx_lm_bench import report

    if arguments.ranks is not None:
        return report.run_over_ranks(arguments, decode_models)
    # Each stage: its name, its progress steps, and its measurement but for the progress report.
    mode, steps, rounds = arguments.mode, arguments.decode_steps, arguments.decode_rounds
    stages: list[tuple[str, int, Callable[..., object]]] = [
        (f"prework, {layers} layers", 2 * arguments.prework_repeats, functools.partial(
            run_prework, layers, arguments.prework_tokens, arguments.prework_repeats, mode
        ))
        for layers in arguments.layers
    ] + [
        (f"generation, {model_type}", 2 * arguments.generation_repeats, functools.partial(
            run_generation, model_type, arguments.tokens, arguments.generation_repeats, mode
        ))
        for model_type in model_types
    ] + [
        (f"decode, {model}", decode_progress_steps(steps, rounds), functools.partial(
            run_decode, model, steps, rounds, mode, quick=arguments.reduced
        ))
        for model in decode_models
    ]
    started = time.perf_counter()
    measured: list = []  # PairedTiming and DecodeMeasurement, in stage order
    stage_name: Optional[str] = None  # the measurement under way
    try:
        for number, (stage_name, progress_steps, measure) in enumerate(stages, 1):
            progress = command.StepProgress(
                f"[{number}/{len(stages)}] {stage_name}", progress_steps, min_interval_s=1.0
            )
            measured.append(measure(progress=progress.step))
    except GenerationMismatch as mismatch:
        report.print_report(arguments, measured, stage_name, time.perf_counter() - started)
        print(f"TOKEN MISMATCH: {mismatch}", file=sys.stderr)
        return command.EXIT_MISMATCH
    except KeyboardInterrupt as interrupt:
        partial = getattr(interrupt, "partial", None)  # InterruptedWithPartialResult's
        if partial is not None:
            measured.append(partial)
        report.print_report(arguments, measured, stage_name, time.perf_counter() - started)
        raise
    return report.print_report(arguments, measured, None, time.perf_counter() - started)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m mlx_dualnorm mlx-lm-bench``; see the module doc."""
    return command.run_tool(build_parser(), _run, argv)
