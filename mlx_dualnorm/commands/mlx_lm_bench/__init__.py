"""``python -m mlx_dualnorm mlx-lm-bench``: decode of random models at released
dimensions through mlx-lm, unpatched against patched in interleaved rounds
(:mod:`.measurements`), every round's greedy tokens compared (a mismatch exits
1); here the command line, its table and its JSON."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx

from mlx_dualnorm.commands.mlx_lm_bench.measurements import (
    DECODE_DTYPE_OF_WEIGHTS, DECODE_PROMPT_TOKENS, PATCHED, QUICK_DECODE_VOCABULARY,
    DecodeMeasurement, PairedTiming, decode_progress_steps, first_token_mismatch, run_decode,
)
from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.generation import refuse_what_cannot_patch
from mlx_dualnorm.commands.shared.synthetic import DECODE_MODELS

# The command, and what bench/'s scripts (DECODE_*) and the tests import.
__all__ = [
    "DECODE_DTYPE_OF_WEIGHTS", "DECODE_PROMPT_TOKENS", "QUICK_DECODE_VOCABULARY",
    "DecodeMeasurement", "PairedTiming", "first_token_mismatch", "main", "run_decode",
]

# Each count: (the full run's default, the reduced run's, the most it may be). A round holds
# one time per step and a model's cache grows by a position per step, so the most bounds the
# run's memory.
COUNTS = {"decode_steps": (32, 4, 1024), "decode_rounds": (5, 2, 100)}
COUNT_HELP = {"decode_steps": "greedy decode steps per round",
              "decode_rounds": "decode rounds, each path once per round"}


REPORT_SCHEMA = "mlx_dualnorm.mlx_lm_bench/4"


def table_header(first_column: str, width: int) -> str:
    return (
        f"{first_column:<{width}} {'unit':<9} {'unpatched':>10} {PATCHED:>10} {'ratio':>7}"
        "  (per-round min..max)"
    )


def table_row(name: str, width: int, unit: str, summary: dict, digits: int) -> str:
    """Median times, their ratio, then the per-round ratios' range, to ``digits`` decimals."""
    spread = summary["time_ratio_patched_over_unpatched"]
    return (
        f"{name:<{width}} {unit:<9} {summary['unpatched_time']['median']:>10.3f} "
        f"{summary['patched_time']['median']:>10.3f} "
        f"{summary['time_ratio_of_medians']:>6.{digits}f}x  "
        f"({spread['min']:.{digits}f}..{spread['max']:.{digits}f}, {summary['rounds']} rounds)"
    )


def format_decode_table(measurements: list[DecodeMeasurement], device: str) -> str:
    first = measurements[0]
    lines = [
        f"decode, random bfloat16 weights at released models' dimensions, on {device}: "
        f"{first.prompt_tokens}-token prompt, then {first.decode_steps} greedy decode steps "
        "per round (KV cache, one eval per token)",
        table_header("model", 16),
    ]
    for measurement in measurements:
        size = measurement.dimensions()
        layers = f"{size['num_hidden_layers']} layers"
        if "gated_delta_layers" in size:
            layers += (f" ({size['gated_delta_layers']} gated-delta, "
                       f"{size['full_attention_layers']} full-attention)")
        lines += [
            table_row(measurement.model, 16, "ms/token", measurement.summary(), digits=3),
            f"  like {measurement.resembles}: {layers}, hidden {size['hidden_size']}, "
            f"MLP {size['intermediate_size']}, {size['num_attention_heads']}/"
            f"{size['num_key_value_heads']} heads x {size['head_dim']}, "
            f"vocabulary {size['vocab_size']}",
        ]
        if measurement.quick_reduced:
            real = DECODE_MODELS[measurement.model].config
            lines.append(f"  QUICK: reduced from {real['num_hidden_layers']} layers and vocabulary "
                         f"{real['vocab_size']}; not the real model's time per token")
        engaged = measurement.engaged
        if engaged is not None:
            prework = "".join(f" ({name} {count})" for name, count in engaged["by_prework"].items())
            text = (
                f"  patch engaged: attention layers {engaged['attention_layers_engaged']}{prework}"
                f", left to mlx-lm {engaged['attention_layers_left']}; gated-delta calls folded "
                f"{engaged['gated_delta_calls_folded']} (warm-up run)"
            )
            if not (engaged["attention_layers_engaged"] or engaged["gated_delta_calls_folded"]):
                text += "; NOTHING: the patch covers no layer of this model, the ratio is noise"
            lines.append(text)
        tokens = "identical" if measurement.token_mismatch is None else "MISMATCH"
        lines.append(f"  greedy tokens, patched vs unpatched, every round: {tokens}")
    lines.append(
        "  ratio = median patched / median unpatched time per decode token, then the "
        "per-round ratios' min..max: lower is better, below 1.000x the patch is faster"
    )
    return "\n".join(lines)


def print_report(
    arguments: argparse.Namespace, decodes: list[DecodeMeasurement],
    interrupted_in: Optional[str], seconds: float,
) -> int:
    """The table (and ``--json``) of what was measured, ``interrupted_in`` naming the
    measurement cut short; 1 when a model's tokens differed."""
    from mlx_lm import __version__ as mlx_lm_version

    environment = {
        "date": datetime.date.today().isoformat(), "device": str(mx.default_device()),
        "mlx": getattr(mx, "__version__"),  # not in MLX's type stubs
        "mlx_lm": mlx_lm_version, "python": platform.python_version(),
        "machine": platform.machine(), "cpu_count": os.cpu_count(),
    }
    size = "reduced run" if arguments.reduced else "full run"
    if arguments.reduced and not arguments.quick:
        size += " (the CPU default; --full-size for the released sizes)"
    print(f"mlx-lm patch benchmark on {environment['device']} (MLX {environment['mlx']}, "
          f"mlx-lm {mlx_lm_version}, {environment['cpu_count']} CPUs), {size}, {seconds:.0f} s")
    if interrupted_in is not None:
        print(f"INTERRUPTED during {interrupted_in}: the tables hold what was measured before "
              "it and that measurement's complete rounds")
    if decodes:
        print(format_decode_table(decodes, environment["device"]))
    if arguments.json:
        write_json_report(arguments.json, {
            "schema": REPORT_SCHEMA, "environment": environment, "mode": arguments.mode,
            "reduced": arguments.reduced, "interrupted_in": interrupted_in,
            "decode": [decode.summary() for decode in decodes],
        })
    mismatched = [decode for decode in decodes if decode.token_mismatch is not None]
    for decode in mismatched:
        print(f"TOKEN MISMATCH: {decode.model}: greedy tokens differ from the first unpatched "
              f"round at {decode.token_mismatch}", file=sys.stderr)
    return 1 if mismatched else 0


def write_json_report(path: Path, report: object) -> None:
    """``--json``, written after the tables are printed."""
    sys.stdout.flush()
    with command.writing(path):
        command.write_json(path, report)
    command.progress_to_stderr(f"wrote {path}")


def add_decode_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--decode-models`` and the counts of each model's rounds (steps, rounds)."""
    parser.add_argument(
        "--decode-models", default=",".join(DECODE_MODELS),
        help="comma-separated models at released dimensions to time decode tokens with "
        f"({', '.join(DECODE_MODELS)})",
    )
    for name, (full, reduced, most) in COUNTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=command.Count(1, most),
                            help=f"{COUNT_HELP[name]} (default: {full}, or {reduced} reduced)")


def add_run_size_arguments(parser: argparse.ArgumentParser) -> None:
    """``--quick`` or ``--full-size``: the reduced run, or the released sizes."""
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", action="store_true",
        help="the reduced run: the smaller defaults above; the models keep their layer "
        f"shapes but get fewer layers and a vocabulary of {QUICK_DECODE_VOCABULARY} "
        "(the default on a CPU)",
    )
    size.add_argument(
        "--full-size", action="store_true",
        help="the full run even on a CPU: the larger defaults and the models at their released "
        "sizes (over an hour on 2 CPU cores; the default on a GPU)",
    )


def read_decode_arguments(arguments: argparse.Namespace,
                          parser: argparse.ArgumentParser) -> list[str]:
    """The decode models named (none, an empty or an unknown name exits 2), after setting
    ``arguments.reduced`` and the counts left to their defaults. Full-size decode on a CPU
    takes over an hour (bfloat16 matmuls on 2 cores), so the default device, selected
    before, gets the reduced run if it is a CPU, unless ``--full-size`` says otherwise."""
    try:
        decode_models = command.name_list("--decode-models", arguments.decode_models,
                                          DECODE_MODELS)
    except ValueError as bad_names:
        parser.error(str(bad_names))
    if not decode_models:
        parser.error("--decode-models: no model named")
    on_cpu = mx.default_device().type == mx.cpu
    arguments.reduced = arguments.quick or (on_cpu and not arguments.full_size)
    for name, (full, reduced, _) in COUNTS.items():
        if getattr(arguments, name) is None:
            setattr(arguments, name, reduced if arguments.reduced else full)
    return decode_models


def build_parser() -> argparse.ArgumentParser:
    parser = command.tool_parser(
        "mlx-lm-bench",
        "mlx-lm unpatched against patched by mlx_dualnorm: decode time per token of random "
        "models at released dimensions, greedy tokens compared every round. Ratios are patched "
        "time / unpatched time: lower is better.",
    )
    add_decode_model_arguments(parser)
    command.add_mode_argument(parser)
    add_run_size_arguments(parser)
    parser.add_argument(
        "--json", metavar="PATH", type=command.output_file,
        help="also write the report as JSON to PATH (its folder must exist; checked before "
        "the run)",
    )
    command.add_device_argument(parser)
    return parser


def _run(arguments: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    command.select_device(arguments.device, parser)
    decode_models = read_decode_arguments(arguments, parser)
    refuse_what_cannot_patch(arguments.mode)
    steps, rounds = arguments.decode_steps, arguments.decode_rounds
    started = time.perf_counter()
    measured: list[DecodeMeasurement] = []
    model: Optional[str] = None  # the model under way
    try:
        for number, model in enumerate(decode_models, 1):
            progress = command.StepProgress(f"[{number}/{len(decode_models)}] decode, {model}",
                                            decode_progress_steps(steps, rounds),
                                            min_interval_s=1.0)
            measured.append(run_decode(model, steps, rounds, arguments.mode,
                                       quick=arguments.reduced, progress=progress.step))
    except KeyboardInterrupt as interrupt:
        partial = getattr(interrupt, "partial", None)  # InterruptedWithPartialResult's
        if partial is not None:
            measured.append(partial)
        print_report(arguments, measured, f"decode, {model}", time.perf_counter() - started)
        raise
    return print_report(arguments, measured, None, time.perf_counter() - started)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m mlx_dualnorm mlx-lm-bench``; see the module doc."""
    return command.run_tool(build_parser(), _run, argv)
