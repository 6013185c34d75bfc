"""What ``mlx-lm-bench`` reports: the tables of its measurements
(:mod:`~mlx_dualnorm.commands.mlx_lm_bench.measurements`), and, for
``--ranks N``, decode tokens of the models whose mlx-lm family has
``Model.shard``, tensor-parallel over N loopback ranks.

``python -m mlx_dualnorm.commands.mlx_lm_bench.report`` is what every rank
runs (started by :func:`~mlx_dualnorm.commands.shared.launch.launch`): it
times decode rounds of the sharded model with ``run_decode`` and writes
rank 0's report, which :func:`bench_over_ranks` reads back.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional, Sequence

from mlx_dualnorm.commands.mlx_lm_bench.measurements import (
    DECODE_SHAPE, PATCHED, QUICK_DECODE_VOCABULARY, DecodeMeasurement, PairedTiming,
)
from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.command import Count
from mlx_dualnorm.commands.shared.launch import DIRECT, launch
from mlx_dualnorm.commands.shared.synthetic import DECODE_MODELS

__all__ = [
    "MAX_RANKS", "bench_over_ranks", "format_bench_report", "format_decode_table",
    "format_table", "main", "ranks_refusal", "run_bench", "run_over_ranks",
]

RANK_PROGRAM = ("-m", "mlx_dualnorm.commands.mlx_lm_bench.report")
# Each rank is a process with its own copy of the unsharded parts of the
# model; more than this is no benchmark on one machine.
MAX_RANKS = 8

# ---- Tables ------------------------------------------------------------------


def _table_header(first_column: str, width: int) -> str:
    return (
        f"{first_column:<{width}} {'unit':<9} {'unpatched':>10} {PATCHED:>10} {'ratio':>7}"
        "  (per-round min..max)"
    )


def _table_row(name: str, width: int, unit: str, summary: dict, ratio_digits: int) -> str:
    """One paired measurement: median times, their ratio, then the range of
    the per-round ratios, with ``ratio_digits`` decimals."""
    spread = summary["time_ratio_patched_over_unpatched"]
    return (
        f"{name:<{width}} {unit:<9} "
        f"{summary['unpatched_time']['median']:>10.3f} "
        f"{summary['patched_time']['median']:>10.3f} "
        f"{summary['time_ratio_of_medians']:>6.{ratio_digits}f}x  "
        f"({spread['min']:.{ratio_digits}f}..{spread['max']:.{ratio_digits}f}, "
        f"{summary['rounds']} rounds)"
    )


def format_table(timings: list[PairedTiming]) -> str:
    lines = [_table_header("measurement", 34)]
    lines += [
        _table_row(timing.name, 34, timing.unit, timing.summary(), ratio_digits=2)
        for timing in timings
    ]
    lines += [
        "columns: median time per round, unpatched (mlx-lm's normalize_qk) and patched "
        "(mlx_dualnorm.integrations.mlx_lm.patch());",
        "  ratio = median patched time / median unpatched time, then the per-round ratios' "
        "min..max: lower is better, below 1.00x the patch is faster",
        f"  prework_N_layers: N chained q/k normalizations at {DECODE_SHAPE} bfloat16, "
        "one eval per token",
        "  generation_MODEL_DTYPE: ms per decode token of a small random mlx-lm model",
    ]
    return "\n".join(lines)


def _dimensions_text(dimensions: dict) -> str:
    layers = f"{dimensions['num_hidden_layers']} layers"
    if "gated_delta_layers" in dimensions:
        layers += (
            f" ({dimensions['gated_delta_layers']} gated-delta, "
            f"{dimensions['full_attention_layers']} full-attention)"
        )
    return (
        f"{layers}, hidden {dimensions['hidden_size']}, MLP {dimensions['intermediate_size']}, "
        f"{dimensions['num_attention_heads']}/{dimensions['num_key_value_heads']} heads x "
        f"{dimensions['head_dim']}, vocabulary {dimensions['vocab_size']}"
    )


def _engaged_text(engaged: dict) -> str:
    attention = engaged["attention_layers_engaged"]
    text = (
        f"patch engaged: attention layers {attention}"
        + "".join(f" ({prework} {layers})" for prework, layers in engaged["by_prework"].items())
        + f", left to mlx-lm {engaged['attention_layers_left']}; "
        f"gated-delta calls folded {engaged['gated_delta_calls_folded']} (warm-up run)"
    )
    if attention == 0 and engaged["gated_delta_calls_folded"] == 0:
        text += "; NOTHING: the patch covers no layer of this model, the ratio is noise"
    return text


def format_decode_table(measurements: list[DecodeMeasurement], device: str) -> str:
    if not measurements:
        return ""
    first = measurements[0]
    lines = [
        f"decode, random bfloat16 weights at released models' dimensions, on {device}: "
        f"{first.prompt_tokens}-token prompt, then {first.decode_steps} greedy decode steps "
        "per round (KV cache, one eval per token)",
        _table_header("model", 16),
    ]
    for measurement in measurements:
        summary = measurement.summary()
        lines.append(_table_row(measurement.model, 16, "ms/token", summary, ratio_digits=3))
        lines.append(f"  like {measurement.resembles}: {_dimensions_text(summary['dimensions'])}")
        if measurement.quick_reduced:
            real = DECODE_MODELS[measurement.model].config
            lines.append(
                f"  QUICK: reduced from {real['num_hidden_layers']} layers and vocabulary "
                f"{real['vocab_size']}; not the real model's time per token"
            )
        if measurement.engaged is not None:
            lines.append("  " + _engaged_text(measurement.engaged))
        tokens = "identical" if measurement.token_mismatch is None else "MISMATCH"
        lines.append(f"  greedy tokens, patched vs unpatched, every round: {tokens}")
    lines.append(
        "  ratio = median patched / median unpatched time per decode token, then the "
        "per-round ratios' min..max: lower is better, below 1.000x the patch is faster"
    )
    return "\n".join(lines)


# ---- The rank program ---------------------------------------------------------


def run_bench(
    model_name: str, group, *, layers: Optional[int], vocab_size: Optional[int], steps: int,
    rounds: int,
) -> dict:
    """Milliseconds per decode token of one tensor-parallel model on this
    rank, unpatched and patched in interleaved rounds (``run_decode``)."""
    from mlx_dualnorm.commands.mlx_lm_bench.measurements import run_decode
    from mlx_dualnorm.commands.shared.synthetic import decode_model_config

    config = decode_model_config(model_name, layers=layers, vocab_size=vocab_size)
    measurement = run_decode(model_name, steps, rounds, config=config, group=group)
    timing = measurement.timing
    return {
        "model": model_name,
        "config": {k: v for k, v in config.items() if isinstance(v, (int, float, str))},
        "ranks": group.size(),
        "rank": group.rank(),
        "decode_steps": steps,
        "rounds": rounds,
        "unit": "ms/token",
        "unpatched": timing.unpatched,
        "patched": timing.patched,
        "ratios_patched_over_unpatched": timing.time_ratios,
        "token_mismatch": measurement.token_mismatch,
    }


def _bench_main(arguments, group) -> int:
    report = run_bench(
        arguments.model, group, layers=arguments.layers, vocab_size=arguments.vocab_size,
        steps=arguments.steps, rounds=arguments.rounds,
    )
    if group.rank() == 0:
        (Path(arguments.out) / "bench.json").write_text(json.dumps(report, indent=1))
    return 1 if report["token_mismatch"] else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python {' '.join(RANK_PROGRAM)}",
        description="One rank of mlx-lm tensor-parallel over mx.distributed, patched and "
        "not (started by mlx-lm-bench --ranks).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="decode ms/token, patched vs unpatched")
    bench.add_argument("--model", default="qwen3-1024")
    bench.add_argument("--layers", type=Count(1, 512), default=None)
    bench.add_argument("--vocab-size", type=Count(2, 1 << 20), default=None)
    bench.add_argument("--steps", type=Count(1, 1024), default=16)
    bench.add_argument("--rounds", type=Count(1, 100), default=5)
    bench.add_argument("--out", required=True, help="folder for rank 0's bench.json")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    import mlx.core as mx

    arguments = _parser().parse_args(argv)
    return _bench_main(arguments, mx.distributed.init(strict=True, backend="ring"))



# ---- Launched bench ------------------------------------------------------------


def bench_over_ranks(
    model_name: str,
    *,
    ranks: int = 2,
    steps: int = 16,
    rounds: int = 5,
    layers: Optional[int] = None,
    vocab_size: Optional[int] = None,
    timeout_s: float = 600.0,
    launcher: str = DIRECT,
) -> dict:
    """Launches ``bench`` on ``ranks`` loopback ranks and returns rank 0's
    report (:func:`run_bench`); raises RuntimeError when the job fails.
    The ranks are started directly by default: mlx.launch's output relay
    would take CPU from them (:func:`launch`)."""
    with tempfile.TemporaryDirectory() as out:
        arguments = ["bench", "--model", model_name, "--steps", str(steps),
                     "--rounds", str(rounds), "--out", out]
        if layers is not None:
            arguments += ["--layers", str(layers)]
        if vocab_size is not None:
            arguments += ["--vocab-size", str(vocab_size)]
        result = launch(
            arguments, ranks=ranks, timeout_s=timeout_s, launcher=launcher, program=RANK_PROGRAM
        )
        report_path = Path(out) / "bench.json"
        if not report_path.exists():
            raise RuntimeError(result.describe())
        report = json.loads(report_path.read_text())
    report["launch_seconds"] = result.seconds
    report["launcher"] = launcher
    report["ok"] = result.ok
    return report


def format_bench_report(report: dict) -> str:
    """Median and range over rounds of ms/token, both paths, and the ratio."""

    def spread(values: list, digits: int) -> str:
        return (f"{statistics.median(values):.{digits}f} "
                f"[{min(values):.{digits}f} .. {max(values):.{digits}f}]")

    config = report["config"]
    shape = ", ".join(f"{key} {config[key]}" for key in
                      ("num_hidden_layers", "hidden_size", "vocab_size") if key in config)
    lines = [
        f"decode, {report['model']} ({shape}), tensor-parallel over {report['ranks']} ranks "
        f"(ring backend, loopback), {report['rounds']} interleaved rounds of "
        f"{report['decode_steps']} decode steps; median [min .. max] over rounds:",
        f"  unpatched  {spread(report['unpatched'], 2)} ms/token",
        f"  patched    {spread(report['patched'], 2)} ms/token",
        f"  patched / unpatched  {spread(report['ratios_patched_over_unpatched'], 3)}",
    ]
    if report["token_mismatch"]:
        lines.append(f"  TOKEN MISMATCH at {report['token_mismatch']}")
    return "\n".join(lines)


# ---- mlx-lm-bench --ranks --------------------------------------------------------


def _has_shard(name: str) -> bool:
    """Whether decode model ``name``'s mlx-lm family has ``Model.shard``."""
    model_type = DECODE_MODELS[name].config["model_type"]
    try:
        module = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError:  # a family this mlx-lm cannot load runs nowhere
        return False
    return hasattr(module.Model, "shard")


def _indivisible(ranks: int, name: str) -> dict[str, int]:
    """The sizes of decode model ``name`` that mlx-lm's ``Model.shard``
    splits across the ranks (every layer's query and key/value heads, its
    MLP widths) and ``ranks`` does not divide."""
    return {
        key: value for key, value in DECODE_MODELS[name].config.items()
        if (key in ("num_attention_heads", "num_key_value_heads")
            or (key.endswith("intermediate_size") and isinstance(value, int) and value > 0))
        and value % ranks
    }


def ranks_refusal(ranks: int, decode_models: Sequence[str]) -> Optional[str]:
    """Why ``ranks`` tensor-parallel ranks cannot run ``decode_models``, or
    None: the rank count must divide every size ``Model.shard`` splits
    (else shard_linear fails in every rank, or a head count is silently
    floored)."""
    for name in decode_models:
        indivisible = _indivisible(ranks, name)
        if indivisible:
            shown = ", ".join(f"{key} {value}" for key, value in indivisible.items())
            possible = [
                count for count in range(2, MAX_RANKS + 1)
                if not any(_indivisible(count, model) for model in decode_models)
            ]
            return (
                f"{ranks} ranks cannot shard {name}: the rank count must divide its {shown} "
                f"(--ranks one of {', '.join(map(str, possible)) or 'none'} for "
                f"{', '.join(decode_models)})"
            )
    return None


def run_over_ranks(
    arguments: argparse.Namespace, decode_models: Sequence[str], write_json_report: Callable
) -> int:
    """``--ranks N``: each decode model whose family has ``Model.shard``,
    tensor-parallel over N loopback ranks that this command starts itself
    (the rank program above), patched
    vs unpatched; prints the table (and writes ``--json``). The rank count
    is checked against every model before any rank starts. 1 on a token
    mismatch or a failed rank."""
    shardable = [name for name in decode_models if _has_shard(name)]
    if not shardable:
        named = f"none of {', '.join(decode_models)} has" if decode_models else "none named"
        raise command.Unavailable(
            f"--ranks times the decode models whose mlx-lm family has Model.shard: {named} "
            f"(--decode-models any of {', '.join(n for n in DECODE_MODELS if _has_shard(n))})"
        )
    refusal = ranks_refusal(arguments.ranks, shardable)
    if refusal is not None:
        raise command.Unavailable(refusal)
    for name in decode_models:
        if name not in shardable:
            model_type = DECODE_MODELS[name].config["model_type"]
            print(f"{name}: mlx-lm's {model_type} has no Model.shard; left out", file=sys.stderr)
    reports = []
    for name in shardable:
        print(f"decode over {arguments.ranks} ranks, {name} ...", file=sys.stderr, flush=True)
        # The reduced run (asked for, or a CPU's default) as for one rank.
        report = bench_over_ranks(
            name, ranks=arguments.ranks, steps=arguments.decode_steps,
            rounds=arguments.decode_rounds,
            layers=DECODE_MODELS[name].quick_layers if arguments.reduced else None,
            vocab_size=QUICK_DECODE_VOCABULARY if arguments.reduced else None,
        )
        print(format_bench_report(report), flush=True)
        reports.append(report)
    if arguments.json:
        write_json_report(arguments.json, {"ranks": reports})
    failed = any(report["token_mismatch"] or not report["ok"] for report in reports)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
