"""The benchmark's inputs, timing loops (host graph builds, decode tokens,
prefill calls), paths sampled in turn, and :func:`run_benchmark`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import statistics
import time
from typing import Callable, Iterable, Iterator, NamedTuple, Optional, Sequence

import mlx.core as mx

from mlx_dualnorm.commands.bench.results import (
    BASELINE_PATH, DECODE_BUILD, DECODE_SCENARIOS, DECODE_TOKEN, GATED_DELTA_DECODE,
    GATED_DELTA_PREFILL, HOST_CALL, HOST_RELEASE, PREFILL_CALL, PREFILL_PEAK, SCENARIOS,
    BenchmarkConfig, BenchmarkReport, MetricKind, MetricResult, Scenario, collect_metadata,
    machine_load,
)
from mlx_dualnorm.commands.shared import command
from mlx_dualnorm.commands.shared.paths import PATH_REGISTRY, DualNormPath, PathUnavailable


class Reading(NamedTuple):
    """Which number of each sample a metric takes, the divisor to its unit, and how
    a path's samples make one value per repeat (a time: their median; a peak: max)."""

    kind: MetricKind
    position: int  # of the number in each sample
    scale: float = 1.0
    summary: Callable[[Iterable[float]], float] = statistics.median


class ScenarioInputs(NamedTuple):
    queries: mx.array
    keys: mx.array
    query_weight: Optional[mx.array]
    key_weight: Optional[mx.array]


def make_inputs(scenario: Scenario, seed: int) -> ScenarioInputs:
    """Evaluated, deterministic inputs; weights near 1 where weighted."""
    dtype = getattr(mx, scenario.dtype_name)
    query_key, key_key, *weight_keys = mx.random.split(mx.random.key(seed), 4)
    shapes = (scenario.query_shape, scenario.key_shape)
    weights: list[Optional[mx.array]] = [None, None]
    if scenario.weighted:
        weights = [
            (1 + 0.1 * mx.random.normal(shape[-1:], key=key)).astype(dtype)
            for shape, key in zip(shapes, weight_keys)
        ]
    inputs = ScenarioInputs(
        mx.random.normal(shapes[0], key=query_key).astype(dtype),
        mx.random.normal(shapes[1], key=key_key).astype(dtype),
        *weights,
    )
    mx.eval([array for array in inputs if array is not None])
    return inputs


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
    call: Callable[..., object], inputs: ScenarioInputs, calls: int
) -> tuple[float, float]:
    """One host sample: (us per call to build, us per call to release). The
    outputs live until the clock stops, so the build time holds no teardown."""
    queries, keys, query_weight, key_weight = inputs
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
    call: Callable[..., object], inputs: ScenarioInputs, batches: int, calls_per_batch: int
) -> tuple[float, float]:
    """One path alone: the medians over ``batches`` of :func:`build_batch`."""
    with _garbage_collection_paused():
        samples = [build_batch(call, inputs, calls_per_batch) for _ in range(batches)]
    builds, releases = zip(*samples)
    return statistics.median(builds), statistics.median(releases)


def run_decode_token(call: DualNormPath, inputs: ScenarioInputs, layers: int) -> tuple[int, int]:
    """One decode token, ``layers`` chained calls and one eval: (build ns, total ns)."""
    queries, keys, query_weight, key_weight = inputs
    clock = time.perf_counter_ns
    started = clock()
    for _ in range(layers):
        queries, keys = call(queries, keys, query_weight, key_weight)
    built = clock()
    mx.eval(queries, keys)
    return built - started, clock() - started


def run_prefill_call(call: DualNormPath, inputs: ScenarioInputs) -> tuple[int, int]:
    """One evaluated call: (ns, peak bytes above the memory held before)."""
    mx.reset_peak_memory()
    resident_bytes = mx.get_active_memory()
    started = time.perf_counter_ns()
    outputs = call(*inputs)
    mx.eval(outputs)
    finished = time.perf_counter_ns()
    peak_bytes = mx.get_peak_memory()
    del outputs
    return finished - started, max(0, peak_bytes - resident_bytes)


def interleaved_samples(
    calls: dict[str, DualNormPath], take_sample: Callable[[DualNormPath], tuple],
    samples: int, warmup: int, per_turn: int = 1,
) -> dict[str, list[tuple]]:
    """``samples`` samples of every path (after ``warmup`` untimed ones),
    taken in turns of ``per_turn`` consecutive samples of one path, the
    order as :func:`_rotated`: load that comes and goes falls on all alike."""
    names = list(calls)
    results: dict[str, list[tuple]] = {name: [] for name in names}
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


class _Run:
    """One run's state: the paths built, their status and the scenarios
    each cannot run, the inputs, and the metrics so far."""

    def __init__(self, config: BenchmarkConfig, progress: Callable[[str], None]):
        self.config = config
        self.started = time.perf_counter()
        self.completed_repeats = 0
        self.metadata_at_start = machine_load("_at_start")
        self.calls: dict[str, DualNormPath] = {}
        self.path_status: dict[str, dict] = {}
        for name in config.selected_paths():
            path = PATH_REGISTRY[name]
            self.path_status[name] = {"description": path.description, "status": "ok"}
            try:
                self.calls[name] = path.factory(config.eps)
            except (PathUnavailable, ImportError) as unavailable:
                reason = f"{type(unavailable).__name__}: {unavailable}"
                self.path_status[name].update(status="skipped", reason=reason)
        if BASELINE_PATH not in self.calls:
            raise RuntimeError(f"the baseline path {BASELINE_PATH!r} did not build")
        self.inputs = {
            scenario.name: make_inputs(scenario, config.seed + index)
            for index, scenario in enumerate(SCENARIOS)
        }
        progress(f"warming up {len(self.calls)} paths (tracing, kernel JIT)")
        # Traces and JIT-compiles every path at every scenario, outside the
        # clock, and notes the scenarios a path cannot run.
        for name, call in self.calls.items():
            for scenario_name, scenario_inputs in self.inputs.items():
                try:
                    for _ in range(2):
                        mx.eval(call(*scenario_inputs))
                except PathUnavailable as unavailable:
                    skipped = self.path_status[name].setdefault("skipped_scenarios", {})
                    skipped[scenario_name] = str(unavailable)
        self.metrics: dict[str, MetricResult] = {}
        self.host_loop_us = time_graph_builds(  # the timing loop with a call that does nothing
            lambda *arguments: None, self.inputs[GATED_DELTA_DECODE.name],
            config.host_batches, config.host_calls_per_batch,
        )[0]

    def measure(
        self, scenario: Scenario, repeat: int, take_sample: Callable[..., tuple], count: int,
        readings: Sequence[Reading], **sampling: int,
    ) -> None:
        """:func:`interleaved_samples` of ``take_sample(call, inputs)`` at ``scenario``, the
        first path rotating per repeat; then per reading, each path's ``summary`` of its
        samples' ``position``-th number, over ``scale``."""
        calls = {
            name: self.calls[name]
            for name in _rotated(list(self.calls), repeat)
            if scenario.name not in self.path_status[name].get("skipped_scenarios", {})
        }
        inputs = self.inputs[scenario.name]
        samples = interleaved_samples(
            calls, lambda call: take_sample(call, inputs), count, **sampling
        )
        for kind, position, scale, summary in readings:
            metric = self.metrics.setdefault(kind.key(scenario), MetricResult(kind, scenario))
            for name, path_samples in samples.items():
                values = (sample[position] for sample in path_samples)
                metric.samples.setdefault(name, []).append(summary(values) / scale)

    def measure_repeat(self, repeat: int) -> None:
        """One repeat: host calls, decode tokens, then prefill calls (scale 1e3: ns to us)."""
        config = self.config
        host_batch = functools.partial(build_batch, calls=config.host_calls_per_batch)
        for scenario in DECODE_SCENARIOS:
            self.measure(scenario, repeat, host_batch, config.host_batches,
                         [Reading(HOST_CALL, 0), Reading(HOST_RELEASE, 1)], warmup=1)
        decode_token = functools.partial(run_decode_token, layers=config.layers)
        for scenario in DECODE_SCENARIOS:
            self.measure(scenario, repeat, decode_token, config.decode_tokens,
                         [Reading(DECODE_TOKEN, 1, 1e3), Reading(DECODE_BUILD, 0, 1e3)],
                         warmup=config.decode_warmup_tokens,
                         per_turn=config.decode_tokens_per_turn)
        # Same buffer cache for every path: emptied once, then one warm-up
        # call each refills it.
        mx.clear_cache()
        self.measure(GATED_DELTA_PREFILL, repeat, run_prefill_call, config.prefill_iterations,
                     [Reading(PREFILL_CALL, 0, 1e3), Reading(PREFILL_PEAK, 1, summary=max)],
                     warmup=1)
        self.completed_repeats += 1

    def report(self) -> BenchmarkReport:
        """The repeats completed (a cut-short repeat is left out)."""
        for metric in self.metrics.values():
            for samples in metric.samples.values():
                del samples[self.completed_repeats:]
        metadata = {**collect_metadata(), **self.metadata_at_start,
                    "host_loop_overhead_us": self.host_loop_us}
        return BenchmarkReport(
            dataclasses.replace(self.config, repeats=self.completed_repeats), metadata,
            self.path_status, self.metrics, elapsed_s=time.perf_counter() - self.started,
            interrupted=self.completed_repeats < self.config.repeats,
        )


def run_benchmark(
    config: Optional[BenchmarkConfig] = None, *, progress: Optional[Callable[[str], None]] = None,
) -> BenchmarkReport:
    """Runs every measurement on the default device, a line per stage and
    repeat to ``progress``. Ctrl-C raises InterruptedWithPartialResult
    carrying the report of the repeats that completed."""
    config = config or BenchmarkConfig()
    if config.repeats < 1 or config.layers < 1:
        raise ValueError("repeats and layers must be >= 1")
    emit = progress or (lambda line: None)
    run = _Run(config, emit)
    repeats_progress = command.StepProgress("repeats", config.repeats, emit=emit)
    try:
        for repeat in range(config.repeats):
            run.measure_repeat(repeat)
            repeats_progress.step()
    except KeyboardInterrupt:
        raise command.InterruptedWithPartialResult(run.report()) from None
    finally:
        for call in run.calls.values():
            close = getattr(call, "close", None)
            if callable(close):
                close()
    return run.report()
