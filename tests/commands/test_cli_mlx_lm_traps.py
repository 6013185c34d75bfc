"""mlx-lm-check and mlx-lm-bench as a new user meets them: an unsupported
mlx-lm is a one-line refusal with exit 2 (not a traceback), and the time
ratio agrees with the medians beside it and comes with its spread and rounds.

The unsupported mlx-lm is mlx-lm 0.32.2 with exactly what 0.31.x lacks
taken away, ``gated_delta.normalize_qk``, in a fresh interpreter (as in
test_mlx_lm_versions.py): the integration only ever looks for that."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("mlx_lm")

from helpers.isolated_process import describe, run_python  # noqa: E402

from mlx_dualnorm.commands import mlx_lm_check  # noqa: E402

RUN_WITHOUT_NORMALIZE_QK = """
    import sys
    import mlx_lm.models.gated_delta as gated_delta
    del gated_delta.normalize_qk  # what mlx-lm 0.31.x lacks
    from mlx_dualnorm.integrations.mlx_lm import registry
    {release}
    from mlx_dualnorm.commands.cli import main
    sys.exit(main({arguments!r}))
"""
# An mlx-lm none of whose attention code is the tested code either: the
# patch has nothing it can prove, so it refuses.
NOTHING_PROVEN = "registry.RECORDED_CODE.clear()"


def run_without_normalize_qk(arguments, release=""):
    return run_python(RUN_WITHOUT_NORMALIZE_QK.format(arguments=arguments, release=release))


def assert_refused_in_one_line(process, message):
    assert process.returncode == 2, describe(process)
    assert "Traceback" not in process.stderr, describe(process)
    assert process.stderr.count("\n") == 1, describe(process)
    assert message in process.stderr, describe(process)
    assert process.stdout == ""  # refused before any model was built or timed


@pytest.mark.parametrize(
    "arguments",
    [
        ["mlx-lm-check", "--synthetic", "qwen3", "--tokens", "2"],
        ["mlx-lm-bench", "--quick", "--decode-models", "qwen3-1024"],
    ],
)
def test_an_unsupported_mlx_lm_is_refused_in_one_line_with_exit_2(arguments):
    process = run_without_normalize_qk(arguments, NOTHING_PROVEN)
    assert_refused_in_one_line(process, "supports mlx-lm 0.32.0 to 0.32.2")


def test_mlx_lm_check_prints_a_ratio_agreeing_with_its_medians_with_range_and_rounds(capsys):
    arguments = ["--synthetic", "qwen3_next", "--tokens", "4", "--rounds", "3", "--device", "cpu"]
    assert mlx_lm_check.main(arguments) == 0
    printed = capsys.readouterr().out
    match = re.search(
        r"unpatched ([\d.]+), patched ([\d.]+) .*patched / unpatched ([\d.]+)x "
        r"\(per round ([\d.]+)\.\.([\d.]+), 3 rounds\)",
        printed,
    )
    assert match, printed
    unpatched, patched, ratio, lowest, highest = map(float, match.groups())
    assert ratio == pytest.approx(patched / unpatched, abs=0.006)
    assert lowest <= highest
