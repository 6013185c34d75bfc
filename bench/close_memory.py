"""Resident memory per create/apply/close cycle, with idle threads beside it.

A server whose main thread warmed up once and whose worker makes objects
per request: ``--idle`` threads each apply one long-lived object and then
wait, while this thread runs ``--cycles`` cycles of creating, applying and
closing both composites. Prints, per idle-thread count, the resident set
growth over the cycles in bytes per cycle (after a warm-up of the same
cycles, so allocator and kernel caches are already filled). The entries
the package holds for other threads' compile caches, which must not grow,
are counted by tests/core/test_compile_erasure.py.

    python bench/close_memory.py [--cycles 20000] [--idle 0 16]
"""

from __future__ import annotations

import argparse
import threading

import mlx.core as mx

from mlx_dualnorm import CompiledDualHeadNorm, CompiledDualHeadNormRope


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def cycle(queries, keys) -> None:
    norm = CompiledDualHeadNorm(1e-6, mode="compiled")
    norm_rope = CompiledDualHeadNormRope(1e-6, 16, base=1e4, mode="compiled")
    mx.eval(norm(queries, keys), norm_rope(queries, keys, offset=1))
    norm.close()
    norm_rope.close()


def measure(idle_count: int, cycles: int) -> tuple[float, int]:
    queries, keys = mx.ones((1, 1, 4, 32)), mx.ones((1, 1, 2, 32))
    shared = CompiledDualHeadNorm(1e-6, mode="compiled")
    applied = threading.Barrier(idle_count + 1)
    release = threading.Event()

    def idle() -> None:
        mx.eval(shared(mx.ones((1, 1, 4, 32)), mx.ones((1, 1, 2, 32))))
        applied.wait()
        release.wait()

    threads = [threading.Thread(target=idle) for _ in range(idle_count)]
    for thread in threads:
        thread.start()
    applied.wait()
    try:
        for _ in range(cycles // 4):  # warm-up
            cycle(queries, keys)
        bytes_before = resident_bytes()
        for _ in range(cycles):
            cycle(queries, keys)
        growth = (resident_bytes() - bytes_before) / cycles
    finally:
        release.set()
        for thread in threads:
            thread.join()
    return growth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=20000)
    parser.add_argument("--idle", type=int, nargs="+", default=[0, 16])
    options = parser.parse_args()
    print(f"{'idle threads':>12} {'bytes/cycle':>12}")
    for idle_count in options.idle:
        growth = measure(idle_count, options.cycles)
        print(f"{idle_count:12d} {growth:12.1f}")


if __name__ == "__main__":
    main()
