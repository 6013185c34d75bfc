"""How calls from several Python threads scale: the compiled mode (whose
apply holds the package's trace lock across the graph replay) against the
composed path (two mx.fast.rms_norm calls, no lock of this package), graph
building only, no evaluation. Prints aggregate calls per second per thread
count, medians and ranges over rounds, and each path's ratio to its own
one-thread rate (higher is better: 2.0 would be perfect scaling on two
threads). Both paths run under the GIL, which the bridge and MLX's own
bindings hold while they build the graph."""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import mlx.core as mx

from mlx_dualnorm import CompiledDualHeadNorm, composed_dual_head_norm


def calls_per_second(call, thread_count: int, calls_per_thread: int) -> float:
    queries = mx.random.normal((1, 1, 16, 128)).astype(mx.bfloat16)
    keys = mx.random.normal((1, 1, 16, 128)).astype(mx.bfloat16)
    mx.eval(queries, keys)
    start_line = threading.Barrier(thread_count + 1)

    def work() -> None:
        call(queries, keys)  # trace (compiled) before the clock starts
        start_line.wait()
        for _ in range(calls_per_thread):
            call(queries, keys)

    threads = [threading.Thread(target=work) for _ in range(thread_count)]
    for thread in threads:
        thread.start()
    start_line.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    return thread_count * calls_per_thread / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4],
                        help="thread counts to measure (default: 1 2 4)")
    parser.add_argument("--calls", type=int, default=20000, help="calls per thread per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    arguments = parser.parse_args()
    norm = CompiledDualHeadNorm(1e-6, mode="compiled")
    paths = {
        "compiled": lambda q, k: norm(q, k),
        "composed": lambda q, k: composed_dual_head_norm(q, k, eps=1e-6),
    }
    rates: dict[tuple[str, int], list[float]] = {}
    for _ in range(arguments.rounds):
        for name, call in paths.items():
            for thread_count in arguments.threads:
                rate = calls_per_second(call, thread_count, arguments.calls)
                rates.setdefault((name, thread_count), []).append(rate)
    print(f"MLX {mx.__version__} on {mx.default_device()}, {arguments.rounds} rounds")
    print("path      threads   calls/s median [min-max]   x one-thread median")
    for name in paths:
        one_thread = statistics.median(rates[(name, arguments.threads[0])])
        for thread_count in arguments.threads:
            values = rates[(name, thread_count)]
            median = statistics.median(values)
            print(f"{name:9} {thread_count:7}   {median:9.0f} [{min(values):.0f}-{max(values):.0f}]"
                  f"   {median / one_thread:.2f}x")


if __name__ == "__main__":
    main()
