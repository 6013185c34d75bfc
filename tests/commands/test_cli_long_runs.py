"""Long commands as a new user meets them: bench tables whose ratio agrees
with the medians printed beside it, progress with the time left, and Ctrl-C
(raised here from a progress report, where a user's would land) printing
what was measured and exiting 130. The chart of bench/chart.py is tested
in test_benchmark.py."""

from __future__ import annotations

import re
import statistics

import pytest

from mlx_dualnorm.commands import bench as benchmark, replay

from mlx_dualnorm.commands.shared import command

TINY_BENCH = ["--quick", "--repeats", "3", "--layers", "2", "--paths", "compiled"]


def tiny_report(**overrides) -> benchmark.BenchmarkReport:
    settings = dict(
        paths=("compiled",), repeats=3, layers=2, host_batches=2, host_calls_per_batch=4,
        decode_warmup_tokens=1, decode_tokens=2, prefill_iterations=1,
    )
    settings.update(overrides)
    return benchmark.run_benchmark(benchmark.BenchmarkConfig.quick(**settings))


# ---- Ratios agree with the medians beside them ------------------------------------


def test_bench_table_ratio_is_the_ratio_of_the_medians_it_prints():
    report = tiny_report()
    prefill = report.metric(benchmark.PREFILL_CALL, benchmark.GATED_DELTA_PREFILL)
    # Repeats whose per-repeat ratios (0.64, 9.00, 0.86) have a median of
    # 0.86x below 1, though the medians (4469.5 against 3469.4) make 1.29x:
    # the contradiction a busy CPU produced.
    prefill.samples["composed"] = [7000.0, 1000.0, 3469.4]
    prefill.samples["compiled"] = [4469.5, 9000.0, 3000.0]
    table = benchmark.format_report_table(report)
    row = next(line for line in table.splitlines() if line.startswith("prefill_us_per_call"))
    match = re.search(r"3469\.4\s+4469\.5 \(([\d.]+)x \[([\d.]+)-([\d.]+)\]\)", row)
    assert match, row
    ratio, lowest, highest = map(float, match.groups())
    assert ratio == pytest.approx(4469.5 / 3469.4, abs=0.006)
    assert (lowest, highest) == (0.64, 9.0)  # the per-repeat ratios' range, as the spread
    assert "per-repeat ratios" in table


def test_bench_json_has_the_ratio_of_medians_beside_the_per_repeat_ratios():
    report = tiny_report()
    entry = report.to_json()["metrics"]["decode_us_per_token/decode_gated_delta"]["paths"]
    ratio = entry["compiled"]["ratio_to_composed"]
    expected = statistics.median(entry["compiled"]["samples"]) / statistics.median(
        entry["composed"]["samples"]
    )
    assert ratio["of_medians"] == pytest.approx(expected)
    assert len(ratio["samples"]) == 3


# ---- Progress with the time left; Ctrl-C prints what was measured -----------------


def test_bench_reports_each_repeat_with_the_time_left(capsys):
    assert benchmark.main(TINY_BENCH) == 0
    progress = capsys.readouterr().err
    for repeat in (1, 2, 3):
        assert re.search(rf"repeats: {repeat}/3, \d+ s so far, ~\d+ s left", progress), progress


def test_bench_interrupted_prints_the_completed_repeats_and_exits_130(monkeypatch, capsys):
    def interrupt_after_two_repeats(message: str) -> None:
        if message.startswith("repeats: 2/3"):
            raise KeyboardInterrupt

    monkeypatch.setattr(benchmark, "progress_to_stderr", interrupt_after_two_repeats)
    assert benchmark.main(TINY_BENCH) == 130
    captured = capsys.readouterr()
    assert "INTERRUPTED: only the 2 repeats that completed" in captured.out
    assert "decode_us_per_token decode_gated_delta" in captured.out
    assert "interrupted" in captured.err and "Traceback" not in captured.err


def test_the_time_left_follows_the_pace_since_the_previous_line(monkeypatch) -> None:
    """A first step of 100 s (kernels compiled) and then steps of 1 s: once the
    pace is known, the estimate is that pace times the steps left, not the
    first step's time spread over all of them."""
    clock = iter([0.0, 100.0, 101.0, 102.0, 103.0])
    monkeypatch.setattr(command.time, "perf_counter", lambda: next(clock))
    lines: list[str] = []
    progress = command.StepProgress("decode", 10, emit=lines.append)
    for _ in range(4):
        progress.step()
    assert lines[0] == "decode: 1/10, 100 s so far, ~900 s left"
    assert lines[-1] == "decode: 4/10, 103 s so far, ~6 s left"


class InterruptingProgress(command.StepProgress):
    """A progress report that presses Ctrl-C at its ``interrupt_at``-th step
    of a stage whose name contains ``stage_word``."""

    stage_word = ""
    interrupt_at = 0

    def step(self, detail: str = "") -> None:
        super().step(detail)
        if self.stage_word in self.stage and self.done == self.interrupt_at:
            raise KeyboardInterrupt


def test_replay_interrupted_prints_the_paths_compared(monkeypatch, capsys):
    monkeypatch.setattr(InterruptingProgress, "stage_word", "replay")
    monkeypatch.setattr(InterruptingProgress, "interrupt_at", 2 * 3 + 1)  # in the 3rd decode
    monkeypatch.setattr(replay.command, "StepProgress", InterruptingProgress)
    arguments = ["--steps", "3", "--path", "compiled", "--path", "mx_compile"]
    assert replay.main(arguments) == 130
    captured = capsys.readouterr()
    assert "compiled" in captured.out and "bit-identical" in captured.out
    assert "replay: INTERRUPTED after 1 of 2 paths" in captured.out


def test_replay_without_interruption_reports_progress(capsys):
    assert replay.main(["--steps", "2", "--path", "compiled"]) == 0
    assert "replay, tokens: 4/4 compiled token 2/2" in capsys.readouterr().err


def test_mlx_lm_bench_defaults_to_the_reduced_run_on_a_cpu_and_shows_progress(capsys):
    pytest.importorskip("mlx_lm")
    import mlx.core as mx

    from mlx_dualnorm.commands import mlx_lm_bench

    if mx.default_device().type != mx.cpu:
        pytest.skip("the reduced default is a CPU's")
    arguments = ["--decode-models", "qwen3-1024"]
    assert mlx_lm_bench.main(arguments) == 0
    captured = capsys.readouterr()
    assert "reduced run (the CPU default; --full-size for the released sizes)" in captured.out
    assert "QUICK: reduced from 28 layers" in captured.out
    assert re.search(r"\[1/1\] decode, qwen3-1024: \d+/26 .*s so far, ~\d+ s left", captured.err)


def test_mlx_lm_bench_interrupted_prints_finished_and_partial_measurements(monkeypatch, capsys):
    pytest.importorskip("mlx_lm")
    from mlx_dualnorm.commands import mlx_lm_bench

    # A model's steps: 6 warm-up tokens, then 2 tokens per path and round: the 12th is
    # the last token of round 2's first path, so one complete round.
    monkeypatch.setattr(InterruptingProgress, "stage_word", "llama-2048")
    monkeypatch.setattr(InterruptingProgress, "interrupt_at", 12)
    monkeypatch.setattr(mlx_lm_bench.command, "StepProgress", InterruptingProgress)
    arguments = ["--quick", "--decode-models", "qwen3-1024,llama-2048", "--decode-steps", "1",
                 "--decode-rounds", "3"]
    assert mlx_lm_bench.main(arguments) == 130
    captured = capsys.readouterr()
    assert "INTERRUPTED during decode, llama-2048" in captured.out
    assert re.search(r"^qwen3-1024 .*3 rounds\)", captured.out, re.M), captured.out
    assert re.search(r"^llama-2048 .*1 rounds\)", captured.out, re.M), captured.out
    assert "Traceback" not in captured.err
