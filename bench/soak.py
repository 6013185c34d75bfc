"""Soak: memory stays flat over many calls of the compiled dual head norm.

    python bench/soak.py                       # 10**6 decode-shaped calls
    python bench/soak.py --calls 20000 --samples 10
    python bench/soak.py --churn-every 1000    # a new object every 1000 calls
    python bench/soak.py --caller-thread       # calls on a long-lived worker
                                               # thread, objects made and
                                               # freed on the main thread

Each call normalizes decode-shaped queries and keys (mlx-lm's gated-delta
layers: (1, 1, 16, 128) and (1, 1, 2, 128) bf16, no weight by default),
evaluates both outputs and drops them. At evenly spaced points it samples
the process's resident set (VmRSS from /proc/self/status) and MLX's active,
cache and peak memory, then prints a table and the growth from the first
sample (taken after a warm-up, once every graph is traced and every kernel
built) to the last. Exits 1 when active memory grew at all or the resident
set grew by more than --max-rss-growth-mib; 0 otherwise.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx

import mlx_dualnorm
from mlx_dualnorm import CompiledDualHeadNorm

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
CHURN_EPSILONS = (1e-6, 1e-5)


def resident_set_kib() -> int:
    """VmRSS of this process, in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


@dataclass
class Sample:
    calls: int
    seconds: float
    rss_kib: int
    active_bytes: int
    cache_bytes: int
    peak_bytes: int


@dataclass
class SoakReport:
    samples: list[Sample] = field(default_factory=list)
    objects_built: int = 1

    @property
    def rss_growth_kib(self) -> int:
        return self.samples[-1].rss_kib - self.samples[0].rss_kib

    @property
    def active_growth_bytes(self) -> int:
        return self.samples[-1].active_bytes - self.samples[0].active_bytes

    @property
    def measured_calls(self) -> int:
        return self.samples[-1].calls - self.samples[0].calls

    def table(self) -> str:
        header = (
            f"{'calls':>10} {'seconds':>8} {'RSS MiB':>9} {'RSS +KiB':>9} "
            f"{'active B':>10} {'active +B':>10} {'cache B':>10} {'peak B':>10}"
        )
        first = self.samples[0]
        rows = [
            f"{s.calls:>10} {s.seconds:>8.1f} {s.rss_kib / 1024:>9.1f} "
            f"{s.rss_kib - first.rss_kib:>+9} {s.active_bytes:>10} "
            f"{s.active_bytes - first.active_bytes:>+10} {s.cache_bytes:>10} {s.peak_bytes:>10}"
            for s in self.samples
        ]
        return "\n".join([header, *rows])

    def summary(self) -> str:
        calls = max(self.measured_calls, 1)
        return (
            f"growth over {self.measured_calls} calls after warm-up "
            f"({self.objects_built} objects built): "
            f"RSS {self.rss_growth_kib:+d} KiB ({self.rss_growth_kib * 1024 / calls:+.4f} B/call), "
            f"MLX active {self.active_growth_bytes:+d} B"
        )


def sample(calls: int, started: float) -> Sample:
    gc.collect()
    return Sample(
        calls=calls,
        seconds=time.perf_counter() - started,
        rss_kib=resident_set_kib(),
        active_bytes=mx.get_active_memory(),
        cache_bytes=mx.get_cache_memory(),
        peak_bytes=mx.get_peak_memory(),
    )


class CallingThread:
    """Runs each call on one long-lived thread (its own compile cache and
    default stream), handing the evaluated outcome back."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        for job in iter(self._jobs.get, None):
            try:
                job()
                self._done.put(None)
            except BaseException as failure:  # handed back to the caller
                self._done.put(failure)

    def run(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)
        failure = self._done.get()
        if failure is not None:
            raise failure

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()


def run_soak(
    calls: int,
    samples: int = 20,
    warmup_calls: Optional[int] = None,
    query_shape: tuple[int, ...] = (1, 1, 16, 128),
    key_shape: tuple[int, ...] = (1, 1, 2, 128),
    dtype: mx.Dtype = mx.bfloat16,
    weighted: bool = False,
    churn_every: int = 0,
    caller_thread: bool = False,
    progress: Optional[Callable[[Sample], None]] = None,
) -> SoakReport:
    """Runs the soak and returns its samples (the first after warm-up)."""
    warmup_calls = max(100, calls // 100) if warmup_calls is None else warmup_calls
    queries = (mx.random.normal(query_shape, key=mx.random.key(1)) * 0.1).astype(dtype)
    keys = (mx.random.normal(key_shape, key=mx.random.key(2)) * 0.1).astype(dtype)
    query_weight = mx.ones(query_shape[-1:], dtype=dtype) if weighted else None
    key_weight = mx.ones(key_shape[-1:], dtype=dtype) if weighted else None
    mx.eval([array for array in (queries, keys, query_weight, key_weight) if array is not None])
    epsilons = itertools.cycle(CHURN_EPSILONS)
    norm = CompiledDualHeadNorm(next(epsilons))
    report = SoakReport()
    worker = CallingThread() if caller_thread else None

    def one_call() -> None:
        normalized_queries, normalized_keys = norm(queries, keys, query_weight, key_weight)
        mx.eval(normalized_queries, normalized_keys)

    call = (lambda: worker.run(one_call)) if worker else one_call
    try:
        for _ in range(warmup_calls):
            call()
        if churn_every:  # warm the churn path too: both epsilons built
            norm = CompiledDualHeadNorm(next(epsilons))
            call()
        interval = max(1, calls // samples)
        started = time.perf_counter()
        report.samples.append(sample(0, started))
        for done in range(1, calls + 1):
            if churn_every and done % churn_every == 0:
                norm = CompiledDualHeadNorm(next(epsilons))  # the old one is freed here
                report.objects_built += 1
            call()
            if done % interval == 0 or done == calls:
                report.samples.append(sample(done, started))
                if progress:
                    progress(report.samples[-1])
    finally:
        if worker:
            worker.stop()
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=10**6)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--warmup-calls", type=int, default=None)
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--query-shape", default="1,1,16,128")
    parser.add_argument("--key-shape", default="1,1,2,128")
    parser.add_argument("--weighted", action="store_true")
    parser.add_argument("--churn-every", type=int, default=0, help="build a new object every N calls")
    parser.add_argument("--caller-thread", action="store_true", help="call on a long-lived worker thread")
    parser.add_argument("--max-rss-growth-mib", type=float, default=32.0)
    options = parser.parse_args(argv)

    print(
        f"mlx_dualnorm soak: {options.calls} calls, {options.dtype}, q {options.query_shape}, "
        f"k {options.key_shape}, weighted={options.weighted}, churn_every={options.churn_every}, "
        f"caller_thread={options.caller_thread}, MLX {mx.__version__} on {mx.default_device()}\n"
        f"package: {mlx_dualnorm.__file__}",
        flush=True,
    )
    report = run_soak(
        calls=options.calls,
        samples=options.samples,
        warmup_calls=options.warmup_calls,
        query_shape=tuple(int(extent) for extent in options.query_shape.split(",")),
        key_shape=tuple(int(extent) for extent in options.key_shape.split(",")),
        dtype=DTYPES[options.dtype],
        weighted=options.weighted,
        churn_every=options.churn_every,
        caller_thread=options.caller_thread,
        progress=lambda s: print(f"  ... {s.calls} calls, {s.seconds:.0f} s", file=sys.stderr, flush=True),
    )
    print(report.table())
    print(report.summary())
    flat = (
        report.active_growth_bytes <= 0
        and report.rss_growth_kib <= options.max_rss_growth_mib * 1024
    )
    print("FLAT" if flat else "GROWING")
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
