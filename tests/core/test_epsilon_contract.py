"""The epsilon contract: every call normalizes with its OWN object's eps.

The graph builders are plain C functions, so they read the epsilon from a
process-wide slot. Each apply writes its object's epsilon into the slot and
holds the trace lock across the apply, so whatever trace that apply
triggers (the first call, or any compile-cache miss later) reads that
object's epsilon. These tests provoke every trace MLX can trigger after an
object is built, always right after ANOTHER object with another epsilon
wrote the slot:

* objects built together and first called in every order (a);
* a dtype change, a rank change, a new thread, a new default stream (three
  ways), a new weight set (b); a control test shows MLX really retraces
  in each of those situations;
* compilation disabled by MLX_DISABLE_COMPILE=1, by mx.disable_compile(),
  and by a machine with no g++ on PATH, where every call re-runs the
  builder (c);
* eight threads calling while two more build objects with other epsilons
  (d).

Every output is compared bit for bit with two mx.fast.rms_norm calls using
the object's eps AND checked to differ from the other epsilons' outputs,
so a call that baked a stale slot value fails. Inputs are small (x*1e-3)
so that eps dominates the mean square.
"""

from __future__ import annotations

import functools
import itertools
import pathlib
import random
import threading
import time
from typing import Callable, Optional

import mlx.core as mx
import numpy as np
import pytest
from helpers.bit_parity import CPU_BACKEND_ONLY, assert_normalized_with_eps, mismatched_elements
from helpers.isolated_process import describe, path_without, run_python
from helpers.threads import run_on_threads

from mlx_dualnorm import CompiledDualHeadNorm, composed_dual_head_norm

try:
    from mlx_dualnorm import available_modes
except ImportError:  # a build without modes has the one (compiled) path

    def available_modes() -> tuple[Optional[str], ...]:
        return (None,)


EPSILONS = (1e-2, 1e-4, 1e-6)
# The float32 right above 1e-4: one unit in the last place. float32 inputs
# still tell it from 1e-4, so the slot must carry the epsilon's exact bits.
NEIGHBOUR_OF_1E_4 = float(np.nextafter(np.float32(1e-4), np.float32(1.0)))
# Modes that go through the graph builders and therefore the slot.
SLOT_MODES = tuple(mode for mode in available_modes() if mode != "fused")
CONCURRENCY_SECONDS = 4.0
# Python builders compiled by the control tests (see test_the_trigger_...).
KEPT_ALIVE: list = []


def make_norm(eps: float, mode: Optional[str] = None) -> CompiledDualHeadNorm:
    return CompiledDualHeadNorm(eps) if mode is None else CompiledDualHeadNorm(eps, mode=mode)


def small_heads(
    seed: int,
    dtype: mx.Dtype = mx.float32,
    query_shape: tuple[int, ...] = (2, 4, 64),
    key_shape: tuple[int, ...] = (2, 2, 64),
    weights: str = "none",
) -> tuple:
    """(queries, keys, query_weight, key_weight), evaluated; values ~1e-3 so
    that eps dominates; weights per ``weights``: none/query/key/both."""
    query_key, key_key, query_weight_key, key_weight_key = mx.random.split(mx.random.key(seed), 4)
    queries = (mx.random.normal(query_shape, key=query_key) * 1e-3).astype(dtype)
    keys = (mx.random.normal(key_shape, key=key_key) * 1e-3).astype(dtype)
    query_weight = key_weight = None
    if weights in ("query", "both"):
        query_weight = (1 + 0.5 * mx.random.normal(query_shape[-1:], key=query_weight_key)).astype(dtype)
    if weights in ("key", "both"):
        key_weight = (1 + 0.5 * mx.random.normal(key_shape[-1:], key=key_weight_key)).astype(dtype)
    inputs = (queries, keys, query_weight, key_weight)
    mx.eval([array for array in inputs if array is not None])
    return inputs


def check_call(norm, eps, inputs, other_epsilons, context, **call_options) -> None:
    """One call of ``norm`` gives the composed bits of ``eps`` and not those
    of ``other_epsilons``."""
    outputs = norm(*inputs, **call_options)
    mx.eval(outputs)
    assert_normalized_with_eps(outputs, inputs, eps, other_epsilons, context)


# ---- (a) several objects, interleaved -----------------------------------


def test_the_chosen_inputs_tell_every_epsilon_apart():
    """Guard for every test here: on these inputs the epsilons give
    different bits, so a call that used the wrong one cannot pass."""
    for dtype in (mx.float32, mx.bfloat16):
        inputs = small_heads(1, dtype)
        for eps, other_eps in itertools.combinations(EPSILONS, 2):
            mine = composed_dual_head_norm(*inputs, eps=eps)
            theirs = composed_dual_head_norm(*inputs, eps=other_eps)
            assert mismatched_elements(mine[0], theirs[0]) > 0
            assert mismatched_elements(mine[1], theirs[1]) > 0
    inputs = small_heads(1, mx.float32)
    mine = composed_dual_head_norm(*inputs, eps=1e-4)
    theirs = composed_dual_head_norm(*inputs, eps=NEIGHBOUR_OF_1E_4)
    assert mismatched_elements(mine[0], theirs[0]) > 0


@pytest.mark.parametrize("first_call_order", list(itertools.permutations(range(3))))
def test_objects_built_together_and_first_called_in_any_order(first_call_order):
    """Every object is built before any is called, so each first call
    (the trace) comes after the other objects wrote the slot."""
    modes = itertools.cycle(SLOT_MODES)
    norms = [make_norm(eps, next(modes)) for eps in EPSILONS]
    inputs = small_heads(2)
    for index in first_call_order:
        check_call(norms[index], EPSILONS[index], inputs, EPSILONS, f"first call of #{index}")
    for round_number in range(3):
        for index in (2, 0, 1):
            check_call(norms[index], EPSILONS[index], inputs, EPSILONS, f"round {round_number}")


def test_interleaved_calls_over_every_weight_set():
    """Each weight set is its own compiled graph with its own first
    trace; the weight sets are visited round robin across the objects."""
    norms = [make_norm(eps, mode) for eps, mode in zip(EPSILONS, itertools.cycle(SLOT_MODES))]
    weight_sets = ("none", "query", "key", "both")
    for round_number in range(2):
        for set_index, weight_set in enumerate(weight_sets):
            inputs = small_heads(3 + set_index, weights=weight_set)
            for offset in range(len(norms)):
                index = (offset + set_index + round_number) % len(norms)
                check_call(
                    norms[index], EPSILONS[index], inputs, EPSILONS, f"weight set {weight_set}"
                )


def test_calls_that_take_the_uncompiled_builder_use_their_own_epsilon():
    """Large calls (many rows) and degenerate widths run the plain builder
    on every call instead of the compiled graph; it reads the same slot.
    Each object alternates between the two paths."""
    norms = [make_norm(eps) for eps in EPSILONS]
    compiled_sized = small_heads(12)
    many_rows = small_heads(13, query_shape=(4, 16, 64), key_shape=(4, 4, 64), weights="both")
    width_one = small_heads(14, query_shape=(3, 2, 1), key_shape=(3, 1))
    for round_number in range(2):
        for index in (2, 1, 0):
            for inputs, path in ((many_rows, "many rows"), (compiled_sized, "compiled"),
                                 (width_one, "width 1")):
                check_call(norms[index], EPSILONS[index], inputs, EPSILONS,
                           f"{path}, round {round_number}")


def test_neighbouring_float32_epsilons_keep_their_own_bits():
    """1e-4 and the next float32 above it: any rounding or reuse of the
    slot value on the way into the graph would be caught here."""
    below, above = make_norm(1e-4), make_norm(NEIGHBOUR_OF_1E_4)
    inputs = small_heads(4)
    pair = (1e-4, NEIGHBOUR_OF_1E_4)
    for _ in range(2):
        check_call(above, NEIGHBOUR_OF_1E_4, inputs, pair, "above")
        check_call(below, 1e-4, inputs, pair, "below")


# ---- (b) retraces ------------------------------------------------------------


def identity(inputs: tuple) -> tuple:
    return inputs


def as_bfloat16(inputs: tuple) -> tuple:
    return tuple(None if array is None else array.astype(mx.bfloat16) for array in inputs)


def with_leading_axis(inputs: tuple) -> tuple:
    queries, keys, query_weight, key_weight = inputs
    return (queries[None], keys[None], query_weight, key_weight)


def with_both_weights(inputs: tuple) -> tuple:
    queries, keys, _, _ = inputs
    return (queries, keys, mx.full(queries.shape[-1:], 1.5), mx.full(keys.shape[-1:], 0.5))


def on_this_thread(call: Callable[..., None]) -> None:
    call()


def on_a_new_thread(call: Callable[..., None]) -> None:
    run_on_threads(call)


def inside_a_new_stream_context(call: Callable[..., None]) -> None:
    with mx.stream(mx.new_stream(mx.default_device())):
        call()


def with_a_new_default_stream(call: Callable[..., None]) -> None:
    previous = mx.default_stream(mx.default_device())
    mx.set_default_stream(mx.new_stream(mx.default_device()))
    try:
        call()
    finally:
        mx.set_default_stream(previous)


def with_a_new_stream_argument(call: Callable[..., None]) -> None:
    call(stream=mx.new_stream(mx.default_device()))


# name: (how the inputs change, where and how the call runs)
RETRACE_TRIGGERS = {
    "dtype change": (as_bfloat16, on_this_thread),
    "rank change": (with_leading_axis, on_this_thread),
    "new weight set": (with_both_weights, on_this_thread),
    "new thread": (identity, on_a_new_thread),
    "mx.stream context": (identity, inside_a_new_stream_context),
    "set_default_stream": (identity, with_a_new_default_stream),
    "stream= argument": (identity, with_a_new_stream_argument),
}


@pytest.mark.parametrize("trigger", RETRACE_TRIGGERS)
def test_the_trigger_makes_mlx_retrace(trigger):
    """Control: in each situation MLX's compile cache misses and the
    builder runs again (shown with a counting Python builder compiled the
    same way, shapeless), so the tests below do exercise a re-trace."""
    change_inputs, run = RETRACE_TRIGGERS[trigger]
    traces = []

    def counting_builder(queries, keys, *weights):
        traces.append(1)
        query_weight, key_weight = (list(weights) + [None, None])[:2]
        return composed_dual_head_norm(queries, keys, query_weight, key_weight, eps=1e-4)

    compiled_builder = mx.compile(counting_builder, shapeless=True)
    # Python's mx.compile keys its cache on id(function): keep this one
    # alive so that no later test's builder can reuse its address and hit
    # its cache entry.
    KEPT_ALIVE.append((counting_builder, compiled_builder))

    def call_compiled(inputs, stream=None):
        present = [array for array in inputs if array is not None]
        if stream is None:
            mx.eval(compiled_builder(*present))
        else:
            with mx.stream(stream):
                mx.eval(compiled_builder(*present))

    inputs = small_heads(5)
    call_compiled(inputs)
    call_compiled(inputs)
    assert len(traces) == 1
    changed = change_inputs(inputs)
    run(lambda **options: call_compiled(changed, **options))
    assert len(traces) == 2, f"{trigger} did not retrace"


@pytest.mark.parametrize("mode", SLOT_MODES)
@pytest.mark.parametrize("trigger", RETRACE_TRIGGERS)
def test_a_retrace_bakes_the_objects_own_epsilon(trigger, mode):
    """Object A traces, object B (another eps) traces and so writes the slot
    last; then A retraces. A must still normalize with its own eps."""
    change_inputs, run = RETRACE_TRIGGERS[trigger]
    first_eps, second_eps = EPSILONS[0], EPSILONS[1]
    first, second = make_norm(first_eps, mode), make_norm(second_eps, mode)
    inputs = small_heads(6)
    check_call(first, first_eps, inputs, EPSILONS, "first, initial trace")
    check_call(second, second_eps, inputs, EPSILONS, "second, initial trace")

    changed = change_inputs(inputs)
    run(lambda **options: check_call(first, first_eps, changed, EPSILONS, "first, retraced", **options))
    run(lambda **options: check_call(second, second_eps, changed, EPSILONS, "second, retraced", **options))
    run(lambda **options: check_call(first, first_eps, changed, EPSILONS, "first, again", **options))
    # The graphs traced first are still cached and still hold their epsilon.
    check_call(first, first_eps, inputs, EPSILONS, "first, original graph")
    check_call(second, second_eps, inputs, EPSILONS, "second, original graph")


# ---- (c) compilation disabled --------------------------------------------


def exercise_contract() -> int:
    """Interleaved objects through every retrace trigger; returns the number
    of calls checked. Also run in child processes with compilation off."""
    checked = 0
    norms = [make_norm(eps) for eps in EPSILONS]
    inputs = small_heads(7)
    for index in (1, 2, 0, 2, 1, 0):
        check_call(norms[index], EPSILONS[index], inputs, EPSILONS, "interleaved")
        checked += 1
    for trigger, (change_inputs, run) in RETRACE_TRIGGERS.items():
        changed = change_inputs(inputs)
        for index in (2, 0, 1):
            run(
                lambda index=index, **options: check_call(
                    norms[index], EPSILONS[index], changed, EPSILONS, trigger, **options
                )
            )
            checked += 1
    return checked


def builder_runs_on_every_call() -> bool:
    """True when compiled functions do not cache: the builder of a shapeless
    compiled function runs on each call."""
    traces = []

    def counting_builder(queries):
        traces.append(1)
        return mx.fast.rms_norm(queries, None, 1e-4)

    compiled_builder = mx.compile(counting_builder, shapeless=True)
    KEPT_ALIVE.append((counting_builder, compiled_builder))
    for _ in range(3):
        mx.eval(compiled_builder(mx.ones((2, 8))))
    return len(traces) == 3


def test_with_mx_disable_compile():
    built_before = make_norm(EPSILONS[0])
    inputs = small_heads(8)
    check_call(built_before, EPSILONS[0], inputs, EPSILONS, "before disabling")
    mx.disable_compile()
    try:
        assert builder_runs_on_every_call()
        built_after = make_norm(EPSILONS[1])
        for _ in range(2):
            check_call(built_after, EPSILONS[1], inputs, EPSILONS, "built while disabled")
            check_call(built_before, EPSILONS[0], inputs, EPSILONS, "built before disabling")
        assert exercise_contract() > 0
    finally:
        mx.enable_compile()
    check_call(built_before, EPSILONS[0], inputs, EPSILONS, "re-enabled")


# The child imports this module (its folder on the child's PYTHONPATH).
THIS_FOLDER = pathlib.Path(__file__).resolve().parent
CHILD_EXERCISE = """
    import test_epsilon_contract as contract
    assert contract.builder_runs_on_every_call(), "compilation was still on"
    print("checked", contract.exercise_contract(), "calls")
"""


def test_with_mlx_disable_compile_environment_variable():
    process = run_python(CHILD_EXERCISE, env_overrides={"MLX_DISABLE_COMPILE": "1"},
                         importable=[THIS_FOLDER])
    assert process.returncode == 0, describe(process)
    assert "checked" in process.stdout


@CPU_BACKEND_ONLY
def test_on_a_machine_without_gxx():
    """MLX's CPU compile needs g++ at run time; without it, compile hands
    back the builder itself, which then runs on every call."""
    process = run_python(CHILD_EXERCISE, env_overrides={"PATH": path_without("g++")},
                         importable=[THIS_FOLDER])
    assert process.returncode == 0, describe(process)
    assert "checked" in process.stdout


# ---- (d) concurrency ---------------------------------------------------------


def test_concurrent_callers_while_other_threads_build_objects():
    """Eight threads call objects of a shared pool while two threads build
    objects with other epsilons (first-calling them on their own thread,
    then publishing them, and dropping replaced ones, whose frees then run
    concurrently). Every thread's first call of an object is a trace."""
    deadline = time.monotonic() + CONCURRENCY_SECONDS
    pool_epsilons = EPSILONS
    builder_epsilons = (3e-3, 3e-5)
    every_epsilon = pool_epsilons + builder_epsilons
    pool_lock = threading.Lock()
    pool = [(eps, make_norm(eps)) for eps in pool_epsilons]
    input_sets = [
        small_heads(9, weights="none"),
        small_heads(10, weights="both"),
        small_heads(15, query_shape=(4, 16, 64), key_shape=(4, 4, 64)),  # uncompiled builder
    ]
    counts = {"calls": 0, "builds": 0}

    def caller(seed: int) -> None:
        call_from_the_pool(seed, deadline, pool, pool_lock, input_sets, every_epsilon, counts,
                           f"caller {seed}")

    def builder(seed: int) -> None:
        chooser = random.Random(seed)
        while time.monotonic() < deadline:
            eps = chooser.choice(builder_epsilons)
            norm = make_norm(eps)
            check_call(norm, eps, chooser.choice(input_sets), every_epsilon, f"builder {seed}")
            with pool_lock:
                slot = chooser.randrange(len(pool_epsilons), len(pool_epsilons) + 4)
                if slot < len(pool):
                    pool[slot] = (eps, norm)  # the object replaced is freed
                else:
                    pool.append((eps, norm))
                counts["builds"] += 1

    run_threads(caller, 8, builder, 2)
    print(f"8 callers, 2 builders, {CONCURRENCY_SECONDS} s: {counts}")
    assert counts["calls"] >= 8 * 5, counts
    assert counts["builds"] >= 2, counts


def call_from_the_pool(seed, deadline, pool, pool_lock, input_sets, epsilons, counts, label):
    """Until ``deadline``, calls a random object of ``pool`` (a list of
    (eps, object), changed by other threads under ``pool_lock``) on random
    inputs of ``input_sets``, checking each call's bits against
    ``epsilons``; counts the calls in ``counts["calls"]``."""
    chooser = random.Random(seed)
    while time.monotonic() < deadline:
        with pool_lock:
            eps, norm = chooser.choice(pool)
        check_call(norm, eps, chooser.choice(input_sets), epsilons, label)
        with pool_lock:
            counts["calls"] += 1


def run_threads(caller, caller_count: int, builder, builder_count: int) -> None:
    run_on_threads(
        *(functools.partial(caller, seed) for seed in range(caller_count)),
        *(functools.partial(builder, 100 + seed) for seed in range(builder_count)),
        timeout=CONCURRENCY_SECONDS + 60,
    )


def test_a_new_object_never_replays_the_trace_of_a_freed_one():
    """MLX keeps one compile cache per thread, and freeing an object erases
    its traces from the freeing thread's cache only. One thread builds,
    first-calls and frees objects (two epsilons, alternating slots of a
    small pool) while a long-lived thread calls whatever is in the pool. If
    a new object's graphs got a freed object's compile ids, the long-lived
    thread would replay the freed object's trace, epsilon included."""
    deadline = time.monotonic() + CONCURRENCY_SECONDS / 2
    builder_epsilons = (3e-3, 3e-5)
    pool_lock = threading.Lock()
    pool = [(eps, make_norm(eps)) for eps in builder_epsilons]
    inputs = small_heads(11)
    counts = {"calls": 0, "frees": 0}

    def caller(seed: int) -> None:
        call_from_the_pool(seed, deadline, pool, pool_lock, [inputs], builder_epsilons, counts,
                           "long-lived caller")

    def builder(seed: int) -> None:
        chooser = random.Random(seed)
        while time.monotonic() < deadline:
            eps = chooser.choice(builder_epsilons)
            norm = make_norm(eps)
            check_call(norm, eps, inputs, builder_epsilons, "builder")
            with pool_lock:
                pool[chooser.randrange(len(pool))] = (eps, norm)
            del norm  # the replaced object is freed here, on this thread
            counts["frees"] += 1

    run_threads(caller, 1, builder, 1)
    print(f"1 long-lived caller, 1 builder: {counts}")
    assert counts["frees"] >= 20, counts
