"""Smoke tests of the benchmark: it runs end to end and reports what it
promises. No timing is asserted: only structure, consistency and files."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import mlx.core as mx
import pytest

from mlx_dualnorm.commands import bench as benchmark

EXPECTED_METRIC_KINDS = {
    "host_us_per_call",
    "host_release_us_per_call",
    "decode_us_per_token",
    "decode_build_us_per_token",
    "prefill_us_per_call",
    "prefill_peak_bytes",
}
EXPECTED_SCENARIOS = {"decode_gated_delta", "decode_full_attention", "prefill_gated_delta"}


# Quick mode, cut down further: the structure, not the statistics.
TINY_SETTINGS = {
    "repeats": 2, "layers": 3, "host_batches": 2, "host_calls_per_batch": 4,
    "decode_warmup_tokens": 1, "decode_tokens": 2, "prefill_iterations": 1,
}


def tiny_config(**overrides: object) -> benchmark.BenchmarkConfig:
    return benchmark.BenchmarkConfig.quick(**{**TINY_SETTINGS, **overrides})


@pytest.fixture
def restored_registry():
    """Lets a test register paths without leaking them into other tests."""
    saved = dict(benchmark.PATH_REGISTRY)
    yield benchmark.PATH_REGISTRY
    benchmark.PATH_REGISTRY.clear()
    benchmark.PATH_REGISTRY.update(saved)


def assert_spread(entry: dict) -> None:
    assert entry["min"] <= entry["median"] <= entry["max"]
    assert all(math.isfinite(value) for value in entry["samples"])


def test_quick_cli_run_writes_valid_json(tmp_path, capsys):
    status = benchmark.main(["--quick", "--output-dir", str(tmp_path)])
    assert status == 0
    assert [path.name for path in tmp_path.iterdir()] == [benchmark.JSON_FILE_NAME], (
        "the package writes the JSON only: bench/chart.py draws it"
    )

    report = json.loads((tmp_path / benchmark.JSON_FILE_NAME).read_text())
    assert report["schema"] == benchmark.REPORT_SCHEMA
    for key in ("date", "device", "cpu_model", "cpu_cores", "mlx_version", "host_loop_overhead_us"):
        assert key in report["metadata"]
    assert report["metadata"]["mlx_version"] == mx.__version__
    assert report["config"]["quick_mode"] is True
    repeats = report["config"]["repeats"]

    for name in ("composed", "mx_compile", "compiled"):
        assert report["paths"][name]["status"] == "ok"
    assert set(report["scenarios"]) == EXPECTED_SCENARIOS

    kinds = {metric["kind"] for metric in report["metrics"].values()}
    assert kinds == EXPECTED_METRIC_KINDS
    for key, metric in report["metrics"].items():
        assert key == f"{metric['kind']}/{metric['scenario']}"
        assert metric["reference_path"] == "composed"
        assert "lower is better" in metric["ratio_definition"]
        for path, entry in metric["paths"].items():
            assert len(entry["samples"]) == repeats
            assert_spread(entry)
            ratio = entry.get("ratio_to_composed")
            if path == "composed":
                assert ratio["samples"] == [1.0] * repeats
            elif ratio is not None:
                assert_spread(ratio)
                assert len(ratio["samples"]) == repeats
                for value, ratio_value, reference in zip(
                    entry["samples"], ratio["samples"], metric["paths"]["composed"]["samples"]
                ):
                    assert ratio_value == pytest.approx(value / reference)

    decode = report["metrics"]["decode_us_per_token/decode_gated_delta"]["paths"]
    assert "ratio_to_composed" in decode["compiled"]
    peak = report["metrics"]["prefill_peak_bytes/prefill_gated_delta"]["paths"]
    assert peak["composed"]["median"] > 0

    assert "targets" not in report, "the performance goals live in bench/targets.py, not in the package"

    # The table, then what each metric and path is.
    printed = capsys.readouterr().out
    assert "lower is better" in printed
    assert any(line.startswith("decode_us_per_token") for line in printed.splitlines())
    for name in ("composed", "mx_compile", "mx_compile_shaped", "compiled"):
        assert f"  {name}: " in printed, f"the path {name} is described"
    assert "issue" not in printed.lower()


def test_registered_path_runs_and_unavailable_path_is_skipped(restored_registry):
    calls = []

    def plain_python_path(eps):
        def two_norms(queries, keys, query_weight, key_weight):
            calls.append(1)
            return (
                mx.fast.rms_norm(queries, query_weight, eps),
                mx.fast.rms_norm(keys, key_weight, eps),
            )

        return two_norms

    def unavailable_path(eps):
        raise benchmark.PathUnavailable("not built here")

    def weightless_only_path(eps):
        def call(queries, keys, query_weight, key_weight):
            if query_weight is not None:
                raise benchmark.PathUnavailable("takes no weights")
            return mx.fast.rms_norm(queries, None, eps), mx.fast.rms_norm(keys, None, eps)

        return call

    benchmark.register_path("plain", plain_python_path, "test path")
    benchmark.register_path("missing", unavailable_path)
    benchmark.register_path("weightless", weightless_only_path)
    report = benchmark.run_benchmark(
        tiny_config(paths=("plain", "missing", "weightless", "compiled"))
    )

    assert calls, "the registered path was called"
    assert list(report.path_status)[0] == "composed", "the baseline is always added"
    assert report.path_status["plain"]["status"] == "ok"
    assert report.path_status["missing"]["status"] == "skipped"
    assert "not built here" in report.path_status["missing"]["reason"]
    assert "decode_full_attention" in report.path_status["weightless"]["skipped_scenarios"]

    tokens = report.metric(benchmark.DECODE_TOKEN, benchmark.GATED_DELTA_DECODE)
    assert set(tokens.samples) == {"composed", "plain", "weightless", "compiled"}
    full_attention = report.metric(benchmark.DECODE_TOKEN, benchmark.FULL_ATTENTION_DECODE)
    assert "weightless" not in full_attention.samples

    table = benchmark.format_report_table(report)
    assert "missing" in table and "skipped" in table
    summary = benchmark.summary_table(report)
    assert "plain" in summary and "compiled" in summary and "missing" not in summary
    assert "lower is better" in summary and "  compiled: " in summary


def test_unknown_path_is_a_usage_error(capsys):
    assert benchmark.main(["--quick", "--paths", "no_such_path"]) == 2
    assert "no_such_path" in capsys.readouterr().err


BENCH_FOLDER = pathlib.Path(__file__).resolve().parents[2] / "bench"
CHART_SCRIPT = BENCH_FOLDER / "chart.py"


def load_bench_script(name: str):
    """bench/NAME.py, a script of the project's benchmark home outside the package."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH_FOLDER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def load_bench_targets():
    """bench/targets.py: the project's goals, judged outside the package."""
    return load_bench_script("targets")


def run_chart(*arguments: str, prelude: str = "") -> subprocess.CompletedProcess:
    """``python bench/chart.py ARGUMENTS``, after ``prelude`` (Python) where one is given."""
    command = [sys.executable, str(CHART_SCRIPT), *arguments]
    if prelude:
        command = [sys.executable, "-c", f"{prelude}\nimport runpy, sys\n"
                   f"sys.argv = {[str(CHART_SCRIPT), *arguments]!r}\n"
                   f"runpy.run_path(sys.argv[0], run_name='__main__')"]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def quick_report_folder(tmp_path_factory) -> pathlib.Path:
    """The folder a real ``bench --quick --output-dir`` wrote its JSON into."""
    folder = tmp_path_factory.mktemp("quick_bench")
    process = subprocess.run(
        [sys.executable, "-m", "mlx_dualnorm", "bench", "--quick", "--output-dir", str(folder)],
        capture_output=True, text=True, timeout=600,
    )
    assert process.returncode == 0, process.stderr
    return folder


HEADLINE_KINDS = {  # the kinds the table prints without --all-metrics, and the chart draws
    "host_us_per_call", "decode_us_per_token", "prefill_us_per_call", "prefill_peak_bytes",
}


def headline_metrics(report: dict) -> list[dict]:
    """The report's headline metrics, in its order."""
    return [metric for metric in report["metrics"].values() if metric["kind"] in HEADLINE_KINDS]


def tiny_report_json() -> dict:
    """A small run's report as benchmark.json holds it."""
    report = benchmark.run_benchmark(tiny_config(paths=("compiled",)))
    return json.loads(json.dumps(report.to_json()))


def test_chart_is_a_png(quick_report_folder, tmp_path):
    """bench/chart.py draws a real run's JSON into a PNG, beside it or where --out says:
    three charts a row at 110 dpi, 15 x 4 inches a row."""
    pyplot = pytest.importorskip("matplotlib.pyplot")
    beside = quick_report_folder / "benchmark.png"
    assert not beside.exists()
    process = run_chart(str(quick_report_folder))
    assert process.returncode == 0, process.stderr
    assert f"wrote {beside}" in process.stderr
    elsewhere = tmp_path / "charts" / "run.png"
    process = run_chart(str(quick_report_folder / "benchmark.json"), "--out", str(elsewhere))
    assert process.returncode == 0, process.stderr

    report = json.loads((quick_report_folder / "benchmark.json").read_text())
    rows = math.ceil(len(headline_metrics(report)) / 3)
    assert rows == 2
    for chart in (beside, elsewhere):
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width, _ = pyplot.imread(chart).shape
        assert (width, height) == (15 * 110, rows * 4 * 110)


def test_chart_of_a_file_that_is_not_a_report_exits_2_in_one_line(tmp_path):
    other_schema = tiny_report_json()
    other_schema["schema"] = "mlx_dualnorm.benchmark/1"
    (tmp_path / "benchmark.json").write_text(json.dumps(other_schema))
    not_json = tmp_path / "table.txt"
    not_json.write_text("metric / scenario  composed\n")
    for location, reason in ((tmp_path, "not a mlx_dualnorm.benchmark/2 report"),
                             (not_json, "is not JSON"),
                             (tmp_path / "missing", "cannot read")):
        process = run_chart(str(location))
        assert process.returncode == 2, process.stderr
        assert process.stderr.startswith("[chart] ") and process.stderr.count("\n") == 1, (
            process.stderr
        )
        assert reason in process.stderr
    assert not list(tmp_path.glob("*.png"))


def test_chart_without_matplotlib_exits_2_in_one_line(tmp_path):
    (tmp_path / "benchmark.json").write_text(json.dumps(tiny_report_json()))
    # None in sys.modules makes `import matplotlib` raise ImportError, as where it is missing.
    process = run_chart(str(tmp_path), "--out", str(tmp_path / "chart.png"),
                        prelude="import sys\nsys.modules['matplotlib'] = None")
    assert process.returncode == 2, process.stderr
    assert process.stderr == "[chart] matplotlib is not installed (pip install matplotlib)\n"
    assert not (tmp_path / "chart.png").exists()


def test_chart_has_a_bar_per_path_a_legend_for_every_colour_and_marks_a_quick_run():
    pyplot = pytest.importorskip("matplotlib.pyplot")
    chart = load_bench_script("chart")
    report = tiny_report_json()
    for quick in (True, False):
        report["config"]["quick_mode"] = quick
        figure = chart.draw_chart(report)
        try:
            (legend,) = figure.legends
            labels = [text.get_text() for text in legend.get_texts()]
            assert any(label.startswith("composed: the reference") for label in labels)
            assert any(label.startswith("another path") for label in labels)
            assert any("whisker" in label for label in labels)
            legend_colours = {tuple(handle.get_facecolor()) for handle in legend.legend_handles[:2]}
            drawn = [axes for axes in figure.axes if axes.get_visible()]
            assert len(drawn) == len(headline_metrics(report)) == 6
            for axes, metric in zip(drawn, headline_metrics(report)):
                assert axes.get_title() == f"{metric['title']}\n{metric['scenario']}"
                assert "lower is better" in axes.get_ylabel()
                bars = axes.patches
                assert {tuple(bar.get_facecolor()) for bar in bars} == legend_colours
                paths = metric["paths"]
                scale = 2**20 if metric["unit"] == "bytes" else 1
                assert [bar.get_height() for bar in bars] == pytest.approx(
                    [paths[name]["median"] / scale for name in ("composed", "compiled")]
                )
                ratio = paths["compiled"]["median"] / paths["composed"]["median"]
                names = [label.get_text() for label in axes.get_xticklabels()]
                assert names == ["composed\n1.00x", f"compiled\n{ratio:.2f}x"]
            title = figure._suptitle
            assert title.get_text().startswith("QUICK RUN") == quick
            assert "lower is better" in title.get_text()
            assert (title.get_color() == "tab:red") == quick
        finally:
            pyplot.close(figure)


def test_bench_goals_are_judged_on_their_device_type_by_ratio_or_by_value():
    targets = load_bench_targets()
    report = benchmark.run_benchmark(tiny_config(paths=("compiled",))).to_json()
    here = report["metadata"]["device_type"]
    elsewhere = "cpu" if here == "gpu" else "gpu"
    metric = "host_us_per_call/decode_gated_delta"
    goals = (
        targets.Goal(here, metric, "compiled", max_value=1e9),  # always met
        targets.Goal(here, metric, "compiled", max_value=0.0),  # never met
        targets.Goal(here, metric, "compiled", max_ratio=1e9),
        targets.Goal(elsewhere, metric, "compiled", max_ratio=0.0),  # not judged here
        targets.Goal(here, metric, "no_such_path", max_ratio=1.0),
    )
    lines, all_met = targets.format_verdicts(report, goals)
    assert not all_met
    assert [line.split("]")[0].strip() for line in lines[1:]] == [
        "[met", "[NOT MET", "[met", "[NOT MEASURED"
    ]
    with pytest.raises(ValueError, match="exactly one"):
        targets.Goal(here, metric, "compiled")


@pytest.mark.parametrize("per_turn", [1, 2, 8])
def test_paths_take_turns_of_consecutive_samples(per_turn):
    """Each path gets exactly its samples, in turns of ``per_turn``
    consecutive ones (decode runs one path token after token), so a larger
    turn means fewer switches between paths."""
    taken = []
    calls = {name: name for name in ("a", "b", "c")}
    results = benchmark.interleaved_samples(
        calls, lambda call: taken.append(call) or len(taken), 5, warmup=1, per_turn=per_turn
    )
    assert taken[:3] == ["a", "b", "c"]  # the warm-up, one sample each
    timed = taken[3:]
    assert {name: len(samples) for name, samples in results.items()} == {"a": 5, "b": 5, "c": 5}
    assert timed[: min(per_turn, 5)] == ["a"] * min(per_turn, 5)
    switches = sum(1 for before, after in zip(timed, timed[1:]) if before != after)
    assert switches <= 3 * math.ceil(5 / per_turn) - 1
