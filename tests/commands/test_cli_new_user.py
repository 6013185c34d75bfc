"""What a new user typed into ``python -m mlx_dualnorm`` and how it must
answer: every refusal is one line on stderr, ``[sub-command] message``,
with exit status 2 and no traceback, given before any work; results are
printed before a file write that can still fail; long runs say how long.

Each test runs the real command line in a fresh interpreter (a file write
that fails is the only thing simulated: a full disk, by the write raising
as the OS does)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import mlx_dualnorm
from helpers.isolated_process import TESTS_DIR, describe, run_python
from mlx_dualnorm import _built_against
from mlx_dualnorm.dual_head_norm import available_modes

REPOSITORY = TESTS_DIR.parent
PACKAGE_DIR = pathlib.Path(mlx_dualnorm.__file__).resolve().parent
OTHER_MLX_PYTHON_SETTING = "MLX_DUALNORM_OTHER_MLX_PYTHON"
needs_mlx_lm = pytest.mark.skipif(
    importlib.util.find_spec("mlx_lm") is None, reason="needs mlx-lm"
)


def run_cli(*arguments: str, timeout_s: float = 300.0, python: str = sys.executable,
            cwd: pathlib.Path = TESTS_DIR, env=None) -> subprocess.CompletedProcess:
    """``python -m mlx_dualnorm ARGUMENTS`` in a fresh interpreter."""
    return subprocess.run(
        [python, "-m", "mlx_dualnorm", *arguments],
        capture_output=True, text=True, timeout=timeout_s, cwd=str(cwd),
        env=env if env is not None else dict(os.environ),
    )


def assert_refused(process: subprocess.CompletedProcess, operation: str, message: str) -> None:
    """Exit 2, stderr exactly one line ``[operation] ...`` holding
    ``message``, no traceback, nothing on stdout (refused before any work)."""
    assert process.returncode == 2, describe(process)
    assert "Traceback" not in process.stderr, describe(process)
    assert process.stderr.count("\n") == 1 and process.stderr.endswith("\n"), describe(process)
    assert process.stderr.startswith(f"[{operation}] "), describe(process)
    assert message in process.stderr, describe(process)
    assert process.stdout == "", describe(process)


# ---- The Qwen3 family the README leads with --------------------------------------


@needs_mlx_lm
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_the_qwen3_family_has_synthetic_models(family):
    process = run_cli("mlx-lm-check", "--synthetic", family, "--tokens", "3", "--rounds", "1")
    assert process.returncode == 0, describe(process)
    assert "RESULT: identical" in process.stdout
    # Both layers run the package's norm + RoPE: the patch covers the family.
    assert f"    2 norm + RoPE: mlx_lm.models.{family}.Attention\n" in process.stdout


# ---- Seeds: one range for every command, checked where they are read ---------------

SEED_RANGE = "argument --seed: must be from 0 to 4294967295"


@pytest.mark.parametrize(
    "arguments",
    [
        ["replay", "--seed", "-5"],
        ["replay", "--seed", "99999999999999999999"],
        ["parity", "--quick", "--seed", "-1"],
        ["parity", "--quick", "--seed", "4294967296"],
        pytest.param(["mlx-lm-check", "--synthetic", "olmo2", "--seed", "-5"], marks=needs_mlx_lm),
    ],
)
def test_a_seed_out_of_range_is_refused_in_one_line(arguments):
    assert_refused(run_cli(*arguments), arguments[0], SEED_RANGE)


def test_the_largest_seed_runs():
    process = run_cli("replay", "--steps", "1", "--path", "compiled", "--seed", "4294967295")
    assert process.returncode == 0, describe(process)
    assert "seed 4294967295" in process.stdout


# ---- Output paths: checked before the run; results printed before the write --------


def test_bench_refuses_an_output_dir_that_is_a_file_before_it_runs(tmp_path):
    a_file = tmp_path / "passwd"
    a_file.write_text("not a folder\n")
    assert_refused(run_cli("bench", "--quick", "--output-dir", str(a_file)), "bench",
                   f"argument --output-dir: {a_file} exists and is not a folder")
    assert_refused(run_cli("bench", "--quick", "--output-dir", str(a_file / "inside")), "bench",
                   f"cannot create {a_file / 'inside'}: {a_file} is not a folder")


@needs_mlx_lm
def test_mlx_lm_bench_refuses_a_json_path_without_its_folder_before_it_runs(tmp_path):
    missing = tmp_path / "nonexistent" / "dir" / "x.json"
    process = run_cli("mlx-lm-bench", "--quick", "--decode-models", "qwen3-1024",
                      "--json", str(missing))
    assert_refused(process, "mlx-lm-bench", f"argument --json: no folder {missing.parent}")


# A write that fails after the path was checked: the disk fills up.
FULL_DISK = """
    import errno, pathlib, sys
    write_text = pathlib.Path.write_text

    def full_disk(self, *arguments, **options):
        if self.name == {name!r}:
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return write_text(self, *arguments, **options)

    pathlib.Path.write_text = full_disk
    from mlx_dualnorm.commands.cli import main
    sys.exit(main({arguments!r}))
"""


def assert_printed_then_one_line(process, operation, table_fragment):
    assert process.returncode == 2, describe(process)
    assert "Traceback" not in process.stderr, describe(process)
    assert table_fragment in process.stdout, describe(process)  # the results were not lost
    last_line = process.stderr.rstrip("\n").splitlines()[-1]
    assert last_line.startswith(f"[{operation}] could not write"), describe(process)
    assert "No space left on device" in last_line


def test_bench_prints_its_table_before_a_write_that_fails(tmp_path):
    arguments = ["bench", "--quick", "--repeats", "1", "--layers", "2", "--paths", "compiled",
                 "--output-dir", str(tmp_path)]
    process = run_python(FULL_DISK.format(name="benchmark.json", arguments=arguments))
    assert_printed_then_one_line(process, "bench", "decode_us_per_token")


@needs_mlx_lm
def test_mlx_lm_bench_prints_its_table_before_a_write_that_fails(tmp_path):
    arguments = ["mlx-lm-bench", "--quick", "--decode-models", "qwen3-1024", "--decode-steps",
                 "1", "--decode-rounds", "1", "--json", str(tmp_path / "report.json")]
    process = run_python(FULL_DISK.format(name="report.json", arguments=arguments))
    assert_printed_then_one_line(process, "mlx-lm-bench", "greedy tokens, patched vs unpatched")


def test_bench_still_writes_into_a_folder_it_creates(tmp_path):
    folder = tmp_path / "new" / "results"
    process = run_cli("bench", "--quick", "--repeats", "1", "--layers", "2", "--paths",
                      "compiled", "--output-dir", str(folder))
    assert process.returncode == 0, describe(process)
    assert json.loads((folder / "benchmark.json").read_text())["config"]["repeats"] == 1


# ---- mlx-lm-check: a folder without a tokenizer, long prompts -----------------------

TINY_QWEN3 = {
    "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "rms_norm_eps": 1e-6, "vocab_size": 256,
    "max_position_embeddings": 512, "rope_theta": 10000.0, "tie_word_embeddings": True,
}


@needs_mlx_lm
def test_a_prompt_for_a_folder_without_a_tokenizer_is_refused_in_one_line(tmp_path):
    from helpers.mlx_lm_families import build_model

    model = build_model(TINY_QWEN3, dtype=mx.float32)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3))
    process = run_cli("mlx-lm-check", "--model", str(tmp_path), "--prompt", "hello world")
    assert_refused(process, "mlx-lm-check", f"{tmp_path} has no tokenizer")
    # The fixed prompt of token ids needs no tokenizer.
    process = run_cli("mlx-lm-check", "--model", str(tmp_path), "--tokens", "2", "--rounds", "1")
    assert process.returncode == 0, describe(process)


@needs_mlx_lm
def test_the_prompt_length_is_bounded():
    assert_refused(
        run_cli("mlx-lm-check", "--synthetic", "qwen3", "--prompt-tokens", "100000"),
        "mlx-lm-check", "argument --prompt-tokens: must be at most 4096, got 100000",
    )


@needs_mlx_lm
def test_a_long_prompt_shows_progress_with_the_time_left():
    process = run_cli("mlx-lm-check", "--synthetic", "qwen3", "--prompt-tokens", "256",
                      "--tokens", "2", "--rounds", "1")
    assert process.returncode == 0, describe(process)
    for run in range(1, 5):  # two warm-ups, the compared run each way
        assert re.search(rf"256-token prompt, runs: {run}/4 .*s so far, ~\d+ s left",
                         process.stderr), describe(process)


@needs_mlx_lm
def test_a_short_prompt_prints_no_progress():
    process = run_cli("mlx-lm-check", "--synthetic", "qwen3", "--tokens", "2", "--rounds", "1")
    assert process.returncode == 0, describe(process)
    assert "runs:" not in process.stderr


# ---- mlx-lm-check: what its lines say ---------------------------------------------


@needs_mlx_lm
def test_gated_delta_lines_only_for_a_model_with_gated_delta_layers():
    without = run_cli("mlx-lm-check", "--synthetic", "qwen3", "--tokens", "2", "--rounds", "1")
    assert without.returncode == 0, describe(without)
    assert "normalize_qk:" not in without.stdout
    assert "gated-delta" not in without.stdout
    assert "  engaged:        norm-only layers 0; norm + RoPE layers 2" in without.stdout
    with_layers = run_cli("mlx-lm-check", "--synthetic", "qwen3_5", "--tokens", "2",
                          "--rounds", "1")
    assert with_layers.returncode == 0, describe(with_layers)
    assert "  normalize_qk:   " in with_layers.stdout
    assert re.search(r"engaged:        gated-delta calls folded [1-9]\d* ", with_layers.stdout)


RATIO_OF_ROUNDS = """
    import sys
    from mlx_dualnorm.commands import mlx_lm_check
    from helpers.mlx_lm_families import build_synthetic_model, prompt_token_ids

    model = build_synthetic_model("qwen3")
    result = mlx_lm_check.run_check(model, prompt_token_ids(512), 2, timing_rounds=1)
    # Per-round times as a busy CPU gave them, over three rounds.
    result.unpatched_round_ms = [10.0, 10.0, 10.0]
    result.patched_round_ms = {patched!r}
    print(mlx_lm_check.format_result(result, "qwen3", 12))
"""


@needs_mlx_lm
@pytest.mark.parametrize(
    "patched, noise",
    [([3.0, 16.1, 9.0], True), ([10.0, 9.0, 11.0], True), ([8.0, 7.0, 9.0], False)],
)
def test_a_ratio_whose_rounds_span_one_is_called_noise(patched, noise):
    process = run_python(RATIO_OF_ROUNDS.format(patched=patched))
    assert process.returncode == 0, describe(process)
    line = next(line for line in process.stdout.splitlines() if "ms per token:" in line)
    assert f"per round {min(patched) / 10:.2f}..{max(patched) / 10:.2f}, 3 rounds" in line
    assert ("NOISE: the per-round range spans 1.0" in line) == noise, line
    assert ("not a measured speed-up" in line) == noise, line


# ---- A path that cannot run here: bench as parity ----------------------------------


@pytest.mark.skipif("fused" in available_modes(), reason="the fused mode runs here")
@pytest.mark.parametrize("subcommand, option", [("bench", "--paths"), ("parity", "--path")])
def test_a_named_path_that_cannot_run_here_is_refused_alike(subcommand, option):
    process = run_cli(subcommand, "--quick", option, "fused")
    assert_refused(process, subcommand, "path 'fused': mode 'fused' is not available here")


# ---- Another MLX than the one built against -----------------------------------------


def copy_built_against(tmp_path: pathlib.Path, version: str, backend: str) -> pathlib.Path:
    """A copy of the package, extension modules included, whose build record
    names another MLX; returns the folder to run it from."""
    site = tmp_path / "site"
    shutil.copytree(PACKAGE_DIR, site / "mlx_dualnorm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (site / "mlx_dualnorm" / "_built_against.py").write_text(
        f"MLX_VERSION = {version!r}\nMLX_BACKEND = {backend!r}\n"
    )
    return site


@pytest.mark.parametrize("arguments", [[], ["parity", "--quick"], ["--help"]])
def test_another_mlx_is_one_line_and_exit_2_on_the_command_line(tmp_path, arguments):
    site = copy_built_against(tmp_path, "0.30.1", _built_against.MLX_BACKEND)
    environment = {**os.environ, "PYTHONPATH": str(site)}
    process = run_cli(*arguments, cwd=site, env=environment)
    assert_refused(process, "import mlx_dualnorm",
                   "mlx_dualnorm was compiled against mlx 0.30.1")
    # A library user still gets the ImportError.
    imported = subprocess.run(
        [sys.executable, "-c", "import mlx_dualnorm"], capture_output=True, text=True,
        cwd=str(site), env=environment, timeout=120,
    )
    assert imported.returncode == 1
    assert "ImportError: [import mlx_dualnorm] mlx_dualnorm was compiled against" in imported.stderr


@pytest.mark.skipif(
    not os.environ.get(OTHER_MLX_PYTHON_SETTING),
    reason=f"needs {OTHER_MLX_PYTHON_SETTING}: the python of a virtual environment with "
    "another MLX release and this package installed (.ci/run makes one)",
)
def test_a_real_other_mlx_release_is_one_line_and_exit_2():
    own_environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    process = run_cli(python=os.environ[OTHER_MLX_PYTHON_SETTING], cwd=pathlib.Path("/"),
                      env=own_environment)
    assert_refused(process, "import mlx_dualnorm",
                   f"compiled against mlx {_built_against.MLX_VERSION}")


# ---- The mlx-c subset's build script: which Python, and one line without MLX --------

BUILD_SCRIPT = REPOSITORY / "scripts" / "build_subset_mlx_c.sh"


@pytest.mark.skipif(not BUILD_SCRIPT.is_file(), reason="not a source tree")
def test_the_build_script_names_its_python_and_refuses_one_without_mlx(tmp_path):
    # This interpreter without its site-packages (-S) or the environment's
    # path (-I): a Python with no MLX, as python3 outside the venv is.
    bare_python = tmp_path / "bare-python"
    bare_python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "$@"\n')
    bare_python.chmod(0o755)
    # Named relative to the folder it is run from, as PYTHON=.venv/bin/python is.
    process = subprocess.run(
        ["bash", str(BUILD_SCRIPT), str(tmp_path / "prefix")], cwd=str(tmp_path),
        env={**os.environ, "PYTHON": "./bare-python"}, capture_output=True, text=True,
        timeout=120,
    )
    assert process.returncode == 2, describe(process)
    bare_python = bare_python.resolve()
    named = f"mlx-c subset: using Python {bare_python} (set PYTHON= to use another)"
    assert named in process.stdout, describe(process)
    assert process.stderr.count("\n") == 1 and "Traceback" not in process.stderr, describe(process)
    assert f"{bare_python} has no MLX" in process.stderr
    assert "PYTHON=" in process.stderr
    assert not (tmp_path / "prefix").exists()  # nothing was built
