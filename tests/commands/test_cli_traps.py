"""The command line as a new user meets it: global options before or after
the sub-command, one-line errors with the documented exit statuses, help
that shows each default once, bits as parity's default comparison, the
norm + RoPE checked, and a main job that ends with its verdict.

Everything runs the real tools on the real library; the broken paths are
deliberate, to show each check can fail."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from mlx_dualnorm import available_modes, composed_dual_head_norm
from mlx_dualnorm.commands import bench as benchmark, cli, parity, replay
from mlx_dualnorm.commands.parity import matrices

FUSED_AVAILABLE = "fused" in available_modes()
needs_no_fused = pytest.mark.skipif(FUSED_AVAILABLE, reason="the fused mode runs here")


# ---- Global options before (and after) the sub-command ------------------------


@pytest.mark.parametrize("subcommand", [subcommand.name for subcommand in cli.SUBCOMMANDS])
def test_every_subcommand_takes_the_global_device_option_before_its_name(subcommand, capsys):
    if subcommand.startswith("mlx-lm"):
        pytest.importorskip("mlx_lm")
    assert cli.main(["--device", "cpu", subcommand, "--help"]) == 0
    printed = capsys.readouterr().out
    assert f"usage: python -m mlx_dualnorm {subcommand}" in printed
    assert "--device" in printed


def test_device_before_parity_runs_parity_not_the_main_job(capsys):
    arguments = ["parity", "--quick", "--family", "mixed_dtypes", "--path", "compiled"]
    assert cli.main(["--device", "cpu", *arguments]) == 0
    printed = capsys.readouterr().out
    assert "parity of 'compiled'" in printed
    assert "performance on" not in printed  # the main job's benchmark did not run

    assert cli.main([*arguments, "--device", "cpu"]) == 0
    assert "parity of 'compiled'" in capsys.readouterr().out


def test_device_before_replay_passes_on_its_options(capsys):
    assert cli.main(["--device", "cpu", "replay", "--steps", "2", "--path", "compiled"]) == 0
    printed = capsys.readouterr().out
    assert "2 greedy tokens" in printed and "PASS" in printed


def test_a_bad_global_option_before_a_subcommand_is_a_usage_error(capsys):
    assert cli.main(["--device", "tpu", "replay"]) == 2
    assert "invalid choice: 'tpu'" in capsys.readouterr().err


# ---- A path that cannot run here: one line, exit 2 -----------------------------


@needs_no_fused
@pytest.mark.parametrize(
    "tool, arguments",
    [
        (parity.main, ["--quick", "--path", "fused"]),
        (replay.main, ["--steps", "2", "--path", "fused"]),
    ],
)
def test_an_unavailable_path_is_one_line_and_exit_2(tool, arguments, capsys):
    assert tool(arguments) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error
    assert "'fused'" in error and "not available here" in error


# ---- Numeric options are checked by argparse; help shows defaults once -----------


@pytest.mark.parametrize("option", ["--repeats", "--layers"])
def test_bench_refuses_a_zero_count_as_usage(option, capsys):
    assert benchmark.main(["--quick", option, "0"]) == 2
    assert f"argument {option}: must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("subcommand", [subcommand.name for subcommand in cli.SUBCOMMANDS])
def test_help_shows_each_default_once_and_none_for_flags(subcommand, capsys):
    if subcommand.startswith("mlx-lm"):
        pytest.importorskip("mlx_lm")
    assert cli.main([subcommand, "--help"]) == 0
    printed = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "(default: None)" not in printed
    assert "(default: False)" not in printed
    assert "(default: True)" not in printed
    assert printed.count("default: 11, or 3 with --quick") <= 1
    assert not re.search(r"default:[^()]*\) \(default:", printed)  # stated, then again


def test_main_help_shows_the_device_default(capsys):
    assert cli.main(["--help"]) == 0
    assert "(default: default)" in " ".join(capsys.readouterr().out.split())


# ---- Parity: bits by default, the norm + RoPE, the main job's verdict -------------


def make_path_writing_every_zero_as_positive_zero(eps):
    """Equal values, different bits: -0.0 outputs come back as +0.0."""

    def path(queries, keys, query_weight, key_weight):
        outputs = composed_dual_head_norm(queries, keys, query_weight, key_weight, eps)
        return tuple(mx.where(output == 0, mx.zeros_like(output), output) for output in outputs)

    return path


def test_parity_compares_bits_by_default_and_values_only_when_asked(capsys):
    paths = {"unsigned-zeros": make_path_writing_every_zero_as_positive_zero}
    arguments = ["--quick", "--family", "special_values"]

    assert parity.main(arguments, path_factories=paths) == 1
    printed = capsys.readouterr().out
    assert "bit patterns differ" in printed and "parity: MISMATCH in unsigned-zeros" in printed

    assert parity.main([*arguments, "--values"], path_factories=paths) == 0
    assert "parity: all 1 path value-identical" in capsys.readouterr().out


def test_parity_checks_the_norm_rope_against_its_composed_path(capsys):
    assert parity.main(["--quick", "--family", "norm_rope"]) == 0
    printed = capsys.readouterr().out
    assert "parity of 'rope_compiled' against composed_dual_head_norm_rope" in printed
    assert "norm_rope" in printed and "PASS" in printed


def test_the_norm_rope_check_catches_a_reference_one_position_off(monkeypatch):
    composed = matrices.composed_dual_head_norm_rope

    def one_position_later(*arguments, offset=0, **options):
        return composed(*arguments, offset=offset + 1, **options)

    monkeypatch.setattr(matrices, "composed_dual_head_norm_rope", one_position_later)
    (report,) = parity.run_rope_parity_matrix(
        ["rope_compiled"], matrices.build_rope_parity_matrix(quick=True), seed=1,
        matrix_name="quick",
    ).values()
    assert not report.passed
    assert len(report.mismatches) == report.cases_run


def test_the_rope_matrix_covers_dtypes_offsets_and_rope_variants():
    cases = matrices.build_rope_parity_matrix()
    assert {case.dtype_name for case in cases} == {"bfloat16", "float16", "float32"}
    assert {0, 7, 4095} <= {case.offset for case in cases}
    assert any(isinstance(case.offset, tuple) for case in cases)  # one offset per batch entry
    assert {case.traditional for case in cases} == {False, True}
    assert {case.weighted for case in cases} == {False, True}
    assert any(case.dims < case.width for case in cases)  # partial rotary


def test_the_main_job_checks_every_benchmarked_path_and_ends_with_its_verdict(capsys):
    assert cli.main([]) == 0
    printed = capsys.readouterr().out
    for path_name in ("compiled", "mx_compile", "mx_compile_shaped", "rope_compiled"):
        assert f"parity of {path_name!r}" in printed
    assert "dtype + shape + bit patterns" in printed
    last_lines = printed.rstrip().splitlines()
    assert last_lines[-1].startswith("parity: all ") and "bit-identical" in last_lines[-1]
    if not FUSED_AVAILABLE:
        assert "parity: fused skipped: mode 'fused' is not available here" in last_lines[-2]
