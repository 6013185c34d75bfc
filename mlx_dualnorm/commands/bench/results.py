"""What the benchmark measures and what a run holds: the scenarios (input
shapes), the kinds of number, the run's configuration, and the results,
a value per repeat for every path, with their ratios to the composed path.

A ratio is always ``value(path) / value(composed)`` (time, or peak memory):
lower is better, below 1 the path beats the composed path. The ratio a
table prints is the ratio of the two medians it prints beside it; the
ratios taken per repeat give its spread.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
from typing import Any, Optional

import mlx.core as mx

from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.command import spread
from mlx_dualnorm.commands.shared.paths import PATH_REGISTRY, REFERENCE_PATH

__all__ = [
    "BASELINE_PATH", "BenchmarkConfig", "BenchmarkReport", "DECODE_SCENARIOS", "MetricKind",
    "MetricResult", "REPORT_SCHEMA", "Scenario", "collect_metadata", "cpu_pressure",
    "load_average", "metric_key",
]

REPORT_SCHEMA = "mlx_dualnorm.benchmark/2"
BASELINE_PATH = REFERENCE_PATH  # every ratio is to this path's value
RATIO_DEFINITION = (
    f"this path's value / {BASELINE_PATH}'s value: per repeat in samples, and of the "
    "medians in of_medians (what the tables print); lower is better"
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


def _scenario(
    layer: str, phase: str, query_shape: tuple[int, ...], key_shape: tuple[int, ...], weighted: bool
) -> Scenario:
    """A bfloat16 scenario of one kind of layer (``"gated-delta"``,
    ``"full-attention"``) at ``phase``, named and described from its shapes
    so that the description cannot disagree with them."""

    def shape_text(shape: tuple[int, ...]) -> str:
        return "(" + ",".join(str(extent) for extent in shape) + ")"

    shapes = (
        f"q, k {shape_text(query_shape)}"
        if query_shape == key_shape
        else f"q {shape_text(query_shape)}, k {shape_text(key_shape)}"
    )
    return Scenario(
        f"{phase}_{layer.replace('-', '_')}",
        query_shape,
        key_shape,
        weighted=weighted,
        description=f"{layer} {phase}: {shapes} bf16, {'weighted' if weighted else 'no weights'}",
    )


GATED_DELTA_DECODE = _scenario("gated-delta", "decode", (1, 1, 16, 128), (1, 1, 16, 128), False)
FULL_ATTENTION_DECODE = _scenario(
    "full-attention", "decode", (1, 1, 16, 256), (1, 1, 2, 256), True
)
GATED_DELTA_PREFILL = _scenario(
    "gated-delta", "prefill", (1, 512, 16, 128), (1, 512, 16, 128), False
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


# ---- Where it ran ----------------------------------------------------------------


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
        "load_average": load_average(),
        # Linux pressure stall information: % of time some task waited for
        # a CPU (10 s / 60 s averages), another sign of a busy machine.
        "cpu_pressure_some": cpu_pressure(),
    }


def cpu_pressure() -> Optional[dict[str, float]]:
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


def load_average() -> Optional[list[float]]:
    try:
        return [round(load, 2) for load in os.getloadavg()]
    except (AttributeError, OSError):
        return None
