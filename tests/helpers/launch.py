"""Programs run over ``mx.distributed`` ranks of the ring backend on loopback,
bounded in time: every process started is killed at the end."""

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
MLX_LAUNCH, DIRECT = "mlx.launch", "direct"
LAUNCHERS = (MLX_LAUNCH, DIRECT)


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


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive loopback ports free right now (the
    ring backend listens on ``starting_port + rank``)."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((LOOPBACK, 0))
            start = probe.getsockname()[1]
        try:
            for port in range(start, start + count):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                    probe.bind((LOOPBACK, port))
        except (OSError, OverflowError):  # taken, or past port 65535
            continue
        return start
    raise RuntimeError(f"no {count} consecutive free ports on {LOOPBACK}")


def _rank_environment() -> dict:
    """This environment, with this package's folder first on the ranks' import
    path where the interpreter would not find it (a source tree)."""
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


def launch(rank_arguments: Sequence[str], *, ranks: int = 2, timeout_s: float = 120.0,
           launcher: str = MLX_LAUNCH, program: Sequence[str] = ()) -> LaunchResult:
    """Runs ``program`` (``-m MODULE`` or a script) with ``rank_arguments`` on
    ``ranks`` ranks of the ring backend, with this interpreter: through
    ``mlx.launch``, as a user would, or "direct" (``MLX_RANK`` and ``MLX_HOSTFILE``
    set here, for timing: mlx.launch's output relay polls, taking CPU from the
    ranks). Past ``timeout_s`` every process group started is killed
    (``returncode`` None); a run whose ports were taken meanwhile runs again once."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r}: choose from {', '.join(LAUNCHERS)}")
    for _ in range(2):
        result = _launch_once([*program, *rank_arguments], ranks, timeout_s, launcher)
        text = (result.stdout + result.stderr).lower()
        ports_taken = "address already in use" in text or "couldn't bind" in text
        if result.timed_out or result.ok or not ports_taken:
            break
    return result


def _launch_once(rank_arguments, ranks, timeout_s, launcher) -> LaunchResult:
    rank_command = [sys.executable, *rank_arguments]
    first_port = free_port_run(ranks)
    started = time.monotonic()
    environment = _rank_environment()
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as files:
        if launcher == MLX_LAUNCH:
            commands = [[
                sys.executable, "-c", LAUNCHER_CODE,
                "--backend", "ring", "--hosts", LOOPBACK, "-n", str(ranks),
                "--starting-port", str(first_port), "--", *rank_command,
            ]]
            environments = [environment]
        else:
            hostfile = Path(scratch) / "hostfile.json"
            hosts = [[f"{LOOPBACK}:{first_port + rank}"] for rank in range(ranks)]
            hostfile.write_text(json.dumps(hosts))
            commands = [rank_command] * ranks
            environments = [
                {**environment, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
                for rank in range(ranks)
            ]
        outputs = [
            (files.enter_context(tempfile.TemporaryFile("w+")),
             files.enter_context(tempfile.TemporaryFile("w+")))
            for _ in commands
        ]
        processes: list[subprocess.Popen] = []
        returncode: Optional[int] = None
        try:
            for command, rank_environment, (stdout, stderr) in zip(commands, environments, outputs):
                # Each process leads a process group of its own, so one kill
                # per group reaches it and everything it started. mlx.launch
                # polls its stdin: a pipe left open keeps that poll blocking
                # (at end of file it would spin a core).
                processes.append(subprocess.Popen(
                    command, stdin=subprocess.PIPE, stdout=stdout, stderr=stderr,
                    cwd=scratch, env=rank_environment, start_new_session=True,
                ))
            deadline = time.monotonic() + timeout_s
            codes = [process.poll() for process in processes]
            # Until all ended or one failed: the others would wait for it forever in a collective.
            while not (all(code is not None for code in codes) or any(codes)):
                if time.monotonic() > deadline:
                    raise TimeoutError
                time.sleep(0.05)
                codes = [process.poll() for process in processes]
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
            for process in processes:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
            for process in processes:
                process.wait()
                if process.stdin is not None:
                    process.stdin.close()
        for output in (file for pair in outputs for file in pair):
            output.seek(0)
        return LaunchResult(
            returncode, "".join(out.read() for out, _ in outputs),
            "".join(err.read() for _, err in outputs),
            time.monotonic() - started, [process.pid for process in processes],
        )
