"""Lifetime: objects release what they hold on close, on garbage
collection and at interpreter exit, whatever threads used them; a closed
object refuses every call with a value error naming the operation, and
closing one object leaves every other working."""

from __future__ import annotations

import gc
import textwrap
import threading
import weakref

import mlx.core as mx
import pytest
from helpers.bit_parity import assert_normalized_with_eps
from helpers.isolated_process import describe, run_python
from helpers.small_heads import EPS, OTHER_EPS, assert_works, heads
from helpers.threads import running_on_threads

from mlx_dualnorm import CompiledDualHeadNorm, DualHeadNormValueError
from mlx_dualnorm._native import lib

# The C side's name for apply (the facade never formats it itself).
APPLY_OPERATION = "dual_head_norm"


# ---- close, context manager, garbage collection ---------------------------


def test_use_after_close_is_a_value_error_naming_the_operation():
    norm = CompiledDualHeadNorm(EPS)
    assert_works(norm)
    norm.close()
    with pytest.raises(DualHeadNormValueError) as raised:
        norm(*heads())
    assert isinstance(raised.value, ValueError)
    assert raised.value.operation == APPLY_OPERATION
    assert "closed" in raised.value.description
    norm.close()  # twice is fine
    assert norm.eps == pytest.approx(EPS)  # the struct outlives close
    assert_works(CompiledDualHeadNorm(EPS))


def test_context_manager_closes_even_on_error():
    with pytest.raises(KeyError):
        with CompiledDualHeadNorm(EPS) as norm:
            assert_works(norm)
            raise KeyError("inside the block")
    with pytest.raises(DualHeadNormValueError, match="closed"):
        norm(*heads())


def test_closing_one_object_leaves_the_others_working():
    kept, closed = CompiledDualHeadNorm(EPS), CompiledDualHeadNorm(OTHER_EPS)
    assert_works(kept)
    assert_works(closed, OTHER_EPS)
    closed.close()
    assert_works(kept)
    assert_works(CompiledDualHeadNorm(OTHER_EPS), OTHER_EPS)


def test_garbage_collection_frees_objects_and_their_graphs():
    inputs = heads(2)
    references = []
    for eps in (EPS, OTHER_EPS):
        norm = CompiledDualHeadNorm(eps)
        mx.eval(norm(*inputs))
        references.append(weakref.ref(norm))
        del norm
    cyclic = CompiledDualHeadNorm(EPS)
    mx.eval(cyclic(*inputs))
    holder = [cyclic]
    holder.append(holder)  # a reference cycle only the collector breaks
    references.append(weakref.ref(cyclic))
    del cyclic, holder
    gc.collect()
    assert all(reference() is None for reference in references)
    assert_works(CompiledDualHeadNorm(EPS))


def test_outputs_outlive_their_object():
    inputs = heads(3)
    norm = CompiledDualHeadNorm(EPS)
    outputs = norm(*inputs)  # lazy: evaluated after the object is gone
    norm.close()
    del norm
    gc.collect()
    mx.eval(outputs)
    assert_normalized_with_eps(outputs, inputs, EPS, (OTHER_EPS,))


EXIT_SCENARIOS = {
    "live objects in globals": """
        norms = [CompiledDualHeadNorm(eps) for eps in (1e-2, 1e-4, 1e-6)]
        for norm in norms:
            mx.eval(norm(*heads()))
    """,
    "unevaluated outputs alive": """
        norm = CompiledDualHeadNorm(1e-4)
        pending = norm(*heads())
    """,
    "objects in a reference cycle": """
        norm = CompiledDualHeadNorm(1e-4)
        mx.eval(norm(*heads()))
        cycle = [norm]
        cycle.append(cycle)
        del norm
    """,
    "traced on a thread that has ended": """
        import threading
        norm = CompiledDualHeadNorm(1e-4)
        inputs = heads()
        thread = threading.Thread(target=lambda: mx.eval(norm(*inputs)))
        thread.start()
        thread.join()
    """,
    # Parked, not evaluating: a daemon thread still inside MLX at exit can
    # abort plain MLX too (std::terminate from MLX's own teardown), with or
    # without this package, so that case says nothing about it.
    "daemon threads parked after tracing": """
        import threading
        norm = CompiledDualHeadNorm(1e-4)
        inputs = heads()
        traced, never = threading.Barrier(3), threading.Event()
        def trace_then_park():
            mx.eval(norm(*inputs))
            traced.wait()
            never.wait()
        for _ in range(2):
            threading.Thread(target=trace_then_park, daemon=True).start()
        traced.wait()
    """,
    "closed and open objects": """
        closed = CompiledDualHeadNorm(1e-4)
        mx.eval(closed(*heads()))
        closed.close()
        still_open = CompiledDualHeadNorm(1e-2)
        mx.eval(still_open(*heads()))
    """,
}


@pytest.mark.parametrize("scenario", EXIT_SCENARIOS)
def test_interpreter_exit_is_clean(scenario):
    process = run_python(
        "import mlx.core as mx\n"
        "from mlx_dualnorm import CompiledDualHeadNorm\n"
        "from helpers.small_heads import heads\n"
        + textwrap.dedent(EXIT_SCENARIOS[scenario])
        + "print('exiting')\n"
    )
    assert process.returncode == 0, describe(process)
    assert "exiting" in process.stdout
    assert "MLX error" not in process.stdout, process.stdout
    assert "Fatal Python error" not in process.stderr, process.stderr


# ---- exit after worker threads ------------------------------------------------

WORKER_THREADS_THEN_EXIT = """
    from concurrent.futures import ThreadPoolExecutor
    import mlx.core as mx
    from mlx_dualnorm import CompiledDualHeadNorm
    norm = CompiledDualHeadNorm(1e-6, mode="compiled")
    def task(index):
        queries = mx.random.normal((1, 1, 16, 128)).astype(mx.bfloat16)
        keys = mx.random.normal((1, 1, 16, 128)).astype(mx.bfloat16)
        mx.eval(norm(queries, keys))
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(task, range(64)))
    print("exiting")
"""


def test_worker_threads_that_used_the_package_never_abort_the_exit():
    """Joined worker threads run their C++ thread-local destructors after
    Python's join returns; MLX's Python module's destructors (its random
    state, here) take the GIL and abort once finalization has begun. Plain
    MLX aborted 39 of 60 such runs, the package 0 of 60 after its exit hook
    waits for those threads (bench/exit_abort_rate.py, 2026-11-30); before
    the hook the package aborted 103 of 150. Eight runs in a row without an
    abort would have had a chance under 1e-4 then."""
    for attempt in range(8):
        process = run_python(WORKER_THREADS_THEN_EXIT)
        assert process.returncode == 0, f"run {attempt}: {describe(process)}"
        assert "exiting" in process.stdout


def test_awaiting_thread_exits_returns_once_they_are_gone():
    norm = CompiledDualHeadNorm(EPS)
    applied, release = threading.Event(), threading.Event()

    def apply_then_wait() -> None:
        mx.eval(norm(*heads()))
        applied.set()
        release.wait()

    with running_on_threads(apply_then_wait):
        try:
            assert applied.wait(timeout=120), "the worker never applied"
            assert lib.mlx_dualnorm_await_thread_exits(50) >= 1, "a live worker is still registered"
        finally:
            release.set()
    assert lib.mlx_dualnorm_await_thread_exits(5000) == 0
