"""What ``mlx-lm-bench`` prints and writes (tables, JSON), and ``--ranks N``:
decode models tensor-parallel over N loopback ranks, each rank running
``python -m`` this module."""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx

from mlx_dualnorm.commands.mlx_lm_bench.measurements import (
    DECODE_SHAPE, PATCHED, QUICK_DECODE_VOCABULARY, DecodeMeasurement, PairedTiming, run_decode,
)
from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.launch import DIRECT, launch
from mlx_dualnorm.commands.shared.synthetic import DECODE_MODELS, decode_model_config

REPORT_SCHEMA = "mlx_dualnorm.mlx_lm_bench/3"
RANK_PROGRAM = ("-m", "mlx_dualnorm.commands.mlx_lm_bench.report")
# Each rank is a process with its own copy of the unsharded parts of the
# model; more than this is no benchmark on one machine.
MAX_RANKS = 8


def _table_header(first_column: str, width: int) -> str:
    return (
        f"{first_column:<{width}} {'unit':<9} {'unpatched':>10} {PATCHED:>10} {'ratio':>7}"
        "  (per-round min..max)"
    )


def _table_row(name: str, width: int, unit: str, summary: dict, digits: int) -> str:
    """Median times, their ratio, then the per-round ratios' range, to ``digits`` decimals."""
    spread = summary["time_ratio_patched_over_unpatched"]
    return (
        f"{name:<{width}} {unit:<9} {summary['unpatched_time']['median']:>10.3f} "
        f"{summary['patched_time']['median']:>10.3f} "
        f"{summary['time_ratio_of_medians']:>6.{digits}f}x  "
        f"({spread['min']:.{digits}f}..{spread['max']:.{digits}f}, {summary['rounds']} rounds)"
    )


def format_table(timings: list[PairedTiming]) -> str:
    return "\n".join([
        _table_header("measurement", 34),
        *(_table_row(t.name, 34, t.unit, t.summary(), digits=2) for t in timings),
        "columns: median time per round, unpatched (mlx-lm's normalize_qk) and patched "
        "(mlx_dualnorm.integrations.mlx_lm.patch());",
        "  ratio = median patched time / median unpatched time, then the per-round ratios' "
        "min..max: lower is better, below 1.00x the patch is faster",
        f"  prework_N_layers: N chained q/k normalizations at {DECODE_SHAPE} bfloat16, "
        "one eval per token",
        "  generation_MODEL_DTYPE: ms per decode token of a small random mlx-lm model",
    ])


def format_decode_table(measurements: list[DecodeMeasurement], device: str) -> str:
    first = measurements[0]
    lines = [
        f"decode, random bfloat16 weights at released models' dimensions, on {device}: "
        f"{first.prompt_tokens}-token prompt, then {first.decode_steps} greedy decode steps "
        "per round (KV cache, one eval per token)",
        _table_header("model", 16),
    ]
    for measurement in measurements:
        size = measurement.dimensions()
        layers = f"{size['num_hidden_layers']} layers"
        if "gated_delta_layers" in size:
            layers += (f" ({size['gated_delta_layers']} gated-delta, "
                       f"{size['full_attention_layers']} full-attention)")
        lines += [
            _table_row(measurement.model, 16, "ms/token", measurement.summary(), digits=3),
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
    arguments: argparse.Namespace, measured: list, interrupted_in: Optional[str], seconds: float
) -> int:
    """The tables (and ``--json``) of what was measured, ``interrupted_in`` naming the
    measurement cut short; 1 when a decode model's tokens differed."""
    from mlx_lm import __version__ as mlx_lm_version

    timings = [timing for timing in measured if isinstance(timing, PairedTiming)]
    decodes = [decode for decode in measured if isinstance(decode, DecodeMeasurement)]
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
    if timings:
        print(format_table(timings))
    if decodes:
        print(format_decode_table(decodes, environment["device"]))
    if arguments.json:
        write_json_report(arguments.json, {
            "schema": REPORT_SCHEMA, "environment": environment, "mode": arguments.mode,
            "reduced": arguments.reduced, "interrupted_in": interrupted_in,
            "timings": [timing.summary() for timing in timings],
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python {' '.join(RANK_PROGRAM)}",
        description="One rank of mlx-lm tensor-parallel over mx.distributed, patched and "
        "not (started by mlx-lm-bench --ranks).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="decode ms/token, patched vs unpatched")
    bench.add_argument("--model", default="qwen3-1024")
    bench.add_argument("--layers", type=command.Count(1, 512), default=None)
    bench.add_argument("--vocab-size", type=command.Count(2, 1 << 20), default=None)
    bench.add_argument("--steps", type=command.Count(1, 1024), default=16)
    bench.add_argument("--rounds", type=command.Count(1, 100), default=5)
    bench.add_argument("--out", required=True, help="folder for rank 0's bench.json")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """One rank's decode rounds of the sharded model (:func:`run_decode`);
    rank 0 writes the report that :func:`run_over_ranks` reads back."""
    arguments = _parser().parse_args(argv)
    group = mx.distributed.init(strict=True, backend="ring")
    config = decode_model_config(
        arguments.model, layers=arguments.layers, vocab_size=arguments.vocab_size
    )
    measurement = run_decode(
        arguments.model, arguments.steps, arguments.rounds, config=config, group=group
    )
    timing = measurement.timing
    if group.rank() == 0:
        command.write_json(Path(arguments.out) / "bench.json", {
            "model": arguments.model,
            "config": {k: v for k, v in config.items() if isinstance(v, (int, float, str))},
            "ranks": group.size(), "rank": group.rank(), "decode_steps": arguments.steps,
            "rounds": arguments.rounds, "unit": "ms/token",
            "unpatched": timing.unpatched, "patched": timing.patched,
            "ratios_patched_over_unpatched": timing.time_ratios,
            "token_mismatch": measurement.token_mismatch,
        })
    return 1 if measurement.token_mismatch else 0


def format_bench_report(report: dict) -> str:
    """Median and range over rounds of ms/token, both paths, and the ratio."""

    def spread(key: str, digits: int) -> str:
        summary = command.spread(report[key])
        return (f"{summary['median']:.{digits}f} "
                f"[{summary['min']:.{digits}f} .. {summary['max']:.{digits}f}]")

    config = report["config"]
    shape = ", ".join(f"{key} {config[key]}" for key in
                      ("num_hidden_layers", "hidden_size", "vocab_size") if key in config)
    lines = [
        f"decode, {report['model']} ({shape}), tensor-parallel over {report['ranks']} ranks "
        f"(ring backend, loopback), {report['rounds']} interleaved rounds of "
        f"{report['decode_steps']} decode steps; median [min .. max] over rounds:",
        f"  unpatched  {spread('unpatched', 2)} ms/token",
        f"  patched    {spread('patched', 2)} ms/token",
        f"  patched / unpatched  {spread('ratios_patched_over_unpatched', 3)}",
    ]
    if report["token_mismatch"]:
        lines.append(f"  TOKEN MISMATCH at {report['token_mismatch']}")
    return "\n".join(lines)


def _has_shard(name: str) -> bool:
    """Whether decode model ``name``'s mlx-lm family has ``Model.shard``."""
    model_type = DECODE_MODELS[name].config["model_type"]
    try:
        module = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError:  # a family this mlx-lm cannot load runs nowhere
        return False
    return hasattr(module.Model, "shard")


def _indivisible(ranks: int, name: str) -> dict[str, int]:
    """The head counts and MLP widths of decode model ``name`` that ``ranks`` does not divide:
    shard_linear would fail in every rank, or a head count be silently floored."""
    return {
        key: value for key, value in DECODE_MODELS[name].config.items()
        if (key in ("num_attention_heads", "num_key_value_heads")
            or (key.endswith("intermediate_size") and isinstance(value, int) and value > 0))
        and value % ranks
    }


def run_over_ranks(arguments: argparse.Namespace, decode_models: Sequence[str]) -> int:
    """``--ranks N``, the rank count checked against every model before any rank starts.
    The ranks are started directly: mlx.launch's output relay would take CPU from them.
    1 on a token mismatch or a failed rank."""
    shardable = [name for name in decode_models if _has_shard(name)]
    if not shardable:
        named = f"none of {', '.join(decode_models)} has" if decode_models else "none named"
        raise command.Unavailable(
            f"--ranks times the decode models whose mlx-lm family has Model.shard: {named} "
            f"(--decode-models any of {', '.join(n for n in DECODE_MODELS if _has_shard(n))})"
        )
    for name in shardable:
        indivisible = _indivisible(arguments.ranks, name)
        if indivisible:
            shown = ", ".join(f"{key} {value}" for key, value in indivisible.items())
            possible = [
                count for count in range(2, MAX_RANKS + 1)
                if not any(_indivisible(count, model) for model in shardable)
            ]
            raise command.Unavailable(
                f"{arguments.ranks} ranks cannot shard {name}: the rank count must divide its "
                f"{shown} (--ranks one of {', '.join(map(str, possible)) or 'none'} for "
                f"{', '.join(shardable)})"
            )
    for name in decode_models:
        if name not in shardable:
            model_type = DECODE_MODELS[name].config["model_type"]
            print(f"{name}: mlx-lm's {model_type} has no Model.shard; left out", file=sys.stderr)
    reports = []
    for name in shardable:
        print(f"decode over {arguments.ranks} ranks, {name} ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as out:
            rank_arguments = ["bench", "--model", name, "--steps", str(arguments.decode_steps),
                              "--rounds", str(arguments.decode_rounds), "--out", out]
            if arguments.reduced:  # as for one rank: asked for, or a CPU's default
                rank_arguments += ["--layers", str(DECODE_MODELS[name].quick_layers),
                                   "--vocab-size", str(QUICK_DECODE_VOCABULARY)]
            result = launch(rank_arguments, ranks=arguments.ranks, timeout_s=600.0,
                            launcher=DIRECT, program=RANK_PROGRAM)
            report_path = Path(out) / "bench.json"
            if not report_path.exists():
                raise RuntimeError(result.describe())
            report = json.loads(report_path.read_text())
        report.update(launch_seconds=result.seconds, launcher=DIRECT, ok=result.ok)
        print(format_bench_report(report), flush=True)
        reports.append(report)
    if arguments.json:
        write_json_report(arguments.json, {"ranks": reports})
    failed = any(report["token_mismatch"] or not report["ok"] for report in reports)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
