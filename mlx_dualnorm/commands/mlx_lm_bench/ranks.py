"""``mlx-lm-bench --ranks N``: decode tokens of one model tensor-parallel
over ``mx.distributed`` ranks on loopback, patched and unpatched.

``python -m mlx_dualnorm.commands.mlx_lm_bench.ranks bench`` is what every
rank runs: it builds a decode model (``Model.shard``), times greedy decode
tokens patched and unpatched in interleaved rounds and writes rank 0's
report. :func:`launch` starts the ranks on the ring backend on loopback
only (127.0.0.1, free ports chosen here), through ``mlx.launch`` or
directly with what it hands the ranks, bounded in time, and kills every
process it started when the time runs out, a rank fails, or it is
interrupted; :func:`bench_over_ranks` launches ``bench`` and reads the
report back.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import signal
import site
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from mlx_dualnorm.commands.mlx_lm_bench.measurements import QUICK_DECODE_VOCABULARY
from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.command import Count
from mlx_dualnorm.commands.shared.synthetic import DECODE_MODELS

__all__ = [
    "LAUNCHERS", "LaunchResult", "bench_over_ranks", "format_bench_report", "free_port_run",
    "launch", "main", "ranks_refusal", "run_bench", "run_over_ranks",
]

RANK_PROGRAM = ("-m", "mlx_dualnorm.commands.mlx_lm_bench.ranks")
# Each rank is a process with its own copy of the unsharded parts of the
# model; more than this is no benchmark on one machine.
MAX_RANKS = 8

LOOPBACK = "127.0.0.1"
# mlx.launch is a console script; its entry point is resolved in the child,
# so this works wherever mlx is installed, with or without the script on PATH.
LAUNCHER_CODE = (
    "import sys\n"
    "from importlib.metadata import entry_points\n"
    "(script,) = entry_points(group='console_scripts', name='mlx.launch')\n"
    "sys.argv[0] = 'mlx.launch'\n"
    "sys.exit(script.load()())\n"
)


@dataclasses.dataclass
class LaunchResult:
    returncode: Optional[int]  # None: killed at the time limit
    stdout: str
    stderr: str
    seconds: float
    process_groups: list[int]  # one per process started, its children in it

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    @property
    def failed_ranks(self) -> list[str]:
        """mlx.launch's lines about ranks that failed or were killed: it
        exits 0 even then, so its status alone says nothing about them."""
        return [line.strip() for line in self.stderr.splitlines() if "Node with rank" in line]

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.failed_ranks

    def describe(self) -> str:
        status = "killed at the time limit" if self.timed_out else f"exit status {self.returncode}"
        return (
            f"mlx.launch: {status} after {self.seconds:.1f} s\n--- stdout ---\n"
            f"{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-4000:]}"
        )


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive loopback ports free right now (the
    ring backend listens on ``starting_port + rank``), from the range the
    system hands out for port 0."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((LOOPBACK, 0))
            start = probe.getsockname()[1]
        if start + count <= 65535 and all(_bindable(start + i) for i in range(count)):
            return start
    raise RuntimeError(f"no {count} consecutive free ports on {LOOPBACK}")


def _rank_environment() -> dict:
    """This environment, with the folder this package was imported from put
    first on the ranks' import path where the interpreter would not find it
    by itself (a source tree); an installed package needs nothing."""
    import mlx_dualnorm

    environment = dict(os.environ)
    package_parent = str(Path(mlx_dualnorm.__file__).resolve().parent.parent)
    site_folders = {str(Path(p).resolve()) for p in site.getsitepackages()}
    with contextlib.suppress(Exception):
        site_folders.add(str(Path(site.getusersitepackages()).resolve()))
    if package_parent not in site_folders:
        environment["PYTHONPATH"] = os.pathsep.join(
            [package_parent, *filter(None, [environment.get("PYTHONPATH")])]
        )
    environment.setdefault("PYTHONFAULTHANDLER", "1")
    return environment


def _kill_groups(processes: Sequence[subprocess.Popen]) -> None:
    """Kills the process group each of ``processes`` leads (itself and what
    it started: mlx.launch's ranks) and reaps the processes."""
    for process in processes:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    for process in processes:
        process.wait()


def _wait_for_all_or_a_failure(processes: Sequence[subprocess.Popen], deadline: float) -> list:
    """The exit statuses once all processes ended or one failed (the others
    still running, None: they would wait for it forever in a collective);
    TimeoutError past ``deadline``."""
    while True:
        codes = [process.poll() for process in processes]
        if all(code is not None for code in codes) or any(code for code in codes):
            return codes
        if time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(0.05)


MLX_LAUNCH, DIRECT = "mlx.launch", "direct"
LAUNCHERS = (MLX_LAUNCH, DIRECT)


def launch(
    rank_arguments: Sequence[str],
    *,
    ranks: int = 2,
    timeout_s: float = 120.0,
    cwd: Optional[Path] = None,
    attempts: int = 2,
    launcher: str = MLX_LAUNCH,
    program: Sequence[str] = RANK_PROGRAM,
) -> LaunchResult:
    """Runs ``program`` (what follows the interpreter: this module's
    ``bench`` by default) with ``rank_arguments`` on ``ranks`` ranks of
    the ring backend on loopback, with this interpreter, on free ports.

    ``launcher`` "mlx.launch" runs ``mlx.launch --backend ring --hosts
    127.0.0.1 -n <ranks>``, as a user would; "direct" starts the ranks here
    with what mlx.launch hands them (``MLX_RANK``, ``MLX_HOSTFILE`` naming a
    file with one ``["127.0.0.1:<port>"]`` per rank), for timing: mlx.launch
    relays the ranks' output in threads that poll without blocking, CPU
    time taken from the ranks.

    Past ``timeout_s`` every process started is killed (``returncode``
    None): each leads a process group, killed whole. A run whose ports were taken
    in the meantime is retried on new ones, up to ``attempts`` runs."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r}: choose from {', '.join(LAUNCHERS)}")
    result = _launch_once([*program, *rank_arguments], ranks, timeout_s, cwd, launcher)
    for _ in range(attempts - 1):
        if result.timed_out or result.ok or not _ports_were_taken(result):
            break
        result = _launch_once([*program, *rank_arguments], ranks, timeout_s, cwd, launcher)
    return result


def _ports_were_taken(result: LaunchResult) -> bool:
    text = (result.stdout + result.stderr).lower()
    return "address already in use" in text or "couldn't bind" in text


def _launch_once(rank_arguments, ranks, timeout_s, cwd, launcher) -> LaunchResult:
    rank_command = [sys.executable, *rank_arguments]
    first_port = free_port_run(ranks)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        scratch_path = Path(scratch)
        environment = _rank_environment()
        if launcher == MLX_LAUNCH:
            commands = [[
                sys.executable, "-c", LAUNCHER_CODE,
                "--backend", "ring", "--hosts", LOOPBACK, "-n", str(ranks),
                "--starting-port", str(first_port), "--", *rank_command,
            ]]
            environments = [environment]
        else:
            hostfile = scratch_path / "hostfile.json"
            hostfile.write_text(json.dumps(
                [[f"{LOOPBACK}:{first_port + rank}"] for rank in range(ranks)]
            ))
            commands = [rank_command] * ranks
            environments = [
                {**environment, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
                for rank in range(ranks)
            ]
        outputs = [
            (open(scratch_path / f"stdout{i}", "w+"), open(scratch_path / f"stderr{i}", "w+"))
            for i in range(len(commands))
        ]
        processes: list[subprocess.Popen] = []
        returncode: Optional[int] = None
        try:
            for index, (process_command, rank_environment) in enumerate(zip(commands, environments)):
                # Each process leads a process group of its own, so one kill
                # per group reaches it and everything it started.
                # mlx.launch polls its stdin: a pipe left open keeps that
                # poll blocking (at end of file it would spin a core).
                processes.append(subprocess.Popen(
                    process_command, stdin=subprocess.PIPE, stdout=outputs[index][0],
                    stderr=outputs[index][1], cwd=str(cwd or scratch), env=rank_environment,
                    start_new_session=True,
                ))
            codes = _wait_for_all_or_a_failure(processes, time.monotonic() + timeout_s)
            returncode = next((code for code in codes if code not in (0, None)), 0)
            if launcher == DIRECT and returncode != 0:
                outputs[0][1].write("".join(
                    f"Node with rank {rank} exited with code {code}\n"
                    for rank, code in enumerate(codes) if code not in (0, None)
                ))
        except TimeoutError:
            returncode = None
        finally:
            # Also on success: a rank that outlived the launcher would hold a port.
            _kill_groups(processes)
            for process in processes:
                if process.stdin is not None:
                    process.stdin.close()
        texts = []
        for stdout, stderr in outputs:
            stdout.seek(0)
            stderr.seek(0)
            texts.append((stdout.read(), stderr.read()))
            stdout.close()
            stderr.close()
        return LaunchResult(
            returncode, "".join(out for out, _ in texts), "".join(err for _, err in texts),
            time.monotonic() - started, [process.pid for process in processes],
        )


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
        result = launch(arguments, ranks=ranks, timeout_s=timeout_s, launcher=launcher)
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
