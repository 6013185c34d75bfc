"""``python -m mlx_dualnorm mlx-lm-bench``: mlx-lm unpatched against
patched, in interleaved rounds: the q/k prework at the Qwen3-Next decode
shape, per-token generation of small random models, and decode tokens of
random bfloat16 models at released dimensions, every round's greedy tokens
compared (a mismatch exits 1); with ``--ranks N``, those decode models
tensor-parallel over N loopback ranks
(:mod:`~mlx_dualnorm.commands.mlx_lm_bench.report`). What is measured:
:mod:`~mlx_dualnorm.commands.mlx_lm_bench.measurements`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Collection, Optional, Sequence

import mlx.core as mx
import mlx_lm.models.gated_delta as gated_delta_module

from mlx_dualnorm.commands.mlx_lm_bench import measurements
from mlx_dualnorm.commands.mlx_lm_bench.measurements import (
    DECODE_DTYPE_OF_WEIGHTS, DECODE_PROMPT_TOKENS, QUICK_DECODE_VOCABULARY,
    DecodeMeasurement, GenerationMismatch, PairedTiming, StepReport,
    decode_progress_steps, first_token_mismatch, run_decode, run_generation,
    run_prework,
)
from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.synthetic import (
    DECODE_MODELS, GATED_DELTA_MODEL_TYPES, SYNTHETIC_MODEL_TYPES,
)
from mlx_dualnorm.integrations import mlx_lm as integration

__all__ = [
    "DECODE_DTYPE_OF_WEIGHTS", "DECODE_PROMPT_TOKENS", "DecodeMeasurement", "PairedTiming",
    "build_parser", "first_token_mismatch", "main", "measurements",
    "run_decode", "run_generation", "run_prework",
]

REPORT_SCHEMA = "mlx_dualnorm.mlx_lm_bench/3"
FULL_DEFAULTS = {
    "prework_tokens": 200, "prework_repeats": 7, "tokens": 64, "generation_repeats": 5,
    "decode_steps": 32, "decode_rounds": 5,
}
QUICK_DEFAULTS = {
    "prework_tokens": 50, "prework_repeats": 3, "tokens": 32, "generation_repeats": 2,
    "decode_steps": 4, "decode_rounds": 2,
}
# The most each count may ask for: a round holds one time per token or
# step, a decode model's cache grows by a position per step, and a prework
# token chains that many layers into one graph, so these bound the run's
# memory (and its time).
MAX_COUNTS = {
    "prework_tokens": 10000, "prework_repeats": 100, "tokens": 1024,
    "generation_repeats": 100, "decode_steps": 1024, "decode_rounds": 100,
}
MAX_PREWORK_LAYERS = 512
MAX_LAYER_COUNTS = 8  # values of --layers, each a prework measurement


def _environment() -> dict:
    return {
        "date": datetime.date.today().isoformat(),
        "device": str(mx.default_device()),
        "mlx": getattr(mx, "__version__"),  # not in MLX's type stubs
        "mlx_lm": _mlx_lm_version(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
    }


def _mlx_lm_version() -> str:
    from mlx_lm import __version__

    return __version__


def _add_workload(
    parser: argparse.ArgumentParser, flag: str, counts: tuple[tuple[str, str], ...], **options: Any
) -> None:
    """A workload's list argument, then the positive counts of its rounds,
    each ``(flag, what it counts)``: their help states both defaults from
    FULL_DEFAULTS and QUICK_DEFAULTS, so it cannot drift from what the run
    fills in."""
    parser.add_argument(flag, **options)
    for count_flag, what in counts:
        name = count_flag.lstrip("-").replace("-", "_")
        parser.add_argument(
            count_flag, type=command.Count(1, MAX_COUNTS[name]),
            help=f"{what} (default: {FULL_DEFAULTS[name]}, or {QUICK_DEFAULTS[name]} reduced)",
        )


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    from mlx_dualnorm.commands.mlx_lm_bench.report import MAX_RANKS
    parser = command.tool_parser(
        "mlx-lm-bench",
        "mlx-lm unpatched against patched by mlx_dualnorm: the q/k prework at the "
        "Qwen3-Next decode shape, per-token generation time of small random models, and "
        "decode time of random models at released dimensions (or, with --ranks, of those "
        "tensor-parallel over loopback ranks). Ratios are patched time / unpatched time: "
        "lower is better.",
    )
    _add_workload(
        parser, "--layers",
        (("--prework-tokens", "tokens per prework round"), ("--prework-repeats", "prework rounds")),
        type=command.CountList(command.Count(1, MAX_PREWORK_LAYERS), MAX_LAYER_COUNTS),
        default="36,48",
        help="comma-separated chained layer counts for the prework ('' for none)",
    )
    _add_workload(
        parser, "--models", (("--tokens", "greedy tokens per generation round"),
                             ("--generation-repeats", "generation rounds")),
        default=",".join(GATED_DELTA_MODEL_TYPES),
        help="comma-separated synthetic models to generate with ('' for none; any of "
        f"{', '.join(SYNTHETIC_MODEL_TYPES)})",
    )
    _add_workload(
        parser, "--decode-models",
        (("--decode-steps", "greedy decode steps per round"),
         ("--decode-rounds", "decode rounds, each path once per round")),
        default=",".join(DECODE_MODELS),
        help="comma-separated models at released dimensions to time decode tokens with "
        f"({', '.join(DECODE_MODELS)}; '' for none)",
    )
    command.add_mode_argument(parser)
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        action="store_true",
        help="the reduced run: the smaller defaults above; decode models keep their layer "
        f"shapes but get fewer layers and a vocabulary of {QUICK_DECODE_VOCABULARY} "
        "(the default on a CPU)",
    )
    size.add_argument(
        "--full-size",
        action="store_true",
        help="the full run even on a CPU: the larger defaults and decode models at their "
        "released sizes (over an hour on 2 CPU cores; the default on a GPU)",
    )
    parser.add_argument(
        "--json", metavar="PATH", type=command.output_file,
        help="also write the report as JSON to PATH (its folder must exist; checked before the run)",
    )
    parser.add_argument(
        "--ranks", type=command.Count(2, MAX_RANKS), default=None,
        help="instead: the decode models whose mlx-lm family has Model.shard, tensor-parallel "
        "over this many ranks that this command starts on loopback (ring backend), "
        "patched vs unpatched ms/token; the count must divide every model's head counts "
        "and MLP widths",
    )
    command.add_device_argument(parser)
    return parser


def _known_names(
    parser: argparse.ArgumentParser, flag: str, text: str, known: Collection[str]
) -> list[str]:
    """The comma-separated names of ``flag``, each one of ``known`` (any
    other exits 2, naming the choices), each once: a name repeated is
    measured once, so the list cannot make the run longer than all of
    ``known``. An empty name between commas is refused."""
    parts = [name.strip() for name in text.split(",")]
    if text.strip() and not all(parts):
        parser.error(f"{flag}: an empty name in {text!r}")
    names = list(dict.fromkeys(name for name in parts if name))
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"{flag}: unknown {unknown}; choose from {', '.join(known)}")
    return names


def _checked_arguments(
    arguments: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[list[int], list[str], list[str]]:
    """Layer counts, small model names and decode model names, defaults
    filled in (``arguments.reduced``: the reduced run, asked for or on a
    CPU); bad usage exits 2."""
    layer_counts = arguments.layers
    model_types = _known_names(parser, "--models", arguments.models, SYNTHETIC_MODEL_TYPES)
    decode_models = _known_names(parser, "--decode-models", arguments.decode_models, DECODE_MODELS)
    # Full-size decode on a CPU takes over an hour (bfloat16 matmuls on 2
    # cores): a CPU gets the reduced run unless --full-size asks otherwise.
    on_cpu = mx.default_device().type == mx.cpu
    arguments.reduced = arguments.quick or (on_cpu and not arguments.full_size)
    defaults = QUICK_DEFAULTS if arguments.reduced else FULL_DEFAULTS
    for name, default in defaults.items():
        if getattr(arguments, name) is None:
            setattr(arguments, name, default)
    try:
        with integration.patch(arguments.mode):
            pass  # a mode that cannot run here fails before any measurement
    except ValueError as error:
        parser.error(str(error))
    except RuntimeError as unsupported_mlx_lm:  # patch() names the supported releases
        raise command.Unavailable(str(unsupported_mlx_lm)) from unsupported_mlx_lm
    if layer_counts and not hasattr(gated_delta_module, "normalize_qk"):
        raise command.Unavailable(
            "the q/k prework rows (--layers) time mlx-lm's gated_delta.normalize_qk, which "
            "this mlx-lm lacks (mlx-lm 0.32.0 and later have it); --layers '' times the rest"
        )
    return layer_counts, model_types, decode_models


@dataclasses.dataclass
class _Results:
    """What the run measured so far, in order: printed at the end, or when
    Ctrl-C stops it (``interrupted_in`` then names the measurement cut short,
    whose complete rounds are included)."""

    timings: list[PairedTiming] = dataclasses.field(default_factory=list)
    decode_measurements: list[DecodeMeasurement] = dataclasses.field(default_factory=list)
    interrupted_in: Optional[str] = None

    def keep_partial(self, partial: object) -> None:
        if isinstance(partial, DecodeMeasurement) and partial.timing.complete_rounds:
            self.decode_measurements.append(partial)
        elif isinstance(partial, PairedTiming) and partial.complete_rounds:
            self.timings.append(partial)


def _measure_all(
    arguments: argparse.Namespace,
    layer_counts: list[int],
    model_types: list[str],
    decode_models: list[str],
    results: _Results,
) -> None:
    """Every measurement asked for, into ``results`` as each completes,
    with per-step progress (and the time left) on stderr."""
    stages = len(layer_counts) + len(model_types) + len(decode_models)
    stage = 0

    def next_stage(name: str, steps: int) -> StepReport:
        nonlocal stage
        stage += 1
        results.interrupted_in = name
        return command.StepProgress(f"[{stage}/{stages}] {name}", steps, min_interval_s=1.0).step

    # The paired timings in stage order, each (stage, progress steps, the run
    # without its progress report).
    paired_timings: list[tuple[str, int, Callable[..., PairedTiming]]] = [
        (f"prework, {layers} layers", 2 * arguments.prework_repeats, functools.partial(
            run_prework, layers, arguments.prework_tokens, arguments.prework_repeats, arguments.mode
        ))
        for layers in layer_counts
    ] + [
        (f"generation, {model_type}", 2 * arguments.generation_repeats, functools.partial(
            run_generation, model_type, arguments.tokens, arguments.generation_repeats,
            arguments.mode,
        ))
        for model_type in model_types
    ]
    for name, steps, run in paired_timings:
        results.timings.append(run(progress=next_stage(name, steps)))
    for model in decode_models:
        progress = next_stage(
            f"decode, {model}",
            decode_progress_steps(arguments.decode_steps, arguments.decode_rounds),
        )
        results.decode_measurements.append(
            run_decode(
                model, arguments.decode_steps, arguments.decode_rounds, arguments.mode,
                quick=arguments.reduced, progress=progress,
            )
        )
    results.interrupted_in = None


def _report_mismatches(measurements: list[DecodeMeasurement]) -> bool:
    """Print every decode model whose rounds gave different greedy tokens;
    True when there was one."""
    mismatched = [m for m in measurements if m.token_mismatch is not None]
    for measurement in mismatched:
        print(
            f"TOKEN MISMATCH: {measurement.model}: greedy tokens differ from the first "
            f"unpatched round at {measurement.token_mismatch}",
            file=sys.stderr,
        )
    return bool(mismatched)


def _run(arguments: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    command.select_device(arguments.device, parser)
    layer_counts, model_types, decode_models = _checked_arguments(arguments, parser)
    if arguments.ranks is not None:
        from mlx_dualnorm.commands.mlx_lm_bench.report import run_over_ranks

        return run_over_ranks(arguments, decode_models, write_json_report)
    started = time.perf_counter()
    results = _Results()
    try:
        _measure_all(arguments, layer_counts, model_types, decode_models, results)
    except GenerationMismatch as mismatch:
        _print_report(arguments, results, time.perf_counter() - started)
        print(f"TOKEN MISMATCH: {mismatch}", file=sys.stderr)
        return command.EXIT_MISMATCH
    except KeyboardInterrupt as interrupt:
        if isinstance(interrupt, command.InterruptedWithPartialResult):
            results.keep_partial(interrupt.partial)
        _print_report(arguments, results, time.perf_counter() - started)
        raise
    return _print_report(arguments, results, time.perf_counter() - started)


def _print_report(arguments: argparse.Namespace, results: _Results, seconds: float) -> int:
    """The tables (and the JSON file) of what was measured; the exit status."""
    timings, decode_measurements = results.timings, results.decode_measurements
    environment = _environment()
    size = "reduced run" if arguments.reduced else "full run"
    if arguments.reduced and not arguments.quick:
        size += " (the CPU default; --full-size for the released sizes)"
    print(
        f"mlx-lm patch benchmark on {environment['device']} (MLX {environment['mlx']}, "
        f"mlx-lm {environment['mlx_lm']}, {environment['cpu_count']} CPUs), {size}, "
        f"{seconds:.0f} s"
    )
    if results.interrupted_in is not None:
        print(
            f"INTERRUPTED during {results.interrupted_in}: the tables hold what was measured "
            "before it and that measurement's complete rounds"
        )
    # The rank program's module, so imported only here: ``python -m`` runs it.
    from mlx_dualnorm.commands.mlx_lm_bench.report import format_decode_table, format_table

    if timings:
        print(format_table(timings))
    if decode_measurements:
        print(format_decode_table(decode_measurements, environment["device"]))
    if arguments.json:
        report = {
            "schema": REPORT_SCHEMA,
            "environment": environment,
            "mode": arguments.mode,
            "reduced": arguments.reduced,
            "interrupted_in": results.interrupted_in,
            "timings": [timing.summary() for timing in timings],
            "decode": [measurement.summary() for measurement in decode_measurements],
        }
        write_json_report(arguments.json, report)
    return 1 if _report_mismatches(decode_measurements) else 0


def write_json_report(path: Path, report: object) -> None:
    """Writes ``--json`` after the tables are printed; a write that fails
    anyway (the path was checked when the arguments were read) is one line
    and exit 2, the measurements already on stdout."""
    sys.stdout.flush()
    try:
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
    except OSError as failed:
        raise command.Unavailable(f"could not write {path}: {failed.strerror or failed}") from failed
    print(f"wrote {path}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m mlx_dualnorm mlx-lm-bench``; see the module doc."""
    return command.run_tool(build_parser(), _run, argv)
