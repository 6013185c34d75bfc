"""Smoke tests of the benchmark: it runs end to end and reports what it
promises. No timing is asserted: only structure, consistency and files."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import pytest

from mlx_dualnorm import benchmark

EXPECTED_METRIC_KINDS = {
    "host_us_per_call",
    "host_release_us_per_call",
    "decode_us_per_token",
    "decode_build_us_per_token",
    "prefill_us_per_call",
    "prefill_peak_bytes",
}
EXPECTED_SCENARIOS = {"decode_gated_delta", "decode_full_attention", "prefill_gated_delta"}


def tiny_config(**overrides: object) -> benchmark.BenchmarkConfig:
    """Quick mode, cut down further: the structure, not the statistics."""
    settings = dict(
        repeats=2,
        layers=3,
        host_batches=2,
        host_calls_per_batch=4,
        decode_warmup_tokens=1,
        decode_tokens=2,
        prefill_iterations=1,
    )
    settings.update(overrides)
    return benchmark.BenchmarkConfig.quick(**settings)


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
    status = benchmark.main(["--quick", "--output-dir", str(tmp_path), "--no-plot"])
    assert status == 0

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
        assert metric["baseline"] == "composed"
        for path, entry in metric["paths"].items():
            assert len(entry["samples"]) == repeats
            assert_spread(entry)
            ratio = entry.get("ratio_to_baseline")
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
    assert "ratio_to_baseline" in decode["compiled"]
    peak = report["metrics"]["prefill_peak_bytes/prefill_gated_delta"]["paths"]
    assert peak["composed"]["median"] > 0

    assert report["targets"], "the issue's targets are evaluated"
    device_type = report["metadata"]["device_type"]
    for target in report["targets"]:
        assert {"name", "issue", "device_type", "metric", "path", "reference", "max_ratio",
                "max_value", "ratio", "value", "met"} <= set(target)
        assert target["device_type"] == device_type, "only this device's targets are judged"
        assert target["metric"] in report["metrics"]
        if target["max_value"] is not None:
            assert target["met"] is (target["value"]["median"] <= target["max_value"])
        else:
            assert target["met"] is (target["ratio"]["median"] <= target["max_ratio"])

    # The compact table is printed last.
    printed = capsys.readouterr().out.rstrip().splitlines()
    assert printed[-1].lstrip().startswith("[")  # the last target line
    assert any(line.startswith("decode_us_per_token") for line in printed)


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


def test_unknown_path_is_a_usage_error(capsys):
    assert benchmark.main(["--quick", "--paths", "no_such_path"]) == 2
    assert "no_such_path" in capsys.readouterr().err


def test_chart_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    report = benchmark.run_benchmark(tiny_config(paths=("compiled",)))
    chart = benchmark.write_chart(report, tmp_path)
    assert chart is not None
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_targets_are_judged_on_their_device_type_by_ratio_or_by_value():
    host_metric = benchmark.metric_key(benchmark.HOST_CALL, benchmark.GATED_DELTA_DECODE)
    here = "gpu" if mx.default_device() == mx.gpu else "cpu"
    elsewhere = "cpu" if here == "gpu" else "gpu"
    targets = (
        benchmark.Target(90, here, host_metric, "compiled", max_value=1e9),  # always met
        benchmark.Target(91, here, host_metric, "compiled", max_value=0.0),  # never met
        benchmark.Target(92, here, host_metric, "compiled", max_ratio=1e9),
        benchmark.Target(93, elsewhere, host_metric, "compiled", max_ratio=1e9),
    )
    report = benchmark.run_benchmark(
        tiny_config(paths=("compiled",)), targets=targets
    )
    verdicts = {result.target.issue: result.met for result in report.targets}
    assert verdicts == {90: True, 91: False, 92: True}, "issue 93 is for the other device"
    by_value = report.targets[0]
    samples = report.metrics[host_metric].samples["compiled"]
    assert by_value.value == benchmark.spread(samples)
    printed = benchmark.format_report_table(report)
    assert f"targets (issues, for the {here.upper()}):" in printed
    assert "[NOT MET] issue 91, " in printed
    assert f"{host_metric}: compiled <= 0 (absolute)" in printed


@pytest.mark.parametrize("bounds", [{}, {"max_ratio": 1.0, "max_value": 1.0}], ids=["none", "both"])
def test_a_target_sets_exactly_one_bound(bounds):
    with pytest.raises(ValueError, match="exactly one"):
        benchmark.Target(4, "cpu", "host_us_per_call/decode_gated_delta", "compiled", **bounds)
