"""``python -m mlx_dualnorm.mlx_lm SUBCOMMAND ...`` against ``python -m
mlx_lm SUBCOMMAND ...``, in real processes over one tiny qwen3 model folder
(tests/helpers/mlx_lm_model_folder.py): the server answers HTTP requests with the
same tokens, ``generate`` prints the same text, ``lora`` trains to the same
losses and adapter bits, ``benchmark`` runs, and the engagement line, the
command's own flags and its exit statuses behave as documented in
docs/mlx-lm.md. Every process runs under a time limit; every server is
ended by its process id, killed if it does not end in time."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Iterator, Optional

import pytest

pytest.importorskip("mlx_lm")

from helpers.isolated_process import describe  # noqa: E402
from helpers.mlx_lm_model_folder import write_qwen3_model_folder  # noqa: E402
from helpers.threads import run_on_threads  # noqa: E402

from mlx_dualnorm import mlx_lm as command  # noqa: E402

PATCHED = (sys.executable, "-m", "mlx_dualnorm.mlx_lm")
UNPATCHED = (sys.executable, "-m", "mlx_lm")
LINE_PREFIX = f"[{command.PROGRAM}] "
COMMAND_TIMEOUT_S = 240
SERVER_START_TIMEOUT_S = 120
SERVER_STOP_TIMEOUT_S = 30
REQUEST_TIMEOUT_S = 120
LOOPBACK = "127.0.0.1"


def _environment() -> dict:
    environment = dict(os.environ)
    environment["HF_HUB_OFFLINE"] = "1"  # the model folder is local: never download
    environment["PYTHONFAULTHANDLER"] = "1"
    return environment


def run_command(
    program: tuple, *arguments: str, cwd: pathlib.Path, timeout_s: float = COMMAND_TIMEOUT_S
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*program, *arguments],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=str(cwd),
        env=_environment(),
        stdin=subprocess.DEVNULL,
    )


def our_lines(stderr: str) -> list[str]:
    """This command's own lines on stderr."""
    return [line for line in stderr.splitlines() if line.startswith(LINE_PREFIX)]


def engagement_line(process: subprocess.CompletedProcess) -> str:
    """The one engagement line: the last line on stderr, said once."""
    lines = our_lines(process.stderr)
    assert len(lines) == 1, describe(process)
    assert process.stderr.rstrip("\n").splitlines()[-1] == lines[0], describe(process)
    return lines[0][len(LINE_PREFIX):]


SUMMARY = re.compile(
    r"^mlx_dualnorm: (\d+) attention layers engaged(?: \(([^)]*)\))?; (\d+) left to mlx-lm; "
    r"(\d+) package calls"
)
LAYERS = 2  # the model folder's attention layers, all of class qwen3.Attention


def engagement(summary: str) -> dict:
    """The counts the engagement line gives."""
    match = SUMMARY.match(summary)
    assert match, summary
    return {
        "engaged": int(match[1]), "by class": match[2], "left": int(match[3]),
        "calls": int(match[4]),
    }


def assert_engaged(summary: str, *, at_least_calls: int) -> None:
    """The patch ran: every layer of the model (or models) the command
    loaded engaged, none left to mlx-lm's code, and at least
    ``at_least_calls`` calls through the package, in steps of one call per
    layer."""
    counts = engagement(summary)
    assert counts["left"] == 0, summary
    assert counts["engaged"] >= LAYERS and counts["engaged"] % LAYERS == 0, summary
    assert counts["by class"] == f"qwen3.Attention {counts['engaged']}", summary
    assert counts["calls"] >= at_least_calls and counts["calls"] % LAYERS == 0, summary


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> pathlib.Path:
    return write_qwen3_model_folder(tmp_path_factory.mktemp("qwen3") / "model")


@pytest.fixture
def work_folder(tmp_path) -> pathlib.Path:
    """The commands' working folder: what they write lands in the test's
    temporary folder."""
    return tmp_path


# ---- The command's own flags ---------------------------------------------------------


def test_the_flags_are_taken_out_and_the_rest_is_left_in_order():
    split = command.split_arguments(
        ["generate", "--quiet-dualnorm", "--model", "m", "--dualnorm-mode", "composed", "-p", "x"]
    )
    assert split == ("composed", True, ["generate", "--model", "m", "-p", "x"])
    assert command.split_arguments(["--dualnorm-mode=compiled", "server"]) == (
        "compiled", False, ["server"],
    )
    assert command.split_arguments(["generate"]) == (None, False, ["generate"])
    # After a bare "--" everything is mlx-lm's, this command's flag names too.
    assert command.split_arguments(["generate", "--", "--quiet-dualnorm"]) == (
        None, False, ["generate", "--", "--quiet-dualnorm"],
    )
    for missing in (["generate", "--dualnorm-mode"], ["--dualnorm-mode=", "generate"]):
        with pytest.raises(command.UsageError, match="--dualnorm-mode needs a mode"):
            command.split_arguments(missing)


@pytest.mark.parametrize(
    "arguments",
    [
        ("--dualnorm-mode", "no-such-mode", "generate", "--help"),
        ("--dualnorm-mode", "fused", "generate", "--help"),  # fused needs CUDA
        ("generate", "--help", "--dualnorm-mode"),
    ],
)
def test_a_mode_that_cannot_run_is_one_line_and_exit_status_2(arguments, work_folder):
    from mlx_dualnorm import available_modes

    if "fused" in arguments and "fused" in available_modes():
        pytest.skip("the fused mode runs here")
    process = run_command(PATCHED, *arguments, cwd=work_folder)
    assert process.returncode == command.EXIT_USAGE, describe(process)
    assert process.stdout == "", describe(process)  # mlx-lm never ran
    assert len(process.stderr.splitlines()) == 1, describe(process)
    assert process.stderr.startswith(LINE_PREFIX + "--dualnorm-mode"), describe(process)


def test_without_mlx_lm_it_says_what_to_install(work_folder):
    code = (
        "import sys; sys.modules['mlx_lm'] = None\n"
        "from mlx_dualnorm.mlx_lm import main\n"
        "sys.exit(main(['generate', '--help']))\n"
    )
    process = run_command((sys.executable, "-c", code), cwd=work_folder)
    assert process.returncode == command.EXIT_USAGE, describe(process)
    assert process.stdout == ""
    (line,) = process.stderr.splitlines()
    assert line.startswith(LINE_PREFIX) and "pip install 'mlx-lm==0.32.2'" in line


# ---- mlx-lm's dispatcher, its arguments, output and exit status ---------------------


@pytest.mark.parametrize(
    "arguments",
    [
        ("--version",),
        ("--help",),
        ("server", "--help"),  # SystemExit(0) from mlx-lm's argparse
        ("generate", "--no-such-flag"),  # SystemExit(2) from mlx-lm's argparse
        (),  # mlx-lm's dispatcher raises: exit status 1
    ],
)
def test_the_dispatch_is_mlx_lms(arguments, work_folder):
    unpatched = run_command(UNPATCHED, *arguments, cwd=work_folder)
    patched = run_command(PATCHED, *arguments, cwd=work_folder)
    assert patched.returncode == unpatched.returncode, describe(patched)
    assert patched.stdout == unpatched.stdout
    engagement_line(patched)
    # mlx-lm's own stderr (usage errors, its traceback's last line) is there too.
    theirs = unpatched.stderr.strip().splitlines()
    if theirs:
        assert theirs[-1] in patched.stderr.splitlines(), describe(patched)


def test_the_console_script_is_this_command(work_folder):
    """pyproject.toml's script runs :func:`mlx_dualnorm.mlx_lm.main` the way
    an installed console script does: ``sys.exit(main())``."""
    tomllib = pytest.importorskip("tomllib")
    pyproject = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"
    scripts = tomllib.loads(pyproject.read_text())["project"]["scripts"]
    assert scripts["mlx-lm-dualnorm"] == "mlx_dualnorm.mlx_lm:main"
    code = (
        "import sys\n"
        "from importlib.metadata import EntryPoint\n"
        f"main = EntryPoint('mlx-lm-dualnorm', {scripts['mlx-lm-dualnorm']!r}, "
        "'console_scripts').load()\n"
        "sys.argv[0] = 'mlx-lm-dualnorm'\n"
        "sys.exit(main())\n"
    )
    script = run_command((sys.executable, "-c", code, "--version"), cwd=work_folder)
    unpatched = run_command(UNPATCHED, "--version", cwd=work_folder)
    assert script.returncode == unpatched.returncode == 0, describe(script)
    assert script.stdout == unpatched.stdout
    engagement_line(script)


# ---- generate, benchmark, lora --------------------------------------------------------

TIMING_LINE = re.compile(r"^(Prompt|Generation): \d+ tokens, [\d.]+ tokens-per-sec$|^Peak memory: ")


def without_timing(stdout: str) -> str:
    return "".join(line for line in stdout.splitlines(True) if not TIMING_LINE.match(line))


GENERATE_ARGUMENTS = ("--prompt", "hello cat", "--max-tokens", "12")


def test_generate_prints_what_mlx_lm_prints(model_folder, work_folder):
    arguments = ("generate", "--model", str(model_folder), *GENERATE_ARGUMENTS)
    unpatched = run_command(UNPATCHED, *arguments, cwd=work_folder)
    patched = run_command(PATCHED, *arguments, cwd=work_folder)
    quiet = run_command(PATCHED, *arguments, "--quiet-dualnorm", cwd=work_folder)
    for process in (unpatched, patched, quiet):
        assert process.returncode == 0, describe(process)
    assert "Generation: 12 tokens" in unpatched.stdout  # no early end: 12 tokens compared
    text = without_timing(unpatched.stdout)
    assert len(text.split("==========")[1].split()) == 12, text
    assert without_timing(patched.stdout) == text
    assert without_timing(quiet.stdout) == text
    # mlx-lm runs each layer at least once per generated token.
    assert_engaged(engagement_line(patched), at_least_calls=LAYERS * 12)
    assert our_lines(quiet.stderr) == [], describe(quiet)


def test_benchmark_runs(model_folder, work_folder):
    process = run_command(
        PATCHED, "benchmark", "--model", str(model_folder),
        "--prompt-tokens", "16", "--generation-tokens", "8", "--num-trials", "1",
        cwd=work_folder,
    )
    assert process.returncode == 0, describe(process)
    assert "Averages: prompt_tps=" in process.stdout, describe(process)
    # A warm-up run and one timed trial, 8 tokens each.
    assert_engaged(engagement_line(process), at_least_calls=LAYERS * 8 * 2)


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
# "   3    16.537 ▼ ..." (a training loss) or "   4    val 15.311 ..." (a validation loss)
LOSS_LINE = re.compile(r"^\s*(\d+)\s+(val\s+)?(\d+\.\d+)\b")
TRAINING_WORDS = "the cat is red . the dog is blue . a river in the city . hello world".split()


def losses(stdout: str) -> list[tuple[int, str, str]]:
    found = []
    for line in ANSI_ESCAPE.sub("", stdout).splitlines():
        match = LOSS_LINE.match(line)
        if match:
            found.append((int(match[1]), "val" if match[2] else "train", match[3]))
    return found


def _write_training_data(folder: pathlib.Path) -> pathlib.Path:
    folder.mkdir()
    for name, count in (("train", 8), ("valid", 4)):
        rows = [
            {"text": " ".join(TRAINING_WORDS[(row * 5 + column * 3) % len(TRAINING_WORDS)]
                              for column in range(12))}
            for row in range(count)
        ]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def test_lora_trains_to_the_same_losses_and_adapter(model_folder, work_folder):
    import mlx.core as mx

    data = _write_training_data(work_folder / "data")
    runs = {}
    for name, program in (("unpatched", UNPATCHED), ("patched", PATCHED)):
        adapters = work_folder / f"adapters-{name}"
        process = run_command(
            program, "lora", "--model", str(model_folder), "--train", "--data", str(data),
            "--iters", "4", "--batch-size", "2", "--num-layers", "2", "--learning-rate", "1e-3",
            "--steps-per-report", "1", "--steps-per-eval", "4", "--val-batches", "1",
            "--adapter-path", str(adapters),
            cwd=work_folder,
        )
        assert process.returncode == 0, describe(process)
        runs[name] = (process, mx.load(str(adapters / "adapters.safetensors")))
    (unpatched, unpatched_weights), (patched, patched_weights) = runs["unpatched"], runs["patched"]
    expected = losses(unpatched.stdout)
    # Four training losses and two validation losses (before step 1, after step 4).
    assert [kind for _, kind, _ in expected].count("train") == 4, unpatched.stdout
    assert [kind for _, kind, _ in expected].count("val") == 2, unpatched.stdout
    assert losses(patched.stdout) == expected
    # The trained adapters carry the same bits: every gradient step was the same.
    assert sorted(patched_weights) == sorted(unpatched_weights)
    for name, weight in unpatched_weights.items():
        assert weight.dtype == patched_weights[name].dtype, name
        assert mx.array_equal(weight, patched_weights[name]).item(), name
    assert_engaged(engagement_line(patched), at_least_calls=LAYERS)


# ---- server -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


class Server:
    def __init__(self, process: subprocess.Popen, port: int, stderr_path: pathlib.Path) -> None:
        self.process = process
        self.url = f"http://{LOOPBACK}:{port}"
        self.stderr_path = stderr_path

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def describe(self) -> str:
        return f"server exit status {self.process.poll()}\n--- stderr ---\n{self.stderr()[-4000:]}"


def stop(process: subprocess.Popen, how: int = signal.SIGTERM) -> Optional[int]:
    """Ends ``process`` by ``how``, waits for it, kills it when it does not
    end in time; returns the status it ended with by ``how`` (None: it had
    to be killed)."""
    if process.poll() is not None:
        return process.returncode
    process.send_signal(how)
    try:
        return process.wait(timeout=SERVER_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=SERVER_STOP_TIMEOUT_S)
        return None


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def started_server(program: tuple, model_folder: pathlib.Path, folder: pathlib.Path,
                   *extra: str) -> Iterator[Server]:
    """``program server`` on a free loopback port, ready to answer; ended
    by its process id when the block ends, whatever happens in it."""
    port = _free_port()
    folder.mkdir(parents=True, exist_ok=True)
    stderr_path = folder / "server.stderr"
    with open(folder / "server.stdout", "wb") as stdout, open(stderr_path, "wb") as stderr:
        process = subprocess.Popen(
            [*program, "server", "--model", str(model_folder), "--host", LOOPBACK,
             "--port", str(port), *extra],
            stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
            cwd=str(folder), env=_environment(),
            # Ctrl-C as in a terminal, even where this process was started
            # with SIGINT ignored (a background job): the child would inherit that.
            preexec_fn=_default_sigint,
        )
    try:
        server = Server(process, port, stderr_path)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            assert process.poll() is None, server.describe()
            try:
                with urllib.request.urlopen(server.url + "/v1/models", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, "server did not start\n" + server.describe()
            time.sleep(0.2)
        yield server
    finally:
        stop(process)


def post(server: Server, path: str, body: dict):
    """The JSON answer, or for ``stream`` the list of its server-sent events'
    JSON, ids and creation times left out (they differ on every call)."""
    request = urllib.request.Request(
        server.url + path, data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as answer:
        assert answer.status == 200, server.describe()
        if not body.get("stream"):
            return _comparable(json.loads(answer.read()))
        events = []
        for raw in answer:
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data: "):
                continue  # blank separators and keep-alive comments
            payload = line[len("data: "):]
            if payload == "[DONE]":
                break
            events.append(_comparable(json.loads(payload)))
        return events


def _comparable(answer: dict) -> dict:
    return {key: value for key, value in answer.items() if key not in ("id", "created")}


def _chat(content: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0.0, **extra}


def _completion(prompt: str, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, **extra}


# One after the other, in this order, on each server; the completion prompts
# start with words no other prompt starts with, so no answer depends on
# which earlier prompt mlx-lm's prompt cache holds.
SEQUENTIAL_REQUESTS = (
    ("/v1/chat/completions", _chat("hello cat", logprobs=True)),
    ("/v1/chat/completions", _chat("the red house", stream=True)),
    ("/v1/completions", _completion("river tree stone", logprobs=True)),
    ("/v1/completions", _completion("moon and sun", stream=True)),
)
# Two clients at once (mlx-lm batches them when they meet), prompts of the same length.
CONCURRENT_REQUESTS = (
    ("/v1/completions", _completion("green road city song", logprobs=True)),
    ("/v1/completions", _completion("dog light dark cold", logprobs=True)),
)


def _concurrently(server: Server, requests) -> list:
    return run_on_threads(
        *(functools.partial(post, server, path, body) for path, body in requests),
        timeout=REQUEST_TIMEOUT_S + 10,
        together=True,
    )


def _answers(server: Server) -> dict:
    return {
        "sequential": [post(server, path, body) for path, body in SEQUENTIAL_REQUESTS],
        "concurrent": _concurrently(server, CONCURRENT_REQUESTS),
    }


def _streamed_text(events: list) -> str:
    pieces = []
    for event in events:
        for choice in event["choices"]:
            pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(pieces)


def _generated_tokens(answer: dict) -> list[int]:
    return [entry["id"] for entry in answer["choices"][0]["logprobs"]["content"]]


def test_the_server_answers_with_mlx_lms_tokens_and_text(model_folder, tmp_path):
    with started_server(UNPATCHED, model_folder, tmp_path / "unpatched") as server:
        expected = _answers(server)
        unpatched_status = stop(server.process)
    with started_server(PATCHED, model_folder, tmp_path / "patched") as server:
        answers = _answers(server)
        patched_status = stop(server.process)
        patched_stderr = server.stderr()
    # The answers compare generated tokens, not early ends.
    logprob_answers = (
        expected["sequential"][0], expected["sequential"][2], *expected["concurrent"]
    )
    for answer in logprob_answers:
        assert len(_generated_tokens(answer)) >= 4, answer
    for events in (expected["sequential"][1], expected["sequential"][3]):
        assert len(_streamed_text(events).split()) >= 4, events
    assert answers["sequential"] == expected["sequential"]
    assert answers["concurrent"] == expected["concurrent"]
    # Ended by SIGTERM like mlx-lm's own server, after saying the line.
    assert unpatched_status == patched_status == -signal.SIGTERM
    lines = our_lines(patched_stderr)
    assert len(lines) == 1, patched_stderr[-4000:]
    summary = lines[0][len(LINE_PREFIX):]
    # Each layer runs at least once per generated token.
    generated = sum(len(_generated_tokens(answer)) for answer in logprob_answers)
    assert_engaged(summary, at_least_calls=LAYERS * generated)
    # One model: its layers, by class.
    counts = engagement(summary)
    assert (counts["engaged"], counts["by class"]) == (LAYERS, f"qwen3.Attention {LAYERS}"), summary


# Status of mlx-lm's own server after Ctrl-C: 0, or, now and then, SIGABRT
# while the interpreter shuts down (seen from mlx-lm's own, unpatched server).
INTERRUPTED_SERVER_STATUSES = (0, -signal.SIGABRT)


def test_an_interrupted_server_says_the_line(model_folder, tmp_path):
    with started_server(PATCHED, model_folder, tmp_path / "patched") as server:
        answer = post(server, *SEQUENTIAL_REQUESTS[0])
        status = stop(server.process, signal.SIGINT)  # Ctrl-C: mlx-lm's own shutdown
        stderr = server.stderr()
    assert status in INTERRUPTED_SERVER_STATUSES, stderr[-4000:]
    lines = our_lines(stderr)
    assert len(lines) == 1, stderr[-4000:]
    generated = len(_generated_tokens(answer))
    assert_engaged(lines[0][len(LINE_PREFIX):], at_least_calls=LAYERS * generated)
