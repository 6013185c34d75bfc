"""Closing costs bounded memory whatever other threads do.

MLX keeps one compile cache per thread, so closing an object must reach
the traces other threads hold. Only threads that applied an object get
anything queued for it: threads that sit idle while others create, apply
and close objects (a server's warmed-up main thread beside a worker that
makes objects per request) accumulate nothing.
"""

from __future__ import annotations

import gc
import threading

import mlx.core as mx
import pytest

from mlx_dualnorm import (
    CompiledDualHeadNorm,
    CompiledDualHeadNormRope,
    composed_dual_head_norm,
)
from mlx_dualnorm.bits import same_bits
from mlx_dualnorm._native import lib

IDLE_THREADS = 16
CYCLES = 200
COMPILE_IDS_PER_OBJECT = 4  # one per weight set (csrc/private/weight_set_graphs.h)


def queries_and_keys():
    return mx.ones((1, 1, 4, 32)), mx.full((1, 1, 2, 32), 2.0)


def new_composites(mode):
    return (
        CompiledDualHeadNorm(1e-6, mode=mode),
        CompiledDualHeadNormRope(1e-6, 16, base=1e4, mode=mode),
    )


def apply_each(composites):
    queries, keys = queries_and_keys()
    norm, norm_rope = composites
    mx.eval(norm(queries, keys), norm_rope(queries, keys, offset=2))


class IdleThreads:
    """Threads that apply ``composites`` once, then wait until released,
    then apply them once more and report what they got."""

    def __init__(self, count, composites):
        self.composites = composites
        self.applied = threading.Barrier(count + 1)
        self.release = threading.Event()
        self.results = []
        self.errors = []
        self.threads = [threading.Thread(target=self._run) for _ in range(count)]
        for thread in self.threads:
            thread.start()
        self.applied.wait(timeout=60)

    def _run(self):
        try:
            apply_each(self.composites)
            self.applied.wait(timeout=60)
            self.release.wait(timeout=120)
            queries, keys = queries_and_keys()
            actual = self.composites[0](queries, keys)
            expected = composed_dual_head_norm(queries, keys, eps=1e-6)
            # Compared here: each thread has streams of its own.
            self.results.append(all(map(same_bits, actual, expected)))
        except Exception as error:  # reported by the test
            self.errors.append(error)

    def finish(self):
        self.release.set()
        for thread in self.threads:
            thread.join(timeout=60)


@pytest.mark.parametrize("mode", ["compiled", "composed"])
def test_idle_threads_accumulate_nothing_while_others_close(mode):
    shared = new_composites(mode)
    idle = IdleThreads(IDLE_THREADS, shared)
    try:
        apply_each(new_composites(mode))  # this thread registered too
        before = lib.mlx_dualnorm_pending_erasure_entries()
        for _ in range(CYCLES):
            composites = new_composites(mode)
            apply_each(composites)
            for composite in composites:
                composite.close()
        after = lib.mlx_dualnorm_pending_erasure_entries()
    finally:
        idle.finish()
    assert not idle.errors
    assert after == before, f"{after - before} entries held after {CYCLES} cycles"
    assert idle.results == [True] * IDLE_THREADS


def test_a_thread_that_applied_a_closed_object_erases_it_at_its_next_apply():
    """What is queued for a thread is the objects it applied, and its next
    apply drains it."""
    mine = new_composites("compiled")
    apply_each(mine)
    shared = new_composites("compiled")
    idle = IdleThreads(1, shared)
    # No collection of earlier tests' objects (whose close would change the
    # counts) while they are compared.
    gc.collect()
    gc.disable()
    try:
        held = lib.mlx_dualnorm_pending_erasure_entries()
        for composite in shared:
            composite.close()
        # The idle thread's notes of the two objects are gone, and their
        # compile ids (one per weight set) are queued on it, which holds
        # traces of them; this thread never applied them, so nothing changes
        # for it.
        queued = lib.mlx_dualnorm_pending_erasure_entries()
        assert queued == held - len(shared) + len(shared) * COMPILE_IDS_PER_OBJECT
    finally:
        idle.finish()  # its next apply (of a closed object) drains the queue first
        drained = lib.mlx_dualnorm_pending_erasure_entries()
        gc.enable()
    assert len(idle.errors) == 1 and "closed" in str(idle.errors[0])
    assert drained == held - len(shared)
