"""Benchmarks of the compiled dual head norm against the paths it replaces.

One run measures every registered path on the default MLX device:

* host us per dual call: graph build only, no evaluation, at the two decode
  shapes (the median of many calls; the outputs of each timed batch are
  kept alive and released outside the timed region, and the release is
  reported on its own);
* us per decode token: ``layers`` dual calls chained lazily (each layer's
  normalized queries and keys are the next layer's inputs) and one
  ``mx.eval`` per token, at the gated-delta decode shape (q and k
  ``(1, 1, 16, 128)`` bf16, no weights) and the full-attention decode shape
  (q ``(1, 1, 16, 256)``, k ``(1, 1, 2, 256)`` bf16, weighted);
* one dual call at the prefill shape ``(1, 512, 16, 128)``: time (build and
  eval) and the peak memory above the resident inputs.

Every number is taken once per repeat for every path, as the median of its
samples; inside a repeat the paths take their samples in turn (one batch
or call each, decode tokens ``decode_tokens_per_turn`` at a time, as decode
runs one path token after token; the order rotating and reversing), so load
that comes and goes on the machine falls on all of them alike. Values are
reported as min / median / max over the repeats. The ratio to the baseline
path (``composed``) a table prints is the ratio of the two medians it
prints beside it; the ratios taken per repeat give its spread (their
min-max), so a noisy machine shows as a wide range, never as a ratio that
contradicts its medians.

A ratio is always ``value(path) / value(composed)`` (time, or peak memory):
lower is better, below 1 the path beats the composed path.

The paths are those of :mod:`mlx_dualnorm.tools.paths`, by the names every
tool uses; adding one is one ``register_path`` call. A factory, or a call,
that raises :class:`PathUnavailable` marks the path (or that path at that
shape) as skipped instead of failing the run.

``main(argv)`` is the command line (``python -m mlx_dualnorm bench``);
``run_benchmark(config)`` the programmatic API; ``summary_table`` the short
table the package's main job prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx

from mlx_dualnorm.tools import command
from mlx_dualnorm.tools.paths import (
    COMPILED_PATH,
    FUSED_PATH,
    PATH_REGISTRY,
    PYTHON_COMPILE_PATH,
    PYTHON_COMPILE_SHAPED_PATH,
    REFERENCE_PATH,
    PathUnavailable,
    describe_paths,
    package_mode_factory,
    register_path,
)

__all__ = [
    "BenchmarkConfig",
    "BenchmarkReport",
    "PATH_REGISTRY",
    "PathUnavailable",
    "Scenario",
    "format_report_table",
    "main",
    "package_mode_factory",
    "register_path",
    "run_benchmark",
    "summary_table",
    "write_chart",
    "write_json",
]

REPORT_SCHEMA = "mlx_dualnorm.benchmark/2"
JSON_FILE_NAME = "benchmark.json"
CHART_FILE_NAME = "benchmark.png"
BASELINE_PATH = REFERENCE_PATH  # every ratio is to this path's value
RATIO_DEFINITION = (
    f"this path's value / {BASELINE_PATH}'s value: per repeat in samples, and of the "
    "medians in of_medians (what the tables print); lower is better"
)

DualHeadNormCall = Callable[
    [mx.array, mx.array, Optional[mx.array], Optional[mx.array]],
    "tuple[mx.array, mx.array]",
]
# Host timing only keeps a call's outputs, so it also takes calls that return
# something else (the empty-loop baseline returns None).
TimedCall = Callable[[mx.array, mx.array, Optional[mx.array], Optional[mx.array]], object]



# ---- What is measured --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scenario:
    """Input shapes of one measured situation (bf16 inputs by default)."""

    name: str
    query_shape: tuple[int, ...]
    key_shape: tuple[int, ...]
    weighted: bool
    description: str
    dtype_name: str = "bfloat16"


GATED_DELTA_DECODE = Scenario(
    "decode_gated_delta",
    (1, 1, 16, 128),
    (1, 1, 16, 128),
    weighted=False,
    description="gated-delta decode: q, k (1,1,16,128) bf16, no weights",
)
FULL_ATTENTION_DECODE = Scenario(
    "decode_full_attention",
    (1, 1, 16, 256),
    (1, 1, 2, 256),
    weighted=True,
    description="full-attention decode: q (1,1,16,256), k (1,1,2,256) bf16, weighted",
)
GATED_DELTA_PREFILL = Scenario(
    "prefill_gated_delta",
    (1, 512, 16, 128),
    (1, 512, 16, 128),
    weighted=False,
    description="gated-delta prefill: q, k (1,512,16,128) bf16, no weights",
)
DECODE_SCENARIOS = (GATED_DELTA_DECODE, FULL_ATTENTION_DECODE)


@dataclasses.dataclass(frozen=True)
class MetricKind:
    """One kind of number; a metric is a kind at a scenario."""

    name: str
    title: str
    unit: str
    headline: bool  # drawn in the chart and printed in the table


HOST_CALL = MetricKind("host_us_per_call", "host us per dual call (build, no eval)", "us", True)
HOST_RELEASE = MetricKind(
    "host_release_us_per_call", "host us to release one unevaluated call", "us", False
)
DECODE_TOKEN = MetricKind("decode_us_per_token", "us per decode token (build + eval)", "us", True)
DECODE_BUILD = MetricKind(
    "decode_build_us_per_token", "us per decode token, graph build part", "us", False
)
PREFILL_CALL = MetricKind("prefill_us_per_call", "us per prefill dual call (build + eval)", "us", True)
PREFILL_PEAK = MetricKind(
    "prefill_peak_bytes", "prefill peak memory above resident inputs", "bytes", True
)


def metric_key(kind: MetricKind, scenario: Scenario) -> str:
    return f"{kind.name}/{scenario.name}"


@dataclasses.dataclass(frozen=True)
class BenchmarkConfig:
    """How much to measure. The defaults are the full run; ``quick()`` is a
    few-second smoke run with the same structure."""

    eps: float = 1e-6
    paths: Optional[tuple[str, ...]] = None  # None: every registered path
    repeats: int = 11
    layers: int = 48
    host_batches: int = 100
    host_calls_per_batch: int = 100
    decode_warmup_tokens: int = 3
    decode_tokens: int = 80
    # Consecutive tokens of one path per turn, as decode runs: alternating
    # paths token by token doubled every path's encoding on an H200 (MLX's
    # CUDA backend reuses one cached graph executable per graph shape).
    decode_tokens_per_turn: int = 8
    prefill_iterations: int = 12
    seed: int = 20261129
    quick_mode: bool = False

    @classmethod
    def quick(cls, **overrides: Any) -> "BenchmarkConfig":
        settings: dict[str, Any] = dict(
            repeats=3,
            host_batches=8,
            host_calls_per_batch=50,
            decode_warmup_tokens=1,
            decode_tokens=4,
            decode_tokens_per_turn=2,
            prefill_iterations=2,
            quick_mode=True,
        )
        settings.update(overrides)
        return cls(**settings)

    def selected_paths(self) -> tuple[str, ...]:
        names = tuple(PATH_REGISTRY) if self.paths is None else tuple(self.paths)
        unknown = [name for name in names if name not in PATH_REGISTRY]
        if unknown:
            raise ValueError(
                f"unknown benchmark path(s) {', '.join(unknown)}; "
                f"registered: {', '.join(PATH_REGISTRY)}"
            )
        if BASELINE_PATH not in names:
            names = (BASELINE_PATH, *names)
        return names


# ---- Results -------------------------------------------------------------------


def spread(samples: Sequence[float]) -> dict[str, float]:
    return {
        "min": min(samples),
        "median": statistics.median(samples),
        "max": max(samples),
    }


@dataclasses.dataclass
class MetricResult:
    """One metric: a value per repeat for every path that ran."""

    key: str
    kind: MetricKind
    scenario: Scenario
    samples: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def ratio_samples(self, path: str, reference: str = BASELINE_PATH) -> Optional[list[float]]:
        """Per-repeat ratios path / reference (None if either did not run,
        or a reference value is zero)."""
        values, references = self.samples.get(path), self.samples.get(reference)
        if not values or not references or len(values) != len(references):
            return None
        if any(reference_value == 0 for reference_value in references):
            return None
        return [value / reference_value for value, reference_value in zip(values, references)]

    def ratio_of_medians(self, path: str, reference: str = BASELINE_PATH) -> Optional[float]:
        """median(path) / median(reference): the ratio printed beside those
        medians (None if either did not run)."""
        return command.ratio_of_medians(self.samples.get(path, []), self.samples.get(reference, []))

    def to_json(self) -> dict:
        paths = {}
        for path, values in self.samples.items():
            entry = {"samples": values, **spread(values)}
            ratios = self.ratio_samples(path)
            if ratios is not None:
                entry["ratio_to_composed"] = {
                    "samples": ratios,
                    **spread(ratios),
                    "of_medians": self.ratio_of_medians(path),
                }
            paths[path] = entry
        return {
            "kind": self.kind.name,
            "scenario": self.scenario.name,
            "title": self.kind.title,
            "unit": self.kind.unit,
            "reference_path": BASELINE_PATH,
            "ratio_definition": RATIO_DEFINITION,
            "paths": paths,
        }


@dataclasses.dataclass
class BenchmarkReport:
    """Everything one run measured; ``to_json()`` is the file's content."""

    config: BenchmarkConfig
    metadata: dict
    path_status: dict[str, dict]
    metrics: dict[str, MetricResult]
    elapsed_s: float = 0.0
    interrupted: bool = False  # Ctrl-C stopped the run: config.repeats is what completed

    def metric(self, kind: MetricKind, scenario: Scenario) -> MetricResult:
        return self.metrics[metric_key(kind, scenario)]

    def ran(self, path: str) -> bool:
        return self.path_status.get(path, {}).get("status") == "ok"

    def to_json(self) -> dict:
        return {
            "schema": REPORT_SCHEMA,
            "metadata": self.metadata,
            "config": dataclasses.asdict(self.config),
            "elapsed_s": self.elapsed_s,
            "interrupted": self.interrupted,
            "paths": self.path_status,
            "scenarios": {
                scenario.name: dataclasses.asdict(scenario)
                for scenario in (*DECODE_SCENARIOS, GATED_DELTA_PREFILL)
            },
            "metrics": {key: metric.to_json() for key, metric in self.metrics.items()},
        }


# ---- Inputs and measurement loops ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ScenarioInputs:
    queries: mx.array
    keys: mx.array
    query_weight: Optional[mx.array]
    key_weight: Optional[mx.array]


def make_inputs(scenario: Scenario, seed: int) -> ScenarioInputs:
    """Evaluated, deterministic inputs; weights near 1 where weighted."""
    dtype = getattr(mx, scenario.dtype_name)
    query_key, key_key, query_weight_key, key_weight_key = mx.random.split(
        mx.random.key(seed), 4
    )
    queries = mx.random.normal(scenario.query_shape, key=query_key).astype(dtype)
    keys = mx.random.normal(scenario.key_shape, key=key_key).astype(dtype)
    query_weight = key_weight = None
    if scenario.weighted:
        query_weight = (
            1 + 0.1 * mx.random.normal(scenario.query_shape[-1:], key=query_weight_key)
        ).astype(dtype)
        key_weight = (
            1 + 0.1 * mx.random.normal(scenario.key_shape[-1:], key=key_weight_key)
        ).astype(dtype)
    mx.eval([array for array in (queries, keys, query_weight, key_weight) if array is not None])
    return ScenarioInputs(queries, keys, query_weight, key_weight)


class _GarbageCollectionPaused:
    """Keeps the cyclic collector out of timed loops (as timeit does)."""

    def __enter__(self) -> None:
        self.was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc_info: object) -> None:
        if self.was_enabled:
            gc.enable()


def build_batch(
    call: TimedCall, inputs: ScenarioInputs, calls: int
) -> tuple[float, float]:
    """One host sample: (us per call to build, us per call to release).

    The batch's outputs stay alive until its clock stops, so the build time
    holds no graph teardown; they are then released (timed apart), so
    unevaluated graphs never pile up."""
    queries, keys = inputs.queries, inputs.keys
    query_weight, key_weight = inputs.query_weight, inputs.key_weight
    kept_outputs: list = []
    keep = kept_outputs.append
    clock = time.perf_counter_ns
    started = clock()
    for _ in range(calls):
        keep(call(queries, keys, query_weight, key_weight))
    built = clock()
    kept_outputs.clear()
    released = clock()
    return (built - started) / 1e3 / calls, (released - built) / 1e3 / calls


def time_graph_builds(
    call: TimedCall, inputs: ScenarioInputs, batches: int, calls_per_batch: int
) -> tuple[float, float]:
    """One path alone: (median us per call to build, median us per call to
    release) over ``batches`` batches."""
    with _GarbageCollectionPaused():
        samples = [build_batch(call, inputs, calls_per_batch) for _ in range(batches)]
    return (
        statistics.median(build for build, _ in samples),
        statistics.median(release for _, release in samples),
    )


def run_decode_token(
    call: DualHeadNormCall, inputs: ScenarioInputs, layers: int
) -> tuple[int, int]:
    """One decode token: ``layers`` chained dual calls, one eval.
    Returns (build ns, total ns)."""
    queries, keys = inputs.queries, inputs.keys
    query_weight, key_weight = inputs.query_weight, inputs.key_weight
    clock = time.perf_counter_ns
    started = clock()
    for _ in range(layers):
        queries, keys = call(queries, keys, query_weight, key_weight)
    built = clock()
    mx.eval(queries, keys)
    finished = clock()
    return built - started, finished - started


def run_prefill_call(call: DualHeadNormCall, inputs: ScenarioInputs) -> tuple[int, int]:
    """One evaluated dual call. Returns (ns, peak bytes above the memory
    already held when it started)."""
    mx.reset_peak_memory()
    resident_bytes = mx.get_active_memory()
    started = time.perf_counter_ns()
    outputs = call(inputs.queries, inputs.keys, inputs.query_weight, inputs.key_weight)
    mx.eval(outputs)
    finished = time.perf_counter_ns()
    peak_bytes = mx.get_peak_memory()
    del outputs
    return finished - started, max(0, peak_bytes - resident_bytes)


Sample = tuple


def interleaved_samples(
    calls: dict[str, DualHeadNormCall],
    take_sample: Callable[[DualHeadNormCall], Sample],
    samples: int,
    warmup: int,
    per_turn: int = 1,
) -> dict[str, list[Sample]]:
    """``samples`` samples of every path, taken round-robin in turns of
    ``per_turn`` consecutive samples of one path (the order rotating each
    round and reversing every other cycle), so load that comes and goes on
    the machine falls on all paths alike. ``warmup`` untimed samples of
    each path first."""
    names = list(calls)
    results: dict[str, list[Sample]] = {name: [] for name in names}
    with _GarbageCollectionPaused():
        for name in names:
            for _ in range(warmup):
                take_sample(calls[name])
        for round_index in range(-(-samples // per_turn)):
            for name in _rotated(names, round_index):
                for _ in range(min(per_turn, samples - len(results[name]))):
                    results[name].append(take_sample(calls[name]))
    return results


def _rotated(names: Sequence[str], offset: int) -> list[str]:
    """The order of round ``offset``: rotated by one each round, and run
    backwards every other pair of rounds, so no path always follows the same
    other path (a slow path's leftovers, its freed buffers and cold caches,
    would otherwise fall on the same neighbour every time)."""
    offset_in_cycle = offset % len(names)
    rotated = [*names[offset_in_cycle:], *names[:offset_in_cycle]]
    return rotated[::-1] if (offset // len(names)) % 2 else rotated


# ---- The run ---------------------------------------------------------------------------


def collect_metadata() -> dict:
    cpu_model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    usable_cores: Optional[int]
    try:
        usable_cores = len(os.sched_getaffinity(0))
    except AttributeError:
        usable_cores = os.cpu_count()
    import mlx_dualnorm

    device = mx.default_device()
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": str(device),
        "device_type": "gpu" if device.type == mx.gpu else "cpu",
        "cpu_model": cpu_model,
        "cpu_cores": usable_cores,
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx_version": getattr(mx, "__version__"),  # not in MLX's type stubs
        "mlx_dualnorm_version": mlx_dualnorm.__version__,
        # 1/5/15-minute load averages at the end of the run: other work on
        # the machine shows up here (and in the min-max spread).
        "load_average": _load_average(),
        # Linux pressure stall information: % of time some task waited for
        # a CPU (10 s / 60 s averages), another sign of a busy machine.
        "cpu_pressure_some": _cpu_pressure(),
    }


def _cpu_pressure() -> Optional[dict[str, float]]:
    try:
        with open("/proc/pressure/cpu", encoding="utf-8") as pressure:
            fields = pressure.readline().split()[1:]
    except OSError:
        return None
    averages = dict(field.split("=", 1) for field in fields if "=" in field)
    try:
        return {key: float(averages[key]) for key in ("avg10", "avg60")}
    except (KeyError, ValueError):
        return None


def _load_average() -> Optional[list[float]]:
    try:
        return [round(load, 2) for load in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _progress(message: str, progress: Optional[Callable[[str], None]]) -> None:
    if progress is not None:
        progress(message)


def _build_paths(
    names: Sequence[str], eps: float
) -> tuple[dict[str, DualHeadNormCall], dict[str, dict]]:
    calls, status = {}, {}
    for name in names:
        path = PATH_REGISTRY[name]
        entry = {"description": path.description}
        try:
            calls[name] = path.factory(eps)
            entry["status"] = "ok"
        except (PathUnavailable, ImportError) as unavailable:
            entry.update(status="skipped", reason=f"{type(unavailable).__name__}: {unavailable}")
        status[name] = entry
    return calls, status


def _warm_up(
    calls: dict[str, DualHeadNormCall],
    status: dict[str, dict],
    inputs: dict[str, ScenarioInputs],
) -> dict[str, set[str]]:
    """Traces and JIT-compiles every path at every scenario (outside the
    clock). Returns, per path, the scenarios it cannot run."""
    skipped: dict[str, set[str]] = {name: set() for name in calls}
    for name, call in calls.items():
        for scenario_name, scenario_inputs in inputs.items():
            try:
                for _ in range(2):
                    mx.eval(
                        call(
                            scenario_inputs.queries,
                            scenario_inputs.keys,
                            scenario_inputs.query_weight,
                            scenario_inputs.key_weight,
                        )
                    )
            except PathUnavailable as unavailable:
                skipped[name].add(scenario_name)
                status[name].setdefault("skipped_scenarios", {})[scenario_name] = str(unavailable)
    return skipped


class _Measurement:
    """The state of one run between its steps: the paths built, their
    inputs, the scenarios each cannot run, and the samples so far."""

    def __init__(self, config: BenchmarkConfig, progress: Optional[Callable[[str], None]]):
        self.config = config
        path_names = config.selected_paths()
        self.calls, self.path_status = _build_paths(path_names, config.eps)
        if BASELINE_PATH not in self.calls:
            raise RuntimeError(f"the baseline path {BASELINE_PATH!r} did not build")
        self.running_paths = [name for name in path_names if name in self.calls]
        self.inputs = {
            scenario.name: make_inputs(scenario, config.seed + index)
            for index, scenario in enumerate((*DECODE_SCENARIOS, GATED_DELTA_PREFILL))
        }
        _progress(f"warming up {len(self.running_paths)} paths (tracing, kernel JIT)", progress)
        self.unavailable = _warm_up(self.calls, self.path_status, self.inputs)
        self.metrics: dict[str, MetricResult] = {}

    def record(self, kind: MetricKind, scenario: Scenario, path: str, value: float) -> None:
        key = metric_key(kind, scenario)
        metric = self.metrics.setdefault(key, MetricResult(key, kind, scenario))
        metric.samples.setdefault(path, []).append(value)

    def paths_for(self, scenario: Scenario, repeat: int) -> dict[str, DualHeadNormCall]:
        """The paths that run at ``scenario``, the first one rotating per repeat."""
        return {
            name: self.calls[name]
            for name in _rotated(self.running_paths, repeat)
            if scenario.name not in self.unavailable[name]
        }

    def host_loop_overhead_us(self) -> float:
        """What the timing loop costs with a call that does nothing."""
        return time_graph_builds(
            lambda queries, keys, query_weight, key_weight: None,
            self.inputs[GATED_DELTA_DECODE.name],
            self.config.host_batches,
            self.config.host_calls_per_batch,
        )[0]

    def measure_host_calls(self, repeat: int) -> None:
        for scenario in DECODE_SCENARIOS:
            scenario_inputs = self.inputs[scenario.name]
            batches = interleaved_samples(
                self.paths_for(scenario, repeat),
                lambda call: build_batch(call, scenario_inputs, self.config.host_calls_per_batch),
                self.config.host_batches,
                warmup=1,
            )
            for name, samples in batches.items():
                self.record(HOST_CALL, scenario, name, statistics.median(b for b, _ in samples))
                self.record(HOST_RELEASE, scenario, name, statistics.median(r for _, r in samples))

    def measure_decode_tokens(self, repeat: int) -> None:
        for scenario in DECODE_SCENARIOS:
            scenario_inputs = self.inputs[scenario.name]
            tokens = interleaved_samples(
                self.paths_for(scenario, repeat),
                lambda call: run_decode_token(call, scenario_inputs, self.config.layers),
                self.config.decode_tokens,
                warmup=self.config.decode_warmup_tokens,
                per_turn=self.config.decode_tokens_per_turn,
            )
            for name, samples in tokens.items():
                total_us = statistics.median(total for _, total in samples) / 1e3
                build_us = statistics.median(build for build, _ in samples) / 1e3
                self.record(DECODE_TOKEN, scenario, name, total_us)
                self.record(DECODE_BUILD, scenario, name, build_us)

    def measure_prefill(self, repeat: int) -> None:
        # Same buffer cache for every path: emptied once, then one warm-up
        # call each refills it.
        mx.clear_cache()
        prefill_inputs = self.inputs[GATED_DELTA_PREFILL.name]
        prefill_calls = interleaved_samples(
            self.paths_for(GATED_DELTA_PREFILL, repeat),
            lambda call: run_prefill_call(call, prefill_inputs),
            self.config.prefill_iterations,
            warmup=1,
        )
        for name, samples in prefill_calls.items():
            elapsed_us = statistics.median(elapsed for elapsed, _ in samples) / 1e3
            self.record(PREFILL_CALL, GATED_DELTA_PREFILL, name, elapsed_us)
            self.record(PREFILL_PEAK, GATED_DELTA_PREFILL, name, float(max(p for _, p in samples)))

    def close_paths(self) -> None:
        for call in self.calls.values():
            close = getattr(call, "close", None)
            if callable(close):
                close()


def run_benchmark(
    config: Optional[BenchmarkConfig] = None,
    *,
    progress: Optional[Callable[[str], None]] = None,
) -> BenchmarkReport:
    """Runs every measurement on the default device; see the module doc.

    ``progress``, if given, receives one line per stage and per repeat,
    with the time left (the CLI sends them to stderr). Ctrl-C raises
    :class:`~mlx_dualnorm.tools.command.InterruptedWithPartialResult` carrying
    the report of the repeats that completed."""
    config = config or BenchmarkConfig()
    if config.repeats < 1 or config.layers < 1:
        raise ValueError("repeats and layers must be >= 1")
    run_started = time.perf_counter()
    load_average_at_start = _load_average()
    cpu_pressure_at_start = _cpu_pressure()
    measurement = _Measurement(config, progress)
    host_loop_us = measurement.host_loop_overhead_us()
    repeats_progress = command.StepProgress(
        "repeats", config.repeats, emit=progress or (lambda line: None)
    )
    completed_repeats = 0

    def report() -> BenchmarkReport:
        metadata = collect_metadata()
        metadata["load_average_at_start"] = load_average_at_start
        metadata["cpu_pressure_some_at_start"] = cpu_pressure_at_start
        metadata["host_loop_overhead_us"] = host_loop_us
        for metric in measurement.metrics.values():  # a cut-short repeat is left out
            for samples in metric.samples.values():
                del samples[completed_repeats:]
        return BenchmarkReport(
            config=dataclasses.replace(config, repeats=completed_repeats),
            metadata=metadata,
            path_status=measurement.path_status,
            metrics=measurement.metrics,
            elapsed_s=time.perf_counter() - run_started,
            interrupted=completed_repeats < config.repeats,
        )

    try:
        for repeat in range(config.repeats):
            measurement.measure_host_calls(repeat)
            measurement.measure_decode_tokens(repeat)
            measurement.measure_prefill(repeat)
            completed_repeats += 1
            repeats_progress.step()
    except KeyboardInterrupt:
        raise command.InterruptedWithPartialResult(report()) from None
    finally:
        measurement.close_paths()
    return report()


# ---- Output: JSON, chart, tables ------------------------------------------------------


def write_json(report: BenchmarkReport, output_dir: os.PathLike | str) -> pathlib.Path:
    directory = pathlib.Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    destination = directory / JSON_FILE_NAME
    destination.write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
    return destination


def _headline_metrics(report: BenchmarkReport) -> list[MetricResult]:
    return [metric for metric in report.metrics.values() if metric.kind.headline]


BASELINE_COLOR = "tab:gray"
PATH_COLOR = "tab:blue"


def write_chart(report: BenchmarkReport, output_dir: os.PathLike | str) -> Optional[pathlib.Path]:
    """A bar chart per headline metric: the median, min-max whiskers, the
    ratio of medians to the baseline under each path's name; a legend for
    every colour and the whiskers, "lower is better", and a QUICK RUN mark
    on a --quick run. None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:
        return None
    metrics = _headline_metrics(report)
    columns = 3
    rows = -(-len(metrics) // columns)
    figure, axes_grid = pyplot.subplots(rows, columns, figsize=(5 * columns, 4 * rows), squeeze=False)
    for axes, metric in zip(axes_grid.flat, metrics):
        paths = list(metric.samples)
        scale, unit = (2**20, "MiB") if metric.kind.unit == "bytes" else (1, metric.kind.unit)
        summaries = [spread(metric.samples[path]) for path in paths]
        medians = [summary["median"] / scale for summary in summaries]
        whiskers = [
            [(summary["median"] - summary["min"]) / scale for summary in summaries],
            [(summary["max"] - summary["median"]) / scale for summary in summaries],
        ]
        labels = []
        for path in paths:
            ratio = metric.ratio_of_medians(path)
            labels.append(path if ratio is None else f"{path}\n{ratio:.2f}x")
        colors = [BASELINE_COLOR if path == BASELINE_PATH else PATH_COLOR for path in paths]
        axes.bar(labels, medians, yerr=whiskers, capsize=3, color=colors)
        axes.set_title(f"{metric.kind.title}\n{metric.scenario.name}", fontsize=9)
        axes.set_ylabel(f"{unit} (lower is better)")
        axes.tick_params(axis="x", labelsize=7)
    for axes in list(axes_grid.flat)[len(metrics):]:
        axes.set_visible(False)
    metadata = report.metadata
    quick_mark = "QUICK RUN (few samples, a smoke test): " if report.config.quick_mode else ""
    figure.suptitle(
        f"{quick_mark}mlx_dualnorm benchmark, {metadata['device']} ({metadata['cpu_model']}, "
        f"{metadata['cpu_cores']} cores), MLX {metadata['mlx_version']}, "
        f"{report.config.repeats} repeats; lower is better",
        fontsize=10,
        color="tab:red" if report.config.quick_mode else "black",
    )
    figure.legend(
        handles=[
            Patch(color=BASELINE_COLOR, label=f"{BASELINE_PATH}: the reference (ratio 1.00x)"),
            Patch(color=PATH_COLOR, label="another path; under its name: its median / "
                  f"{BASELINE_PATH}'s median"),
            Line2D([], [], color="black", marker="_", linestyle="-",
                   label="bar: median over repeats; whisker: min-max over repeats"),
        ],
        loc="lower center",
        ncol=3,
        fontsize=8,
    )
    figure.tight_layout(rect=(0, 0.06, 1, 1))  # room for the legend below the charts
    directory = pathlib.Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    destination = directory / CHART_FILE_NAME
    figure.savefig(destination, dpi=110)
    pyplot.close(figure)
    return destination


def _format_value(value: float, unit: str) -> str:
    if unit == "bytes":
        return f"{value / 2**20:.2f} MiB"
    return f"{value:.1f}" if value >= 100 else f"{value:.2f}"


def _format_table(rows: list[list[str]]) -> str:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = []
    for index, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [
            cell.rjust(width) for cell, width in zip(row[1:], widths[1:])
        ]
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _ratio_note() -> str:
    return (
        f"ratio = this path's median time (or memory) / {BASELINE_PATH}'s median; "
        "lower is better, below 1.00x the path beats the composed path"
    )


def _paths_legend(report: BenchmarkReport, paths: Sequence[str]) -> list[str]:
    return ["paths:", *(f"  {line}" for line in describe_paths(list(paths)))]


def _run_heading(report: BenchmarkReport) -> str:
    metadata, config = report.metadata, report.config
    heading = (
        f"mlx_dualnorm benchmark: {metadata['device']}, {metadata['cpu_model']} "
        f"({metadata['cpu_cores']} cores), MLX {metadata['mlx_version']}, "
        f"{config.repeats} repeats{' (quick)' if config.quick_mode else ''}, "
        f"{config.layers} layers/token"
    )
    if report.interrupted:
        heading += f"; INTERRUPTED: only the {config.repeats} repeats that completed"
    return heading


def _metric_cell(
    metric: Optional[MetricResult], path: str, unit: str, with_range: bool
) -> str:
    """The median over repeats, and for a path other than the baseline the
    ratio of its median to the baseline's median (the two numbers shown),
    with the min-max of the per-repeat ratios as its spread."""
    values = None if metric is None else metric.samples.get(path)
    if metric is None or not values:
        return "-"
    cell = _format_value(statistics.median(values), unit)
    ratio = metric.ratio_of_medians(path)
    ratios = metric.ratio_samples(path)
    if ratio is not None and path != BASELINE_PATH:
        cell += f" ({ratio:.2f}x"
        cell += f" [{min(ratios):.2f}-{max(ratios):.2f}])" if with_range and ratios else ")"
    return cell


def format_report_table(report: BenchmarkReport, *, all_metrics: bool = False) -> str:
    """The full text table: per metric and path, the median over repeats and
    the ratio to the baseline (median [min-max] over repeats), then what
    each path is."""
    paths = [name for name in report.path_status if report.ran(name)]
    rows = [["metric / scenario", *paths]]
    for metric in report.metrics.values():
        if all_metrics or metric.kind.headline:
            cells = [_metric_cell(metric, path, metric.kind.unit, True) for path in paths]
            rows.append([f"{metric.kind.name} {metric.scenario.name}", *cells])
    lines = [
        _run_heading(report),
        f"median over repeats (ratio to {BASELINE_PATH} [min-max of the per-repeat ratios]); "
        f"{_ratio_note()}",
        _format_table(rows),
        "metrics:",
        *(
            f"  {metric.kind.name} {metric.scenario.name}: {metric.kind.title}, "
            f"{metric.scenario.description}"
            for metric in report.metrics.values()
            if all_metrics or metric.kind.headline
        ),
        *_paths_legend(report, paths),
    ]
    skipped = [
        f"  {name}: {entry.get('reason', '')}"
        for name, entry in report.path_status.items()
        if entry.get("status") != "ok"
    ]
    if skipped:
        lines += ["skipped paths:", *skipped]
    return "\n".join(lines)


SUMMARY_COLUMNS = (
    (HOST_CALL, GATED_DELTA_DECODE, "host us/call",
     "host us to build one dual call's graph (no evaluation), gated-delta decode shape"),
    (DECODE_TOKEN, GATED_DELTA_DECODE, "us/token gated-delta",
     "us per decode token of {layers} chained dual calls and one eval: " + GATED_DELTA_DECODE.description),
    (DECODE_TOKEN, FULL_ATTENTION_DECODE, "us/token full-attn",
     "the same at the " + FULL_ATTENTION_DECODE.description),
)
"""(kind, scenario, column title, what the column means) of the summary."""


def summary_table(report: Optional[BenchmarkReport] = None, *, eps: float = 1e-6) -> str:
    """A short per-path table (host us/call and us/token at both decode
    shapes, with ratios to the baseline), then what each column and path
    means. Without a report, runs the quick benchmark first (a few
    seconds): what ``python -m mlx_dualnorm`` prints after its parity check."""
    if report is None:
        report = run_benchmark(BenchmarkConfig.quick(eps=eps))
    rows = [["path", *(title for _, _, title, _ in SUMMARY_COLUMNS)]]
    paths = [path for path in report.path_status if report.ran(path)]
    for path in paths:
        cells = [
            _metric_cell(report.metrics.get(metric_key(kind, scenario)), path, kind.unit, False)
            for kind, scenario, _, _ in SUMMARY_COLUMNS
        ]
        rows.append([path, *cells])
    metadata = report.metadata
    heading = (
        f"performance on {metadata['device']} (MLX {metadata['mlx_version']}, "
        f"{'quick' if report.config.quick_mode else 'full'} run, median of "
        f"{report.config.repeats} repeats), time per path and its ratio to {BASELINE_PATH}:"
    )
    legend = [
        "columns (lower is better):",
        *(
            f"  {title}: {meaning.format(layers=report.config.layers)}"
            for _, _, title, meaning in SUMMARY_COLUMNS
        ),
        f"  (N.NNx): {_ratio_note()}",
    ]
    return "\n".join([heading, _format_table(rows), *legend, *_paths_legend(report, paths)])


# ---- Command line -----------------------------------------------------------------------


def progress_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _benchmark_parser() -> argparse.ArgumentParser:
    parser = command.tool_parser(
        "bench",
        "Time every path against the composed path (two mx.fast.rms_norm calls): host us "
        "per call, us per decode token, prefill time and peak memory. Every ratio is "
        "time(path) / time(composed): lower is better.",
    )
    parser.add_argument("--output-dir", type=pathlib.Path, default=None,
                        help=f"write {JSON_FILE_NAME} and {CHART_FILE_NAME} into this folder")
    parser.add_argument("--quick", action="store_true",
                        help="a few-second smoke run (fewer repeats and samples)")
    parser.add_argument("--repeats", type=command.positive_int, default=None,
                        help="repeats (default: 11, or 3 with --quick)")
    parser.add_argument("--layers", type=command.positive_int, default=48,
                        help="chained dual calls per decode token")
    parser.add_argument("--paths", default=None,
                        help=f"comma-separated paths (default: all of {', '.join(PATH_REGISTRY)}); "
                             f"{BASELINE_PATH} is always added")
    parser.add_argument("--eps", type=command.non_negative_float, default=1e-6, help="RMS epsilon")
    command.add_device_argument(parser)
    parser.add_argument("--no-plot", action="store_true",
                        help="with --output-dir, skip the PNG chart")
    parser.add_argument("--all-metrics", action="store_true",
                        help="also print the secondary metrics (release time, build part)")
    return parser


def _config_from_arguments(
    arguments: argparse.Namespace, parser: argparse.ArgumentParser
) -> BenchmarkConfig:
    overrides: dict[str, Any] = {"eps": arguments.eps, "layers": arguments.layers}
    if arguments.repeats is not None:
        overrides["repeats"] = arguments.repeats
    if arguments.paths:
        overrides["paths"] = tuple(name.strip() for name in arguments.paths.split(",") if name.strip())
    config = BenchmarkConfig.quick(**overrides) if arguments.quick else BenchmarkConfig(**overrides)
    try:
        config.selected_paths()
    except ValueError as bad_paths:
        parser.error(str(bad_paths))
    return config


def _write_files(report: BenchmarkReport, output_dir: pathlib.Path, plot: bool) -> None:
    progress_to_stderr(f"wrote {write_json(report, output_dir)}")
    if not plot:
        return
    chart = write_chart(report, output_dir)
    if chart is None:
        progress_to_stderr("matplotlib is not installed: no PNG chart "
                           "(pip install 'mlx_dualnorm[plot]')")
    else:
        progress_to_stderr(f"wrote {chart}")


def _run(arguments: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    command.select_device(arguments.device, parser)
    config = _config_from_arguments(arguments, parser)
    try:
        report = run_benchmark(config, progress=progress_to_stderr)
    except command.InterruptedWithPartialResult as interrupted:
        partial = interrupted.partial
        if isinstance(partial, BenchmarkReport) and partial.config.repeats:
            print(format_report_table(partial, all_metrics=arguments.all_metrics))
        raise
    if arguments.output_dir is not None:
        _write_files(report, arguments.output_dir, plot=not arguments.no_plot)
    progress_to_stderr(f"benchmark took {report.elapsed_s:.1f} s")
    print(format_report_table(report, all_metrics=arguments.all_metrics))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m mlx_dualnorm bench``: prints the table; 2 on bad usage."""
    return command.run_tool(_benchmark_parser(), _run, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
