"""The benchmark's measurements: deterministic inputs per scenario, the
timing loops (host graph builds, decode tokens, prefill calls), the paths
taking their samples in turn (one batch or call each, decode tokens
``decode_tokens_per_turn`` at a time; the order rotating and reversing),
and the run that records every number once per repeat
(:func:`run_benchmark`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import statistics
import time
from typing import Callable, Iterator, Optional, Sequence

import mlx.core as mx

from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.bench.results import (
    BASELINE_PATH, DECODE_BUILD, DECODE_SCENARIOS, DECODE_TOKEN, GATED_DELTA_DECODE,
    GATED_DELTA_PREFILL, HOST_CALL, HOST_RELEASE, PREFILL_CALL, PREFILL_PEAK,
    BenchmarkConfig, BenchmarkReport, MetricKind, MetricResult, Scenario,
    collect_metadata, cpu_pressure, load_average, metric_key,
)
from mlx_dualnorm.commands.shared.paths import PATH_REGISTRY, DualNormPath, PathUnavailable

__all__ = [
    "ScenarioInputs", "build_batch", "interleaved_samples", "make_inputs", "run_benchmark",
    "run_decode_token", "run_prefill_call", "time_graph_builds",
]

# Host timing only keeps a call's outputs, so it also takes calls that return
# something else (the empty-loop baseline returns None).
TimedCall = Callable[[mx.array, mx.array, Optional[mx.array], Optional[mx.array]], object]


# ---- Inputs and measurement loops ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ScenarioInputs:
    queries: mx.array
    keys: mx.array
    query_weight: Optional[mx.array]
    key_weight: Optional[mx.array]

    @property
    def arguments(self) -> tuple:
        return self.queries, self.keys, self.query_weight, self.key_weight


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


@contextlib.contextmanager
def _garbage_collection_paused() -> Iterator[None]:
    """Keeps the cyclic collector out of timed loops (as timeit does)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
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
    with _garbage_collection_paused():
        samples = [build_batch(call, inputs, calls_per_batch) for _ in range(batches)]
    return (
        statistics.median(build for build, _ in samples),
        statistics.median(release for _, release in samples),
    )


def run_decode_token(
    call: DualNormPath, inputs: ScenarioInputs, layers: int
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


def run_prefill_call(call: DualNormPath, inputs: ScenarioInputs) -> tuple[int, int]:
    """One evaluated dual call. Returns (ns, peak bytes above the memory
    already held when it started)."""
    mx.reset_peak_memory()
    resident_bytes = mx.get_active_memory()
    started = time.perf_counter_ns()
    outputs = call(*inputs.arguments)
    mx.eval(outputs)
    finished = time.perf_counter_ns()
    peak_bytes = mx.get_peak_memory()
    del outputs
    return finished - started, max(0, peak_bytes - resident_bytes)


Sample = tuple


def interleaved_samples(
    calls: dict[str, DualNormPath], take_sample: Callable[[DualNormPath], Sample],
    samples: int, warmup: int, per_turn: int = 1,
) -> dict[str, list[Sample]]:
    """``samples`` samples of every path, taken round-robin in turns of
    ``per_turn`` consecutive samples of one path (the order rotating each
    round and reversing every other cycle), so load that comes and goes on
    the machine falls on all paths alike. ``warmup`` untimed samples of
    each path first."""
    names = list(calls)
    results: dict[str, list[Sample]] = {name: [] for name in names}
    with _garbage_collection_paused():
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


def _progress(message: str, progress: Optional[Callable[[str], None]]) -> None:
    if progress is not None:
        progress(message)


def _build_paths(
    names: Sequence[str], eps: float
) -> tuple[dict[str, DualNormPath], dict[str, dict]]:
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
    calls: dict[str, DualNormPath], status: dict[str, dict], inputs: dict[str, ScenarioInputs]
) -> dict[str, set[str]]:
    """Traces and JIT-compiles every path at every scenario (outside the
    clock). Returns, per path, the scenarios it cannot run."""
    skipped: dict[str, set[str]] = {name: set() for name in calls}
    for name, call in calls.items():
        for scenario_name, scenario_inputs in inputs.items():
            try:
                for _ in range(2):
                    mx.eval(call(*scenario_inputs.arguments))
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

    def paths_for(self, scenario: Scenario, repeat: int) -> dict[str, DualNormPath]:
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

    def _decode_scenario_samples(
        self, repeat: int, measure: Callable[[DualNormPath, ScenarioInputs], Sample], count: int,
        **sampling: int,
    ) -> Iterator[tuple[Scenario, str, list[Sample]]]:
        """``(scenario, path, its samples)`` of ``measure(call, inputs)`` at
        each decode scenario, the paths interleaved (``sampling``: the
        warm-up and turns of :func:`interleaved_samples`); a scenario's
        samples are all taken before the next one's."""
        for scenario in DECODE_SCENARIOS:
            scenario_inputs = self.inputs[scenario.name]
            samples_by_path = interleaved_samples(
                self.paths_for(scenario, repeat), lambda call: measure(call, scenario_inputs),
                count, **sampling,
            )
            for name, samples in samples_by_path.items():
                yield scenario, name, samples

    def measure_host_calls(self, repeat: int) -> None:
        batches = self._decode_scenario_samples(
            repeat, functools.partial(build_batch, calls=self.config.host_calls_per_batch),
            self.config.host_batches, warmup=1,
        )
        for scenario, name, samples in batches:
            self.record(HOST_CALL, scenario, name, statistics.median(b for b, _ in samples))
            self.record(HOST_RELEASE, scenario, name, statistics.median(r for _, r in samples))

    def measure_decode_tokens(self, repeat: int) -> None:
        tokens = self._decode_scenario_samples(
            repeat, functools.partial(run_decode_token, layers=self.config.layers),
            self.config.decode_tokens, warmup=self.config.decode_warmup_tokens,
            per_turn=self.config.decode_tokens_per_turn,
        )
        for scenario, name, samples in tokens:
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
    :class:`~mlx_dualnorm.commands.shared.command.InterruptedWithPartialResult` carrying
    the report of the repeats that completed."""
    config = config or BenchmarkConfig()
    if config.repeats < 1 or config.layers < 1:
        raise ValueError("repeats and layers must be >= 1")
    run_started = time.perf_counter()
    load_average_at_start = load_average()
    cpu_pressure_at_start = cpu_pressure()
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
