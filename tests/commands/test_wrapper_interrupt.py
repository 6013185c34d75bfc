"""Ctrl-C on the wrapped ``server`` ends it as it ends mlx-lm's own.

mlx-lm's server catches the KeyboardInterrupt, stops serving and returns;
the process then ends with status 0 or, now and then, by SIGABRT (-6,
"terminate called without an active exception") while the interpreter
shuts down, a race in the threads MLX and mlx-lm leave behind: an idle
server (no request answered) ends either way about half the time, mlx-lm's
own as much as the wrapper's. So the wrapper cannot give "the" status of
mlx-lm, only the same ones: this test starts both servers on a tiny local
model, sends SIGINT once each is ready, and checks that each ended with one
of the statuses mlx-lm's own gives, and that the wrapper said its
engagement line first. docs/mlx-lm.md says the same."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("mlx_lm")

from helpers.mlx_lm_model_folder import write_qwen3_model_folder  # noqa: E402

LOOPBACK = "127.0.0.1"
UNPATCHED = (sys.executable, "-m", "mlx_lm")
PATCHED = (sys.executable, "-m", "mlx_dualnorm.mlx_lm")
LINE_PREFIX = "[mlx_dualnorm.mlx_lm] mlx_dualnorm: "
# What mlx-lm's own server ends with after SIGINT (see the module doc).
MLX_LM_STATUSES = {0, -signal.SIGABRT}
TRIES = 3
START_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> pathlib.Path:
    return write_qwen3_model_folder(tmp_path_factory.mktemp("model") / "qwen3")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def _interrupted_server(program: tuple, model_folder: pathlib.Path, folder: pathlib.Path):
    """Starts ``program server``, waits until it answers, sends SIGINT (as
    Ctrl-C does); its exit status and stderr."""
    port = _free_port()
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [*program, "server", "--model", str(model_folder), "--host", LOOPBACK,
         "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        cwd=str(folder), env=environment,
        # Ctrl-C as in a terminal, even where pytest runs with SIGINT ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert process.poll() is None, process.stderr.read().decode()[-3000:]
            try:
                with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/v1/models", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        status = process.wait(timeout=60)
        return status, process.stderr.read().decode(errors="replace")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_an_interrupted_server_ends_as_mlx_lms_own_does(model_folder, tmp_path):
    seen = {"mlx-lm": [], "wrapper": []}
    for attempt in range(TRIES):
        for name, program in (("mlx-lm", UNPATCHED), ("wrapper", PATCHED)):
            status, stderr = _interrupted_server(program, model_folder, tmp_path)
            seen[name].append(status)
            assert status in MLX_LM_STATUSES, (name, status, stderr[-3000:])
            if name == "wrapper":
                lines = [line for line in stderr.splitlines() if line.startswith(LINE_PREFIX)]
                assert len(lines) == 1, stderr[-3000:]
                # Said before the process ends, whichever way it ends.
                ours = stderr.index(LINE_PREFIX)
                assert "terminate called" not in stderr[:ours], stderr[-3000:]
    print(seen)  # the statuses, for a reader of -s output
