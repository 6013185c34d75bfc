"""Memory over many calls: the process's resident set and MLX's active
memory sampled after a warm-up (every graph traced, every kernel built)
and again as calls go on, for the tests that memory stays flat."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import time

import mlx.core as mx

from helpers.threads import WorkerThread
from mlx_dualnorm import CompiledDualHeadNorm

# The epsilons that objects built anew alternate between.
CHURN_EPSILONS = (1e-6, 1e-5)


def resident_set_kib() -> int:
    """VmRSS of this process, in KiB (Linux's /proc/self/status)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


@dataclasses.dataclass(frozen=True)
class MemorySample:
    calls: int
    seconds: float
    rss_kib: int
    active_bytes: int


def take_sample(calls: int, started: float) -> MemorySample:
    gc.collect()
    return MemorySample(calls, time.perf_counter() - started, resident_set_kib(),
                        mx.get_active_memory())


@dataclasses.dataclass
class MemoryRun:
    """The samples of one run, the first taken after the warm-up."""

    samples: list[MemorySample] = dataclasses.field(default_factory=list)
    objects_built: int = 1

    @property
    def active_growth_bytes(self) -> int:
        return self.samples[-1].active_bytes - self.samples[0].active_bytes

    @property
    def rss_growth_kib(self) -> int:
        return self.samples[-1].rss_kib - self.samples[0].rss_kib

    def describe(self) -> str:
        first = self.samples[0]
        rows = [
            f"{sample.calls:>10} calls {sample.seconds:>8.1f} s  RSS "
            f"{sample.rss_kib - first.rss_kib:>+9} KiB  active {sample.active_bytes - first.active_bytes:>+10} B"
            for sample in self.samples
        ]
        return "\n".join([
            f"{self.samples[-1].calls - first.calls} calls after warm-up, {self.objects_built} "
            f"objects built: RSS {self.rss_growth_kib:+d} KiB, MLX active {self.active_growth_bytes:+d} B",
            *rows,
        ])


def run_decode_calls(
    calls: int,
    samples: int,
    warmup_calls: int,
    dtype: mx.Dtype = mx.bfloat16,
    weighted: bool = False,
    churn_every: int = 0,
    caller_thread: bool = False,
) -> MemoryRun:
    """``calls`` decode-shaped calls of a CompiledDualHeadNorm (queries
    (1, 1, 16, 128), keys (1, 1, 2, 128)), each output evaluated and dropped,
    sampled ``samples`` times after ``warmup_calls``. ``churn_every``: a new
    object every that many calls, the old one freed. ``caller_thread``:
    every call made on one long-lived worker thread while the objects are
    built and freed on this one."""
    queries = (mx.random.normal((1, 1, 16, 128), key=mx.random.key(1)) * 0.1).astype(dtype)
    keys = (mx.random.normal((1, 1, 2, 128), key=mx.random.key(2)) * 0.1).astype(dtype)
    weights = (mx.ones((128,), dtype=dtype),) * 2 if weighted else (None, None)
    mx.eval(queries, keys, [weight for weight in weights if weight is not None])
    epsilons = itertools.cycle(CHURN_EPSILONS)
    norm = CompiledDualHeadNorm(next(epsilons))
    run = MemoryRun()

    def one_call() -> None:
        mx.eval(*norm(queries, keys, *weights))

    with WorkerThread() if caller_thread else _ThisThread() as worker:
        for _ in range(warmup_calls):
            worker.call(one_call)
        if churn_every:  # both epsilons traced before the first sample
            norm = CompiledDualHeadNorm(next(epsilons))
            worker.call(one_call)
        interval = max(1, calls // samples)
        started = time.perf_counter()
        run.samples.append(take_sample(0, started))
        for done in range(1, calls + 1):
            if churn_every and done % churn_every == 0:
                norm = CompiledDualHeadNorm(next(epsilons))  # the one before is freed here
                run.objects_built += 1
            worker.call(one_call)
            if done % interval == 0 or done == calls:
                run.samples.append(take_sample(done, started))
    return run


class _ThisThread:
    """WorkerThread's interface, calling on the test's own thread."""

    def call(self, job):
        return job()

    def __enter__(self) -> "_ThisThread":
        return self

    def __exit__(self, *exception: object) -> None:
        pass
