"""What the benchmark measures and a run holds: scenarios, kinds of number,
configuration, a value per repeat for every path. A ratio is always
``value(path) / value(composed)``, lower is better."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import platform
from typing import Any, NamedTuple, Optional

import mlx.core as mx

from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.paths import PATH_REGISTRY, REFERENCE_PATH

REPORT_SCHEMA = "mlx_dualnorm.benchmark/2"
BASELINE_PATH = REFERENCE_PATH  # every ratio is to this path's value
RATIO_DEFINITION = (
    f"this path's value / {BASELINE_PATH}'s value: per repeat in samples, and of the "
    "medians in of_medians (what the tables print); lower is better"
)


class Scenario(NamedTuple):
    """Input shapes of one measured situation."""

    name: str
    query_shape: tuple[int, ...]
    key_shape: tuple[int, ...]
    weighted: bool
    description: str
    dtype_name: str = "bfloat16"


def _scenario(layer: str, phase: str, query_shape: tuple[int, ...],
              key_shape: Optional[tuple[int, ...]] = None, weighted: bool = False) -> Scenario:
    """A bf16 scenario named and described from its shapes (so they agree)."""
    key_shape = key_shape or query_shape
    query, key = ("(" + ",".join(map(str, shape)) + ")" for shape in (query_shape, key_shape))
    shapes = f"q, k {query}" if query == key else f"q {query}, k {key}"
    weights = "weighted" if weighted else "no weights"
    return Scenario(f"{phase}_{layer.replace('-', '_')}", query_shape, key_shape, weighted,
                    f"{layer} {phase}: {shapes} bf16, {weights}")


GATED_DELTA_DECODE = _scenario("gated-delta", "decode", (1, 1, 16, 128))
FULL_ATTENTION_DECODE = _scenario("full-attention", "decode", (1, 1, 16, 256), (1, 1, 2, 256), True)
GATED_DELTA_PREFILL = _scenario("gated-delta", "prefill", (1, 512, 16, 128))
DECODE_SCENARIOS = (GATED_DELTA_DECODE, FULL_ATTENTION_DECODE)
SCENARIOS = (*DECODE_SCENARIOS, GATED_DELTA_PREFILL)


class MetricKind(NamedTuple):
    """One kind of number; a metric is a kind at a scenario."""

    name: str
    title: str
    unit: str
    headline: bool  # drawn in the chart and printed in the table

    def key(self, scenario: Scenario) -> str:
        return f"{self.name}/{scenario.name}"


HOST_CALL, HOST_RELEASE, DECODE_TOKEN, DECODE_BUILD, PREFILL_CALL, PREFILL_PEAK = (
    MetricKind("host_us_per_call", "host us per dual call (build, no eval)", "us", True),
    MetricKind("host_release_us_per_call", "host us to release one unevaluated call", "us", False),
    MetricKind("decode_us_per_token", "us per decode token (build + eval)", "us", True),
    MetricKind("decode_build_us_per_token", "us per decode token, graph build part", "us", False),
    MetricKind("prefill_us_per_call", "us per prefill dual call (build + eval)", "us", True),
    MetricKind("prefill_peak_bytes", "prefill peak memory above resident inputs", "bytes", True),
)


@dataclasses.dataclass(frozen=True)
class BenchmarkConfig:
    """How much to measure: the defaults are the full run, ``quick()`` a
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
        return cls(**{
            "repeats": 3, "host_batches": 8, "host_calls_per_batch": 50,
            "decode_warmup_tokens": 1, "decode_tokens": 4, "decode_tokens_per_turn": 2,
            "prefill_iterations": 2, "quick_mode": True, **overrides,
        })

    def selected_paths(self) -> tuple[str, ...]:
        """The paths named (or all), the baseline first if not named."""
        names = tuple(PATH_REGISTRY) if self.paths is None else tuple(self.paths)
        unknown = [name for name in names if name not in PATH_REGISTRY]
        if unknown:
            raise ValueError(f"unknown benchmark path(s) {', '.join(unknown)}; "
                             f"registered: {', '.join(PATH_REGISTRY)}")
        return names if BASELINE_PATH in names else (BASELINE_PATH, *names)


@dataclasses.dataclass
class MetricResult:
    """One metric: a value per repeat for every path that ran."""

    kind: MetricKind
    scenario: Scenario
    samples: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def ratio_samples(self, path: str) -> Optional[list[float]]:
        """Per-repeat ratios to the baseline (None if either did not run or a baseline is 0)."""
        values, references = self.samples.get(path), self.samples.get(BASELINE_PATH)
        if not values or not references or len(values) != len(references) or 0 in references:
            return None
        return [value / reference for value, reference in zip(values, references)]

    def ratio_of_medians(self, path: str) -> Optional[float]:
        """The ratio printed beside the two medians (None if either did not run)."""
        reference = self.samples.get(BASELINE_PATH, [])
        return command.ratio_of_medians(self.samples.get(path, []), reference)

    def to_json(self) -> dict:
        paths = {}
        for path, values in self.samples.items():
            paths[path] = {"samples": values, **command.spread(values)}
            ratios = self.ratio_samples(path)
            if ratios is not None:
                paths[path]["ratio_to_composed"] = {
                    "samples": ratios, **command.spread(ratios),
                    "of_medians": self.ratio_of_medians(path),
                }
        return {
            "kind": self.kind.name, "scenario": self.scenario.name, "title": self.kind.title,
            "unit": self.kind.unit, "reference_path": BASELINE_PATH,
            "ratio_definition": RATIO_DEFINITION, "paths": paths,
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
        return self.metrics[kind.key(scenario)]

    def paths_ran(self) -> list[str]:
        return [path for path, entry in self.path_status.items() if entry.get("status") == "ok"]

    def to_json(self) -> dict:
        return {
            "schema": REPORT_SCHEMA, "metadata": self.metadata,
            "config": dataclasses.asdict(self.config), "elapsed_s": self.elapsed_s,
            "interrupted": self.interrupted, "paths": self.path_status,
            "scenarios": {scenario.name: scenario._asdict() for scenario in SCENARIOS},
            "metrics": {key: metric.to_json() for key, metric in self.metrics.items()},
        }


def collect_metadata() -> dict:
    """Where the run ran, and how busy the machine was at its end."""
    import mlx_dualnorm

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            model_line = next(line for line in cpuinfo if line.startswith("model name"))
        cpu_model = model_line.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        cpu_model = platform.processor() or platform.machine()
    sched_getaffinity = getattr(os, "sched_getaffinity", None)
    device = mx.default_device()
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": str(device),
        "device_type": "gpu" if device.type == mx.gpu else "cpu",
        "cpu_model": cpu_model,
        "cpu_cores": len(sched_getaffinity(0)) if sched_getaffinity else os.cpu_count(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx_version": getattr(mx, "__version__"),  # not in MLX's type stubs
        "mlx_dualnorm_version": mlx_dualnorm.__version__,
        **machine_load(),
    }


def machine_load(suffix: str = "") -> dict[str, Any]:
    """How busy the machine is (other work shows up here, and in the min-max
    spread): the 1/5/15-minute load averages, and the Linux CPU pressure,
    the % of time some task waited for a CPU (10 s / 60 s averages)."""
    load: Optional[list[float]] = None
    pressure: Optional[dict[str, float]] = None
    with contextlib.suppress(AttributeError, OSError):
        load = [round(average, 2) for average in os.getloadavg()]
    with contextlib.suppress(OSError, KeyError, ValueError):
        with open("/proc/pressure/cpu", encoding="utf-8") as stalls:
            fields = stalls.readline().split()[1:]
        averages = dict(field.split("=", 1) for field in fields if "=" in field)
        pressure = {key: float(averages[key]) for key in ("avg10", "avg60")}
    return {f"load_average{suffix}": load, f"cpu_pressure_some{suffix}": pressure}
