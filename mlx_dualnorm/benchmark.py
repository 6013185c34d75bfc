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
samples; inside a repeat the paths take their samples in turn (one batch,
token or call each, the order rotating), so load that comes and goes on the
machine falls on all of them alike. The ratio to the baseline path
(``composed``) is computed per repeat, and values and ratios are reported
as min / median / max over the repeats.

Paths live in a registry, ``name -> factory(eps) -> callable(q, k, wq, wk)``;
adding one (a fused mode, an mlx-lm comparison) is one ``register_path``
call. A factory, or a call, that raises :class:`PathUnavailable` marks the
path (or that path at that shape) as skipped instead of failing the run.

``main(argv)`` is the command line (``python -m mlx_dualnorm bench``);
``run_benchmark(config)`` the programmatic API; ``summary_table`` the short
table the package's main job prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
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

from mlx_dualnorm.dual_head_norm import (
    CompiledDualHeadNorm,
    Mode,
    available_modes,
    composed_dual_head_norm,
)

__all__ = [
    "BenchmarkConfig",
    "BenchmarkReport",
    "PATH_REGISTRY",
    "PathUnavailable",
    "Scenario",
    "Target",
    "format_report_table",
    "main",
    "package_mode_factory",
    "register_path",
    "run_benchmark",
    "summary_table",
    "write_chart",
    "write_json",
]

REPORT_SCHEMA = "mlx_dualnorm.benchmark/1"
JSON_FILE_NAME = "benchmark.json"
CHART_FILE_NAME = "benchmark.png"
BASELINE_PATH = "composed"
COMPILED_PATH = "compiled"
FUSED_PATH = "fused"
PYTHON_COMPILE_PATH = "mx_compile"

DualHeadNormCall = Callable[
    [mx.array, mx.array, Optional[mx.array], Optional[mx.array]],
    "tuple[mx.array, mx.array]",
]
PathFactory = Callable[[float], DualHeadNormCall]
# Host timing only keeps a call's outputs, so it also takes calls that return
# something else (the empty-loop baseline returns None).
TimedCall = Callable[[mx.array, mx.array, Optional[mx.array], Optional[mx.array]], object]


# ---- The path registry -----------------------------------------------------


class PathUnavailable(RuntimeError):
    """Raised by a path factory (or by a path's call, for one shape) when the
    path cannot run here: its package is missing, its mode is not built, it
    takes no weights. The benchmark records the reason and skips it."""


@dataclasses.dataclass(frozen=True)
class BenchmarkPath:
    """One way of computing ``(rms_norm(q, wq, eps), rms_norm(k, wk, eps))``."""

    name: str
    factory: PathFactory
    description: str


PATH_REGISTRY: dict[str, BenchmarkPath] = {}


def register_path(name: str, factory: PathFactory, description: str = "") -> None:
    """Adds (or replaces) a benchmarked path.

    ``factory(eps)`` returns a callable taking ``(queries, keys,
    query_weight, key_weight)`` positionally (weights may be None) and
    returning the two normalized arrays, lazily. If the callable has a
    ``close()`` method, the benchmark calls it when done. For example::

        register_path("fused", lambda eps: CompiledDualHeadNorm(eps, mode="fused"))
    """
    PATH_REGISTRY[name] = BenchmarkPath(name, factory, description)


def _two_rms_norms(eps: float) -> DualHeadNormCall:
    def two_rms_norms(queries, keys, query_weight, key_weight):
        return (
            mx.fast.rms_norm(queries, query_weight, eps),
            mx.fast.rms_norm(keys, key_weight, eps),
        )

    return two_rms_norms


register_path(
    BASELINE_PATH,
    lambda eps: functools.partial(composed_dual_head_norm, eps=eps),
    "two mx.fast.rms_norm calls (mlx_dualnorm.composed_dual_head_norm)",
)
register_path(
    PYTHON_COMPILE_PATH,
    lambda eps: mx.compile(_two_rms_norms(eps), shapeless=True),
    "Python mx.compile(shapeless=True) of the same two calls",
)
register_path(
    "mx_compile_shaped",
    lambda eps: mx.compile(_two_rms_norms(eps)),
    "Python mx.compile (shape-specialized) of the same two calls",
)


def package_mode_factory(mode: Mode) -> PathFactory:
    """``CompiledDualHeadNorm(eps, mode=mode)``, or PathUnavailable where
    this build or device lacks the mode."""

    def factory(eps: float) -> DualHeadNormCall:
        if mode not in available_modes():
            raise PathUnavailable(
                f"mode {mode!r} is not available here (available: {', '.join(available_modes())})"
            )
        return CompiledDualHeadNorm(eps, mode=mode)

    return factory


register_path(
    COMPILED_PATH,
    package_mode_factory("compiled"),
    "mlx_dualnorm.CompiledDualHeadNorm(mode='compiled'): shapeless C-compiled graph",
)
register_path(
    FUSED_PATH,
    package_mode_factory("fused"),
    "mlx_dualnorm.CompiledDualHeadNorm(mode='fused'): one kernel for both inputs (CUDA)",
)


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
class Target:
    """An issue's bound on ``path``'s metric, judged on the device type the
    issue stated it for: at most ``max_ratio`` times ``reference``'s value
    (the median over repeats of the per-repeat ratio), or, where
    ``max_value`` is set instead, at most that many of the metric's unit
    (the median over repeats)."""

    issue: int
    device_type: str  # "cpu" or "gpu": where the bound applies
    metric: str
    path: str
    reference: str = BASELINE_PATH
    max_ratio: Optional[float] = None
    max_value: Optional[float] = None

    def __post_init__(self) -> None:
        if (self.max_ratio is None) == (self.max_value is None):
            raise ValueError(f"a target sets exactly one of max_ratio and max_value: {self}")

    @property
    def absolute(self) -> bool:
        """Whether the bound is on the value itself, not on the ratio."""
        return self.max_value is not None

    @property
    def bound(self) -> float:
        bound = self.max_value if self.absolute else self.max_ratio
        assert bound is not None  # __post_init__ sets exactly one
        return bound

    @property
    def name(self) -> str:
        if self.absolute:
            return f"{self.metric}: {self.path} <= {self.bound:g} (absolute)"
        return f"{self.metric}: {self.path} <= {self.bound:g}x {self.reference}"


# The targets of the issues, per device type. Issue 4 ("Performance") bounds
# the compiled path on both; issue 5 (the fused mode) the fused path on
# the GPU at the gated-delta decode shape.
ISSUE_TARGETS = (
    *(
        Target(4, "cpu", metric_key(DECODE_TOKEN, scenario), COMPILED_PATH, max_ratio=0.3)
        for scenario in DECODE_SCENARIOS
    ),
    *(
        Target(4, "cpu", metric_key(DECODE_TOKEN, scenario), COMPILED_PATH,
               PYTHON_COMPILE_PATH, max_ratio=1.0)
        for scenario in DECODE_SCENARIOS
    ),
    *(
        Target(4, "cpu", metric_key(HOST_CALL, scenario), COMPILED_PATH, max_ratio=1.0)
        for scenario in DECODE_SCENARIOS
    ),
    *(
        Target(4, "gpu", metric_key(DECODE_TOKEN, scenario), COMPILED_PATH, max_ratio=1.0)
        for scenario in DECODE_SCENARIOS
    ),
    *(
        Target(4, "gpu", metric_key(HOST_CALL, scenario), COMPILED_PATH, max_value=0.6)
        for scenario in DECODE_SCENARIOS
    ),
    *(
        Target(4, device_type, metric_key(PREFILL_PEAK, GATED_DELTA_PREFILL), COMPILED_PATH,
               max_ratio=1.0)
        for device_type in ("cpu", "gpu")
    ),
    Target(5, "gpu", metric_key(DECODE_TOKEN, GATED_DELTA_DECODE), FUSED_PATH, max_ratio=0.5),
    Target(5, "gpu", metric_key(HOST_CALL, GATED_DELTA_DECODE), FUSED_PATH, max_value=1.0),
)


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

    def to_json(self) -> dict:
        paths = {}
        for path, values in self.samples.items():
            entry = {"samples": values, **spread(values)}
            ratios = self.ratio_samples(path)
            if ratios is not None:
                entry["ratio_to_baseline"] = {"samples": ratios, **spread(ratios)}
            paths[path] = entry
        return {
            "kind": self.kind.name,
            "scenario": self.scenario.name,
            "title": self.kind.title,
            "unit": self.kind.unit,
            "baseline": BASELINE_PATH,
            "paths": paths,
        }


@dataclasses.dataclass(frozen=True)
class TargetResult:
    target: Target
    # min / median / max over repeats of the ratio to the reference, and of
    # the value itself; None where the path did not run.
    ratio: Optional[dict[str, float]]
    value: Optional[dict[str, float]]

    @property
    def judged(self) -> Optional[dict[str, float]]:
        """The spread the bound applies to: the value's for an absolute
        bound, the ratio's otherwise (None where the path did not run)."""
        return self.value if self.target.absolute else self.ratio

    @property
    def met(self) -> Optional[bool]:
        judged = self.judged
        return None if judged is None else judged["median"] <= self.target.bound

    def to_json(self) -> dict:
        return {
            "name": self.target.name,
            "issue": self.target.issue,
            "device_type": self.target.device_type,
            "metric": self.target.metric,
            "path": self.target.path,
            "reference": self.target.reference,
            "max_ratio": self.target.max_ratio,
            "max_value": self.target.max_value,
            "ratio": self.ratio,
            "value": self.value,
            "met": self.met,
        }


@dataclasses.dataclass
class BenchmarkReport:
    """Everything one run measured; ``to_json()`` is the file's content."""

    config: BenchmarkConfig
    metadata: dict
    path_status: dict[str, dict]
    metrics: dict[str, MetricResult]
    targets: list[TargetResult]
    elapsed_s: float = 0.0

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
            "paths": self.path_status,
            "scenarios": {
                scenario.name: dataclasses.asdict(scenario)
                for scenario in (*DECODE_SCENARIOS, GATED_DELTA_PREFILL)
            },
            "metrics": {key: metric.to_json() for key, metric in self.metrics.items()},
            "targets": [target.to_json() for target in self.targets],
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
) -> dict[str, list[Sample]]:
    """``samples`` samples of every path, taken round-robin (one sample of
    each path in turn, the order rotating each round), so load that comes
    and goes on the machine falls on all paths alike. ``warmup`` untimed
    samples of each path first."""
    names = list(calls)
    results: dict[str, list[Sample]] = {name: [] for name in names}
    with _GarbageCollectionPaused():
        for name in names:
            for _ in range(warmup):
                take_sample(calls[name])
        for round_index in range(samples):
            for name in _rotated(names, round_index):
                results[name].append(take_sample(calls[name]))
    return results


def _rotated(names: Sequence[str], offset: int) -> list[str]:
    offset %= len(names)
    return [*names[offset:], *names[:offset]]


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


def run_benchmark(
    config: Optional[BenchmarkConfig] = None,
    *,
    targets: Sequence[Target] = ISSUE_TARGETS,
    progress: Optional[Callable[[str], None]] = None,
) -> BenchmarkReport:
    """Runs every measurement on the default device; see the module doc.

    ``progress``, if given, receives one line per stage (the CLI sends them
    to stderr)."""
    config = config or BenchmarkConfig()
    if config.repeats < 1 or config.layers < 1:
        raise ValueError("repeats and layers must be >= 1")
    run_started = time.perf_counter()
    load_average_at_start = _load_average()
    cpu_pressure_at_start = _cpu_pressure()
    path_names = config.selected_paths()
    calls, path_status = _build_paths(path_names, config.eps)
    if BASELINE_PATH not in calls:
        raise RuntimeError(f"the baseline path {BASELINE_PATH!r} did not build")
    running_paths = [name for name in path_names if name in calls]
    scenarios = (*DECODE_SCENARIOS, GATED_DELTA_PREFILL)
    inputs = {
        scenario.name: make_inputs(scenario, config.seed + index)
        for index, scenario in enumerate(scenarios)
    }
    _progress(f"warming up {len(running_paths)} paths (tracing, kernel JIT)", progress)
    unavailable = _warm_up(calls, path_status, inputs)

    metrics: dict[str, MetricResult] = {}

    def record(kind: MetricKind, scenario: Scenario, path: str, value: float) -> None:
        key = metric_key(kind, scenario)
        metric = metrics.setdefault(key, MetricResult(key, kind, scenario))
        metric.samples.setdefault(path, []).append(value)

    def paths_for(scenario: Scenario, repeat: int) -> dict[str, DualHeadNormCall]:
        """The paths that run at ``scenario``, first one rotating per repeat."""
        return {
            name: calls[name]
            for name in _rotated(running_paths, repeat)
            if scenario.name not in unavailable[name]
        }

    host_loop_us = time_graph_builds(
        lambda queries, keys, query_weight, key_weight: None,
        inputs[GATED_DELTA_DECODE.name],
        config.host_batches,
        config.host_calls_per_batch,
    )[0]

    for repeat in range(config.repeats):
        _progress(f"repeat {repeat + 1}/{config.repeats}", progress)
        for scenario in DECODE_SCENARIOS:
            scenario_inputs = inputs[scenario.name]
            batches = interleaved_samples(
                paths_for(scenario, repeat),
                lambda call: build_batch(call, scenario_inputs, config.host_calls_per_batch),
                config.host_batches,
                warmup=1,
            )
            for name, samples in batches.items():
                record(HOST_CALL, scenario, name, statistics.median(b for b, _ in samples))
                record(HOST_RELEASE, scenario, name, statistics.median(r for _, r in samples))
        for scenario in DECODE_SCENARIOS:
            scenario_inputs = inputs[scenario.name]
            tokens = interleaved_samples(
                paths_for(scenario, repeat),
                lambda call: run_decode_token(call, scenario_inputs, config.layers),
                config.decode_tokens,
                warmup=config.decode_warmup_tokens,
            )
            for name, samples in tokens.items():
                record(DECODE_TOKEN, scenario, name, statistics.median(t for _, t in samples) / 1e3)
                record(DECODE_BUILD, scenario, name, statistics.median(b for b, _ in samples) / 1e3)
        # Same buffer cache for every path: emptied once, then one warm-up
        # call each refills it.
        mx.clear_cache()
        prefill_inputs = inputs[GATED_DELTA_PREFILL.name]
        prefill_calls = interleaved_samples(
            paths_for(GATED_DELTA_PREFILL, repeat),
            lambda call: run_prefill_call(call, prefill_inputs),
            config.prefill_iterations,
            warmup=1,
        )
        for name, samples in prefill_calls.items():
            record(PREFILL_CALL, GATED_DELTA_PREFILL, name,
                   statistics.median(elapsed for elapsed, _ in samples) / 1e3)
            record(PREFILL_PEAK, GATED_DELTA_PREFILL, name, float(max(peak for _, peak in samples)))

    for name, call in calls.items():
        close = getattr(call, "close", None)
        if callable(close):
            close()

    metadata = collect_metadata()
    target_results = []
    for target in targets:
        if target.device_type != metadata["device_type"]:
            continue  # stated for the other kind of device
        metric = metrics.get(target.metric)
        ratios = None if metric is None else metric.ratio_samples(target.path, target.reference)
        values = None if metric is None else metric.samples.get(target.path)
        target_results.append(
            TargetResult(
                target,
                None if ratios is None else spread(ratios),
                spread(values) if values else None,
            )
        )

    metadata["load_average_at_start"] = load_average_at_start
    metadata["cpu_pressure_some_at_start"] = cpu_pressure_at_start
    metadata["host_loop_overhead_us"] = host_loop_us
    return BenchmarkReport(
        config=config,
        metadata=metadata,
        path_status=path_status,
        metrics=metrics,
        targets=target_results,
        elapsed_s=time.perf_counter() - run_started,
    )


# ---- Output: JSON, chart, tables ------------------------------------------------------


def write_json(report: BenchmarkReport, output_dir: os.PathLike | str) -> pathlib.Path:
    directory = pathlib.Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    destination = directory / JSON_FILE_NAME
    destination.write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
    return destination


def _headline_metrics(report: BenchmarkReport) -> list[MetricResult]:
    return [metric for metric in report.metrics.values() if metric.kind.headline]


def write_chart(report: BenchmarkReport, output_dir: os.PathLike | str) -> Optional[pathlib.Path]:
    """A bar chart (median, min-max whiskers, ratio to the baseline above
    each bar) per headline metric. None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
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
            ratios = metric.ratio_samples(path)
            ratio = "" if ratios is None else f"\n{statistics.median(ratios):.2f}x"
            labels.append(f"{path}{ratio}")
        colors = ["tab:gray" if path == BASELINE_PATH else "tab:blue" for path in paths]
        axes.bar(labels, medians, yerr=whiskers, capsize=3, color=colors)
        axes.set_title(f"{metric.kind.title}\n{metric.scenario.name}", fontsize=9)
        axes.set_ylabel(unit)
        axes.tick_params(axis="x", labelsize=7)
    for axes in list(axes_grid.flat)[len(metrics):]:
        axes.set_visible(False)
    metadata = report.metadata
    figure.suptitle(
        f"mlx_dualnorm benchmark, {metadata['device']} ({metadata['cpu_model']}, "
        f"{metadata['cpu_cores']} cores), MLX {metadata['mlx_version']}, "
        f"{report.config.repeats} repeats",
        fontsize=10,
    )
    figure.tight_layout()
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


def format_report_table(report: BenchmarkReport, *, all_metrics: bool = False) -> str:
    """The full text table: per metric and path, the median over repeats and
    the ratio to the baseline (median [min-max]); then the targets."""
    paths = [name for name in report.path_status if report.ran(name)]
    rows = [["metric / scenario", *paths]]
    for metric in report.metrics.values():
        if not (all_metrics or metric.kind.headline):
            continue
        label = f"{metric.kind.name} {metric.scenario.name}"
        cells = []
        for path in paths:
            values = metric.samples.get(path)
            if not values:
                cells.append("-")
                continue
            cell = _format_value(statistics.median(values), metric.kind.unit)
            ratios = metric.ratio_samples(path)
            if ratios is not None and path != BASELINE_PATH:
                cell += f" ({statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}])"
            cells.append(cell)
        rows.append([label, *cells])
    metadata = report.metadata
    heading = (
        f"mlx_dualnorm benchmark: {metadata['device']}, {metadata['cpu_model']} "
        f"({metadata['cpu_cores']} cores), MLX {metadata['mlx_version']}, "
        f"{report.config.repeats} repeats{' (quick)' if report.config.quick_mode else ''}, "
        f"{report.config.layers} layers/token\n"
        f"median over repeats (ratio to {BASELINE_PATH}: median [min-max])"
    )
    lines = [heading, _format_table(rows)]
    skipped = [
        f"  {name}: {entry.get('reason', '')}"
        for name, entry in report.path_status.items()
        if entry.get("status") != "ok"
    ]
    if skipped:
        lines += ["skipped paths:", *skipped]
    lines.append(f"targets (issues, for the {report.metadata['device_type'].upper()}):")
    for result in report.targets:
        judged = result.judged
        if judged is None or result.met is None:
            verdict, measured = "NOT MEASURED", " a path did not run"
        else:
            verdict = "met" if result.met else "NOT MET"
            unit = "" if result.target.absolute else "x"
            measured = (
                f" measured {judged['median']:.2f}{unit} "
                f"[{judged['min']:.2f}-{judged['max']:.2f}]"
            )
        lines.append(f"  [{verdict}] issue {result.target.issue}, {result.target.name}:{measured}")
    return "\n".join(lines)


def summary_table(report: Optional[BenchmarkReport] = None, *, eps: float = 1e-6) -> str:
    """A short per-path table (host us/call and us/token at both decode
    shapes, with ratios to the baseline). Without a report, runs the quick
    benchmark first (a few seconds): what ``python -m mlx_dualnorm``
    prints after its parity check."""
    if report is None:
        report = run_benchmark(BenchmarkConfig.quick(eps=eps))
    columns = [
        (HOST_CALL, GATED_DELTA_DECODE, "host us/call"),
        (DECODE_TOKEN, GATED_DELTA_DECODE, "us/token gated-delta"),
        (DECODE_TOKEN, FULL_ATTENTION_DECODE, "us/token full-attn"),
    ]
    rows = [["path", *(title for _, _, title in columns)]]
    for path in report.path_status:
        if not report.ran(path):
            continue
        cells = []
        for kind, scenario, _ in columns:
            metric = report.metrics.get(metric_key(kind, scenario))
            values = None if metric is None else metric.samples.get(path)
            if metric is None or not values:
                cells.append("-")
                continue
            cell = _format_value(statistics.median(values), kind.unit)
            ratios = metric.ratio_samples(path)
            if ratios is not None:
                cell += f" ({statistics.median(ratios):.2f}x)"
            cells.append(cell)
        rows.append([path, *cells])
    metadata = report.metadata
    heading = (
        f"performance ({metadata['device']}, MLX {metadata['mlx_version']}, "
        f"{report.config.layers} layers/token, ratios to {BASELINE_PATH}, "
        f"{'quick' if report.config.quick_mode else 'full'} run):"
    )
    return heading + "\n" + _format_table(rows)


# ---- Command line -----------------------------------------------------------------------


def _parse_arguments(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mlx_dualnorm bench",
        description=(
            "Benchmarks the compiled dual head norm against two mx.fast.rms_norm "
            "calls and Python mx.compile: host us per call, us per decode token, "
            "prefill time and peak memory."
        ),
    )
    parser.add_argument("--output-dir", type=pathlib.Path, default=None,
                        help=f"write {JSON_FILE_NAME} and {CHART_FILE_NAME} here")
    parser.add_argument("--quick", action="store_true",
                        help="a few-second smoke run (fewer repeats and samples)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats (default 11, quick 3)")
    parser.add_argument("--layers", type=int, default=48, help="layers per decode token")
    parser.add_argument("--paths", default=None,
                        help=f"comma-separated paths (registered: {', '.join(PATH_REGISTRY)}); "
                             f"{BASELINE_PATH} is always added")
    parser.add_argument("--eps", type=float, default=1e-6, help="RMS epsilon")
    parser.add_argument("--device", choices=("cpu", "gpu"), default=None,
                        help="MLX default device (default: MLX's default)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    parser.add_argument("--all-metrics", action="store_true",
                        help="also print the secondary metrics (release, build part)")
    parser.add_argument("--check-targets", action="store_true",
                        help="exit with status 1 if a measured target is not met")
    return parser.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    try:
        arguments = _parse_arguments(argv)
    except SystemExit as exit_request:
        return exit_request.code if isinstance(exit_request.code, int) else 2
    if arguments.device is not None:
        try:
            mx.set_default_device(mx.gpu if arguments.device == "gpu" else mx.cpu)
        except ValueError as no_device:
            print(f"error: {no_device}", file=sys.stderr)
            return 2
    overrides: dict[str, Any] = {"eps": arguments.eps, "layers": arguments.layers}
    if arguments.repeats is not None:
        overrides["repeats"] = arguments.repeats
    if arguments.paths:
        overrides["paths"] = tuple(name.strip() for name in arguments.paths.split(",") if name.strip())
    config = BenchmarkConfig.quick(**overrides) if arguments.quick else BenchmarkConfig(**overrides)
    try:
        config.selected_paths()
    except ValueError as bad_paths:
        print(f"error: {bad_paths}", file=sys.stderr)
        return 2

    def to_stderr(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    report = run_benchmark(config, progress=to_stderr)
    if arguments.output_dir is not None:
        to_stderr(f"wrote {write_json(report, arguments.output_dir)}")
        if not arguments.no_plot:
            chart = write_chart(report, arguments.output_dir)
            if chart is None:
                to_stderr("matplotlib is not installed: no PNG chart "
                          "(pip install 'mlx_dualnorm[plot]')")
            else:
                to_stderr(f"wrote {chart}")
    to_stderr(f"benchmark took {report.elapsed_s:.1f} s")
    print(format_report_table(report, all_metrics=arguments.all_metrics))
    if arguments.check_targets and any(result.met is False for result in report.targets):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
