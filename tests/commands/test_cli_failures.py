"""Every failure of a command is one line on stderr, ``[SUB-COMMAND]
message``, no traceback, and the documented exit status (2: bad usage or
what cannot run here), before any work: a corpus of broken model folders,
models the CPU cannot run, output paths that cannot be written, and values the commands refuse.

The model folders are the tiny qwen3 folder of the tests' helpers, each
broken one way; everything runs the real commands on the real library."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import pytest

from helpers.isolated_process import describe, run_python
from mlx_dualnorm.commands import cli

mlx_lm = pytest.importorskip("mlx_lm")

from helpers.mlx_lm_model_folder import write_qwen3_model_folder  # noqa: E402

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
NAME_TOO_LONG = "n" * 300  # longer than any file system's name limit (255)


def _edit_config(folder: pathlib.Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _truncate_weights(folder: pathlib.Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


# Each: how the folder is broken, and words the message must hold.
BROKEN_FOLDERS = {
    "truncated_weights": (_truncate_weights, "RuntimeError"),
    "garbage_weights": (
        lambda folder: (folder / "model.safetensors").write_bytes(b"\0" * 100), "RuntimeError"
    ),
    "config_holds_a_list": (
        lambda folder: (folder / "config.json").write_text("[1, 2]"), "AttributeError"
    ),
    "config_not_json": (lambda folder: (folder / "config.json").write_text("{"), "JSONDecodeError"),
    "no_weights": (lambda folder: (folder / "model.safetensors").unlink(), "FileNotFoundError"),
    "unknown_model_type": (
        lambda folder: _edit_config(folder, model_type="no_such_family"), "not supported"
    ),
    "weights_of_another_shape": (lambda folder: _edit_config(folder, hidden_size=32), "shape"),
    # A TypeError from deep inside MLX whose message spans several lines.
    "head_count_a_string": (
        lambda folder: _edit_config(folder, num_attention_heads="four"), "TypeError"
    ),
}


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("models")
    good = write_qwen3_model_folder(root / "good")
    folders = {"good": good}
    for name, (breaks, _) in BROKEN_FOLDERS.items():
        folder = root / name
        shutil.copytree(good, folder)
        breaks(folder)
        folders[name] = folder
    return folders


def assert_one_line_refusal(status, captured, subcommand, *words):
    assert status == 2, captured
    assert captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err
    assert captured.err.startswith(f"[{subcommand}] "), captured.err
    for word in words:
        assert word in captured.err, captured.err


@pytest.mark.parametrize("name", sorted(BROKEN_FOLDERS))
def test_a_model_folder_that_does_not_load_is_one_line_naming_folder_and_cause(
    name, model_folders, capsys
):
    folder = model_folders[name]
    status = cli.main(["mlx-lm-check", "--model", str(folder), "--tokens", "2", "--rounds", "1"])
    captured = capsys.readouterr()
    assert_one_line_refusal(status, captured, "mlx-lm-check", str(folder), BROKEN_FOLDERS[name][1])
    assert captured.out == ""


def test_the_good_folder_of_the_corpus_loads(model_folders, capsys):
    """The corpus is broken by its edits, not by the folder it starts from."""
    status = cli.main(
        ["mlx-lm-check", "--model", str(model_folders["good"]), "--tokens", "2", "--rounds", "1"]
    )
    assert status == 0
    assert "RESULT: identical" in capsys.readouterr().out


def test_a_model_path_the_file_system_refuses_is_one_line(tmp_path, capsys):
    folder = tmp_path / NAME_TOO_LONG
    status = cli.main(["mlx-lm-check", "--model", str(folder), "--tokens", "2"])
    assert_one_line_refusal(status, capsys.readouterr(), "mlx-lm-check", "File name too long")


def test_a_home_folder_of_no_user_is_one_line_in_a_real_process():
    process = run_python(
        "import sys\nfrom mlx_dualnorm.commands.cli import main\n"
        "sys.exit(main(['mlx-lm-check', '--model', '~no_such_user_here/x']))"
    )
    assert process.returncode == 2, describe(process)
    assert process.stderr.count("\n") == 1 and "Traceback" not in process.stderr, describe(process)
    assert "~no_such_user_here/x" in process.stderr


# ---- What the CPU cannot run: refused before the run ---------------------------


@pytest.mark.parametrize(
    "family, dtype",
    [("qwen3_moe", "bfloat16"), ("qwen3_next", "float16")],
)
def test_experts_in_a_dtype_the_cpu_gather_mm_lacks_are_refused_before_the_run(
    family, dtype, capsys
):
    status = cli.main([
        "mlx-lm-check", "--device", "cpu", "--synthetic", family, "--dtype", dtype,
        "--tokens", "2", "--rounds", "1",
    ])
    captured = capsys.readouterr()
    assert_one_line_refusal(status, captured, "mlx-lm-check", family, dtype, "float32 only")
    assert captured.out == ""


def test_another_familys_experts_are_found_too():
    """olmoe's experts (a family of the tests' catalogue) are mlx-lm's SwitchLinear too."""
    import mlx.core as mx

    from helpers.mlx_lm_families import build_synthetic_model
    from mlx_dualnorm.commands import mlx_lm_check

    device = mx.default_device()
    mx.set_default_device(mx.cpu)  # what the refusal is about
    try:
        refusal = mlx_lm_check.cpu_refusal(build_synthetic_model("olmoe", dtype=mx.bfloat16))
    finally:
        mx.set_default_device(device)
    assert refusal is not None and "bfloat16" in refusal and "float32 only" in refusal


def test_the_same_experts_in_float32_run_on_the_cpu(capsys):
    """The rule refuses what fails, not the family."""
    status = cli.main([
        "mlx-lm-check", "--device", "cpu", "--synthetic", "qwen3_moe", "--dtype", "float32",
        "--tokens", "2", "--rounds", "1",
    ])
    assert status == 0, capsys.readouterr()


# ---- Output paths tried for real, empty names and empty values refused -----------


def _output_cases(tmp: pathlib.Path):
    cases = [
        (["bench", "--quick", "--output-dir", ""], "an empty path"),
        (["mlx-lm-bench", "--json", ""], "an empty path"),
        (["bench", "--quick", "--output-dir", str(tmp / NAME_TOO_LONG / "x")], "cannot write"),
        (["mlx-lm-bench", "--json", str(tmp / f"{NAME_TOO_LONG}.json")], "cannot write"),
        (["bench", "--quick", "--output-dir", "~no_such_user_here/x"], "cannot write"),
    ]
    if IS_ROOT:  # permission bits let root write anywhere; /proc does not
        cases += [
            (["bench", "--quick", "--output-dir", "/proc/x"], "cannot write /proc/x"),
            (["mlx-lm-bench", "--json", "/proc/x.json"], "cannot write /proc/x.json"),
        ]
    return cases


def test_output_paths_that_cannot_be_written_are_refused_before_the_run(tmp_path, capsys):
    for arguments, words in _output_cases(tmp_path):
        status = cli.main(arguments)
        captured = capsys.readouterr()
        assert_one_line_refusal(status, captured, arguments[0], words)
        assert captured.out == "", arguments  # nothing was measured
    assert list(tmp_path.iterdir()) == []  # the checks left nothing behind


def test_a_folder_to_create_is_tried_and_left_as_it_was(tmp_path):
    from mlx_dualnorm.commands.shared import command

    wanted = tmp_path / "a" / "b"
    assert command.output_folder(str(wanted)) == wanted
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize(
    "arguments, words",
    [
        (["mlx-lm-check", "--model", "x", "--seed", "3"], "--seed is for --synthetic models only"),
        (["mlx-lm-check", "--model", "x", "--dtype", "float32"], "--dtype is for --synthetic"),
    ],
)
def test_values_the_command_would_ignore_or_misread_are_refused(arguments, words, capsys):
    status = cli.main(arguments)
    captured = capsys.readouterr()
    assert_one_line_refusal(status, captured, arguments[0], words)
