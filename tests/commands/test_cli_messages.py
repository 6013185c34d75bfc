"""What the commands say is what happened: a mode name that does not exist
is told apart from a real mode that cannot run here, every bad integer is
"not an integer", and the top-level help describes each sub-command."""

from __future__ import annotations

import pytest

from mlx_dualnorm import available_modes
from mlx_dualnorm.commands import cli
from mlx_dualnorm.commands.shared import command

pytest.importorskip("mlx_lm")

from mlx_dualnorm import mlx_lm as wrapper  # noqa: E402

FUSED_RUNS = "fused" in available_modes()


def test_the_wrapper_says_a_mode_name_does_not_exist_and_lists_the_modes(capsys):
    assert wrapper.main(["--dualnorm-mode", "bogus", "generate", "--help"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error
    assert "--dualnorm-mode bogus: no such mode; choose from auto, composed, compiled, fused" \
        in error
    assert "cannot run here" not in error


@pytest.mark.skipif(FUSED_RUNS, reason="the fused mode runs here")
def test_the_wrapper_says_a_real_mode_cannot_run_here(capsys):
    assert wrapper.main(["--dualnorm-mode", "fused", "generate", "--help"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "cannot run here" in error, error
    assert "no such mode" not in error


@pytest.mark.parametrize("subcommand", ["mlx-lm-check", "mlx-lm-bench"])
def test_the_commands_say_a_mode_name_does_not_exist(subcommand, capsys):
    arguments = [subcommand, "--mode", "bogus"]
    if subcommand == "mlx-lm-check":
        arguments += ["--synthetic", "qwen3"]
    assert cli.main(arguments) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error
    assert "argument --mode: invalid choice: 'bogus'" in error
    assert all(f"'{mode}'" in error for mode in command.MODE_CHOICES)
    assert "cannot run here" not in error


@pytest.mark.skipif(FUSED_RUNS, reason="the fused mode runs here")
def test_the_commands_say_a_real_mode_cannot_run_here(capsys):
    assert cli.main(["mlx-lm-check", "--synthetic", "qwen3", "--mode", "fused"]) == 2
    error = capsys.readouterr().err
    assert "cannot run here" in error and "invalid choice" not in error, error


@pytest.mark.parametrize(
    "arguments",
    [
        ["mlx-lm-bench", "--decode-rounds", "abc"],
        ["mlx-lm-bench", "--decode-steps", "abc"],
        ["mlx-lm-check", "--synthetic", "qwen3", "--tokens", "abc"],
        ["bench", "--layers", "abc"],
        ["replay", "--seed", "abc"],
    ],
)
def test_every_bad_integer_is_not_an_integer(arguments, capsys):
    assert cli.main(arguments) == 2
    error = capsys.readouterr().err
    assert "not an integer: 'abc'" in error and "invalid int value" not in error, error


def test_the_top_level_help_describes_mlx_lm_bench_as_what_it_times(capsys):
    assert cli.main(["--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    summary = help_text.split(" mlx-lm-bench ", 1)[1].split("'python -m")[0]
    for measured in ("decode", "released model", "tokens compared"):
        assert measured in summary, summary
