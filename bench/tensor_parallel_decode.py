"""mlx-lm decode tensor-parallel over N ranks of the ring backend on loopback,
unpatched against patched: the decode models of ``mlx-lm-bench`` whose mlx-lm
family has ``Model.shard``, each rank running the same interleaved rounds
(:func:`run_decode` with the group) and rank 0 writing what it measured.

The script starts the ranks itself (``MLX_RANK`` and an ``MLX_HOSTFILE``, what
``mlx.launch`` hands them): ``mlx.launch`` relays the ranks' output in threads
that poll, which takes CPU from the ranks on a small machine.

    python bench/tensor_parallel_decode.py --ranks 2 [--decode-models qwen3-1024]
                                           [--quick | --full-size] [--json PATH]

As ``mlx-lm-bench``, a CPU gets the reduced run by default (each model's layer
shapes, fewer layers, a smaller vocabulary, fewer steps and rounds). Exit
status 0 identical tokens every round, 1 a mismatch or a failed rank, 2 what
cannot run (a rank count that does not divide a model's heads or MLP widths,
an mlx-lm the patch does not support), each failure one line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import sys
import tempfile

import mlx.core as mx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

from helpers.launch import DIRECT, launch  # noqa: E402

from mlx_dualnorm.commands.mlx_lm_bench import (  # noqa: E402
    COUNTS, add_decode_model_arguments, add_run_size_arguments, read_decode_arguments,
    write_json_report,
)
from mlx_dualnorm.commands.mlx_lm_bench.measurements import (  # noqa: E402
    QUICK_DECODE_VOCABULARY, run_decode,
)
from mlx_dualnorm.commands.shared import command  # noqa: E402
from mlx_dualnorm.commands.shared.generation import refuse_what_cannot_patch  # noqa: E402
from mlx_dualnorm.commands.shared.synthetic import DECODE_MODELS, decode_model_config  # noqa: E402

# Each rank is a process with its own copy of the unsharded parts of the
# model; more than this is no benchmark on one machine.
MAX_RANKS = 8
RANK_TIMEOUT_S = 600.0
OPERATION = "tensor_parallel_decode"


def has_shard(name: str) -> bool:
    """Whether decode model ``name``'s mlx-lm family has ``Model.shard``."""
    model_type = DECODE_MODELS[name].config["model_type"]
    try:
        module = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError:  # a family this mlx-lm cannot load runs nowhere
        return False
    return hasattr(module.Model, "shard")


def indivisible(ranks: int, name: str) -> dict[str, int]:
    """The head counts and MLP widths of decode model ``name`` that ``ranks`` does not divide:
    shard_linear would fail in every rank, or a head count be silently floored."""
    return {
        key: value for key, value in DECODE_MODELS[name].config.items()
        if (key in ("num_attention_heads", "num_key_value_heads")
            or (key.endswith("intermediate_size") and isinstance(value, int) and value > 0))
        and value % ranks
    }


def shardable_models(ranks: int, names: list[str]) -> list[str]:
    """Those of ``names`` that ``ranks`` can shard; the others left out with a line on
    stderr. None of them shardable, or a rank count that does not divide one, is
    :class:`command.Unavailable` before any rank starts."""
    shardable = [name for name in names if has_shard(name)]
    if not shardable:
        any_of = ", ".join(name for name in DECODE_MODELS if has_shard(name))
        raise command.Unavailable(f"none of {', '.join(names)} has Model.shard "
                                  f"(--decode-models any of {any_of})")
    for name in shardable:
        undivided = indivisible(ranks, name)
        if undivided:
            shown = ", ".join(f"{key} {value}" for key, value in undivided.items())
            possible = [count for count in range(2, MAX_RANKS + 1)
                        if not any(indivisible(count, model) for model in shardable)]
            raise command.Unavailable(
                f"{ranks} ranks cannot shard {name}: the rank count must divide its {shown} "
                f"(--ranks one of {', '.join(map(str, possible)) or 'none'} for "
                f"{', '.join(shardable)})"
            )
    for name in sorted(set(names) - set(shardable)):
        model_type = DECODE_MODELS[name].config["model_type"]
        print(f"{name}: mlx-lm's {model_type} has no Model.shard; left out", file=sys.stderr)
    return shardable


def run_rank(arguments: argparse.Namespace) -> int:
    """One rank's decode rounds of the sharded model; rank 0 writes ``rank0.json``."""
    if not {"MLX_RANK", "MLX_HOSTFILE"} <= os.environ.keys():
        raise command.Unavailable("a rank is started by this script (MLX_RANK and "
                                  "MLX_HOSTFILE set), not by hand")
    group = mx.distributed.init(strict=True, backend="ring")
    config = decode_model_config(arguments.model, layers=arguments.layers,
                                 vocab_size=arguments.vocab_size)
    measurement = run_decode(arguments.model, arguments.steps, arguments.rounds, config=config,
                             group=group)
    timing = measurement.timing
    if group.rank() == 0:
        command.write_json(pathlib.Path(arguments.out) / "rank0.json", {
            "model": arguments.model,
            "config": {key: value for key, value in config.items()
                       if isinstance(value, (int, float, str))},
            "ranks": group.size(), "decode_steps": arguments.steps, "rounds": arguments.rounds,
            "unit": "ms/token", "unpatched": timing.unpatched, "patched": timing.patched,
            "ratios_patched_over_unpatched": timing.time_ratios,
            "token_mismatch": measurement.token_mismatch,
        })
    return 1 if measurement.token_mismatch else 0


def format_report(report: dict) -> str:
    """Median [min .. max] over rounds of ms/token, both paths, and their ratio."""

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


def run_all(arguments: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Every shardable decode model over ``--ranks`` ranks, one after the other; a model
    whose ranks fail is one line, and the others still run."""
    command.select_device(arguments.device, parser)
    names = read_decode_arguments(arguments, parser)
    shardable = shardable_models(arguments.ranks, names)
    refuse_what_cannot_patch(None)
    reports, failed = [], False
    for name in shardable:
        print(f"decode over {arguments.ranks} ranks, {name} ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as out:
            rank_arguments = ["rank", "--model", name, "--steps", str(arguments.decode_steps),
                              "--rounds", str(arguments.decode_rounds), "--out", out]
            if arguments.reduced:
                rank_arguments += ["--layers", str(DECODE_MODELS[name].quick_layers),
                                   "--vocab-size", str(QUICK_DECODE_VOCABULARY)]
            result = launch(rank_arguments, ranks=arguments.ranks, timeout_s=RANK_TIMEOUT_S,
                            launcher=DIRECT, program=[str(pathlib.Path(__file__).resolve())])
            written = pathlib.Path(out) / "rank0.json"
            if not written.exists():
                last_line = (result.stderr.strip().splitlines() or ["no output"])[-1]
                status = ("killed at the time limit" if result.timed_out
                          else f"exit status {result.returncode}")
                print(command.error_line(OPERATION, f"{name}: the ranks failed ({status} after "
                                         f"{result.seconds:.0f} s): {last_line}"),
                      file=sys.stderr)
                failed = True
                continue
            report = json.loads(written.read_text())
        report.update(launch_seconds=result.seconds, launcher=DIRECT, ok=result.ok)
        print(format_report(report), flush=True)
        reports.append(report)
    if arguments.json:
        write_json_report(arguments.json, {"ranks": reports})
    failed = failed or any(report["token_mismatch"] or not report["ok"] for report in reports)
    return command.EXIT_MISMATCH if failed else command.EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = command.ToolParser(prog="python bench/tensor_parallel_decode.py",
                                operation=OPERATION, description=__doc__.split("\n\n")[0],
                                formatter_class=command.DefaultShownOnceFormatter)
    parser.add_argument("--ranks", type=command.Count(2, MAX_RANKS), default=2,
                        help="ranks this script starts on loopback (ring backend)")
    add_decode_model_arguments(parser)
    add_run_size_arguments(parser)
    parser.add_argument("--json", type=command.output_file, help="also write the reports here")
    command.add_device_argument(parser)
    ranks = parser.add_subparsers(dest="command", metavar="rank")
    rank = ranks.add_parser("rank", help="(started by this script) one rank", operation=OPERATION)
    rank.add_argument("--model", required=True, choices=tuple(DECODE_MODELS))
    rank.add_argument("--layers", type=command.Count(1, 512), default=None)
    rank.add_argument("--vocab-size", type=command.Count(2, 1 << 20), default=None)
    for name, (_, _, most) in COUNTS.items():  # "--steps", "--rounds": always given
        rank.add_argument(f"--{name.removeprefix('decode_')}", type=command.Count(1, most),
                          required=True)
    rank.add_argument("--out", required=True, help="folder for rank 0's rank0.json")
    return parser


if __name__ == "__main__":
    sys.exit(command.run_tool(
        build_parser(),
        lambda arguments, parser: run_rank(arguments) if arguments.command == "rank"
        else run_all(arguments, parser),
        None,
    ))
