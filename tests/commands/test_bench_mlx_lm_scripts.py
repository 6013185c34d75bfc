"""The mlx-lm measurements kept as scripts of bench/ beside ``mlx-lm-bench``:
``tensor_parallel_decode.py`` (decode over loopback ranks it starts itself)
and ``mlx_lm_prework.py`` (the q/k prework and small models' generation).
Each refuses what cannot run in one ``[script] message`` line, exit 2, before
any work, and runs for real on the real library."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re

import pytest

pytest.importorskip("mlx_lm")

from helpers.isolated_process import describe, run_python  # noqa: E402
from mlx_dualnorm import available_modes  # noqa: E402
from mlx_dualnorm.commands.shared import command  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH, DOCS = ROOT / "bench", ROOT / "docs"
TENSOR_PARALLEL = BENCH / "tensor_parallel_decode.py"
PREWORK = BENCH / "mlx_lm_prework.py"
RUN_SCRIPT = """
    import runpy, sys
    {before}
    sys.argv = [{script!r}, *{arguments!r}]
    runpy.run_path({script!r}, run_name="__main__")
"""


def run_script(script: pathlib.Path, *arguments: str, before: str = "", timeout_s: float = 300):
    return run_python(RUN_SCRIPT.format(script=str(script), arguments=list(arguments),
                                        before=before), timeout_s=timeout_s)


def assert_refused_in_one_line(process, operation: str, *words: str) -> None:
    assert process.returncode == 2, describe(process)
    assert process.stderr.count("\n") == 1, describe(process)
    assert process.stderr.startswith(f"[{operation}] "), describe(process)
    for word in words:
        assert word in process.stderr, describe(process)
    assert process.stdout == "", describe(process)  # refused before any rank started


@pytest.mark.parametrize(
    "arguments, words",
    [
        (["--ranks", "3"], ["3 ranks cannot shard", "num_attention_heads 16", "2, 4, 8"]),
        (["--ranks", "6", "--decode-models", "glm4_moe-5120"],
         ["6 ranks cannot shard glm4_moe-5120"]),
        (["--ranks", "2", "--decode-models", "gemma3-1152"], ["none of gemma3-1152 has"]),
        (["--ranks", "2", "--decode-models", "qwen3-4096"], ["unknown ['qwen3-4096']"]),
        (["--ranks", "2", "--decode-models", ""], ["--decode-models: no model named"]),
        (["--ranks", "1000"], ["--ranks: must be from 2 to 8"]),
        (["--ranks", "abc"], ["--ranks: not an integer: 'abc'"]),
    ],
)
def test_a_rank_count_the_models_cannot_take_is_refused_before_launching(arguments, words):
    process = run_script(TENSOR_PARALLEL, *arguments)
    assert_refused_in_one_line(process, "tensor_parallel_decode", *words)


def test_a_rank_is_not_started_by_hand(tmp_path):
    process = run_script(TENSOR_PARALLEL, "rank", "--model", "qwen3-1024", "--steps", "1",
                         "--rounds", "1", "--out", str(tmp_path))
    assert_refused_in_one_line(process, "tensor_parallel_decode", "started by this script")


@pytest.mark.slow
def test_decode_over_two_loopback_ranks_keeps_the_tokens(tmp_path):
    """On a CPU without --quick or --full-size: the reduced run, as mlx-lm-bench's."""
    report_path = tmp_path / "ranks.json"
    process = run_script(TENSOR_PARALLEL, "--ranks", "2", "--decode-models", "qwen3-1024",
                         "--decode-steps", "2", "--decode-rounds", "1", "--device", "cpu",
                         "--json", str(report_path), timeout_s=900)
    assert process.returncode == 0, describe(process)
    assert "tensor-parallel over 2 ranks (ring backend, loopback)" in process.stdout
    assert f"wrote {report_path}" in process.stderr
    (report,) = json.loads(report_path.read_text())["ranks"]
    assert report["model"] == "qwen3-1024" and report["ranks"] == 2
    assert report["config"]["num_hidden_layers"] == 2  # reduced from 28
    assert report["ok"] and report["token_mismatch"] is None
    assert len(report["unpatched"]) == len(report["patched"]) == 1


def test_the_prework_script_times_both_measurements():
    process = run_script(PREWORK, "--quick", "--layers", "2", "--models", "qwen3")
    assert process.returncode == 0, describe(process)
    for row in ("prework_2_layers", "generation_qwen3_bfloat16"):
        assert re.search(rf"^{row} +\S+ +[\d.]+ +[\d.]+ +[\d.]+x", process.stdout, re.M), \
            describe(process)


def test_the_prework_rows_time_the_patched_function_while_the_patch_is_on():
    """The patched rounds fold every call (the function patch() installs runs
    mlx-lm's own once the patch is off: timed then, it would time mlx-lm twice);
    the unpatched rounds fold none."""
    from mlx_dualnorm.commands.shared.generation import count_normalize_qk_calls

    script = load_script(PREWORK)
    with count_normalize_qk_calls() as counts:
        timing = script.run_prework(3, 2, 1, None, progress=lambda label: None)
    assert timing.complete_rounds == 1
    # (warm-up 3 tokens + 2 timed) x 3 layers, patched only.
    assert counts.calls == counts.folded == 5 * 3, counts


def test_the_prework_rows_need_normalize_qk_and_say_so_in_one_line():
    """An mlx-lm without ``gated_delta.normalize_qk`` (0.31.x) has no function to time."""
    process = run_script(PREWORK, "--quick", "--layers", "36", "--models", "",
                         before="import mlx_lm.models.gated_delta as g; del g.normalize_qk")
    assert_refused_in_one_line(process, "mlx_lm_prework", "no gated_delta.normalize_qk")


@pytest.mark.skipif("fused" in available_modes(), reason="fused runs here")
def test_the_prework_script_refuses_a_mode_that_cannot_run_here_in_one_line():
    process = run_script(PREWORK, "--mode", "fused", "--layers", "2", "--models", "")
    assert_refused_in_one_line(process, "mlx_lm_prework", "mode 'fused' cannot run here")


def load_script(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_the_prework_script_interrupted_prints_what_it_measured(monkeypatch, capsys):
    """Ctrl-C in the second round of a generation stage: the prework row and the
    generation row's complete round are printed, exit 130."""
    script = load_script(PREWORK)

    class InterruptingProgress(command.StepProgress):
        def step(self, detail: str = "") -> None:
            super().step(detail)
            if "generation" in self.stage and self.done == 3:  # round 2's first path timed
                raise KeyboardInterrupt

    monkeypatch.setattr(script.command, "StepProgress", InterruptingProgress)
    parser = script.build_parser()
    arguments = ["--quick", "--layers", "2", "--models", "qwen3"]
    assert command.run_tool(parser, script._run, arguments) == 130
    captured = capsys.readouterr()
    assert "INTERRUPTED: the rows hold the complete rounds" in captured.out
    assert re.search(r"^prework_2_layers .*3 rounds\)", captured.out, re.M), captured.out
    assert re.search(r"^generation_qwen3_bfloat16 .*1 rounds\)", captured.out, re.M)
    assert captured.err.rstrip().endswith("[mlx_lm_prework] interrupted")


def test_tokens_that_change_between_generation_rounds_are_a_mismatch_with_exit_1(
    monkeypatch, capsys
):
    """Generation rounds must give the same tokens; when one does not, the
    script prints what it measured and says so, exit 1 (not a traceback). The
    change is made in the script's own trace, MLX runs as is."""
    script = load_script(PREWORK)
    generate = script.greedy_generate
    rounds = []

    def generate_with_a_changed_round(*arguments, **options):
        trace = generate(*arguments, **options)
        rounds.append(trace)
        if len(rounds) == 4:  # a timed round, after the two warm-up rounds
            trace.token_ids[-1] += 1
        return trace

    monkeypatch.setattr(script, "greedy_generate", generate_with_a_changed_round)
    parser = script.build_parser()
    arguments = parser.parse_args(["--quick", "--layers", "2", "--models", "qwen3_5"])
    assert script._run(arguments, parser) == 1
    captured = capsys.readouterr()
    assert "TOKEN MISMATCH: qwen3_5: greedy token ids changed between rounds" in captured.err
    assert "prework_2_layers" in captured.out  # what was measured before is printed


def test_the_docs_name_the_models_the_ranks_time():
    """docs/mlx-lm.md lists the decode models the script can shard, as the code finds them."""
    script = load_script(TENSOR_PARALLEL)
    shardable = [name for name in script.DECODE_MODELS if script.has_shard(name)]
    text = " ".join((DOCS / "mlx-lm.md").read_text(encoding="utf-8").split())
    match = re.search(r"decode models that have `Model.shard` \(([^)]*)\)", text)
    assert match is not None and re.findall(r"`([^`]+)`", match[1]) == shardable
    assert "It starts the ranks itself" in text
    help_text = " ".join(script.build_parser().format_help().split())
    assert "ranks this script starts on loopback (ring backend)" in help_text
