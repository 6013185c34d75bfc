"""Programs run over ``mx.distributed`` ranks on loopback: :func:`launch`
starts one on the ring backend (127.0.0.1 only, free ports chosen here),
through ``mlx.launch`` or directly with what it hands the ranks, bounded in
time, and kills every process it started when the time runs out, a rank
fails, or it is interrupted. ``mlx-lm-bench --ranks`` starts its rank
program with it (:mod:`~mlx_dualnorm.commands.mlx_lm_bench.report`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import site
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["DIRECT", "LAUNCHERS", "LaunchResult", "MLX_LAUNCH", "free_port_run", "launch"]

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
    program: Sequence[str] = (),
) -> LaunchResult:
    """Runs ``program`` (what follows the interpreter: ``-m MODULE`` or a
    script) with ``rank_arguments`` on ``ranks`` ranks of
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
