"""Misuse of the objects themselves gets a clear exception, never a crash
or a silently wrong result: re-initializing a live object (from another
thread too), copying, pickling, and objects never initialized: the
package's own made without ``__init__``, and MLX arrays that hold no
array (a crash of the process once). Bad arguments are test_bad_input.py's."""

from __future__ import annotations

import copy
import pickle

import mlx.core as mx
import pytest

from helpers.bit_parity import assert_bit_identical
from helpers.isolated_process import describe, run_python
from mlx_dualnorm import (
    CompiledDualHeadNorm,
    CompiledDualHeadNormRope,
    DualHeadNormValueError,
    composed_dual_head_norm,
    composed_dual_head_norm_rope,
)

ROPE_CONSTANTS = {"base": 10_000.0, "traditional": False, "scale": 1.0}


def norm_object():
    return CompiledDualHeadNorm(1e-5, mode="compiled")


def norm_rope_object():
    return CompiledDualHeadNormRope(1e-5, 16, **ROPE_CONSTANTS, mode="compiled")


def heads(shape=(1, 1, 4, 32), seed=0):
    return mx.random.normal(shape, key=mx.random.key(seed))


def assert_computes_its_reference(composite):
    queries, keys = heads(seed=1), heads(seed=2)
    if isinstance(composite, CompiledDualHeadNormRope):
        expected = composed_dual_head_norm_rope(
            queries, keys, eps=1e-5, dims=16, **ROPE_CONSTANTS, offset=3
        )
        actual = composite(queries, keys, offset=3)
    else:
        expected = composed_dual_head_norm(queries, keys, eps=1e-5)
        actual = composite(queries, keys)
    for a, e in zip(actual, expected):
        assert_bit_identical(a, e)


# ---- Re-initialization ---------------------------------------------------------


@pytest.mark.parametrize(
    "make, again",
    [
        (norm_object, lambda o: o.__init__(1e-6)),
        (norm_rope_object, lambda o: o.__init__(1e-6, 16, base=1e4)),
    ],
)
def test_reinitializing_a_live_object_is_refused_and_changes_nothing(make, again):
    composite = make()
    with pytest.raises(TypeError, match=r"^\[.+\] this .+ is already initialized"):
        again(composite)
    assert composite.eps == pytest.approx(1e-5)
    assert_computes_its_reference(composite)


REINITIALIZE_DURING_CALLS = """
import threading, numpy as np
from mlx_dualnorm import CompiledDualHeadNorm, CompiledDualHeadNormRope

composite = {make}
stop = threading.Event()
refused = 0

def reinitialize():
    global refused
    while not stop.is_set():
        try:
            composite.__init__({again})
        except TypeError:
            refused += 1

queries = np.ones((1, 1, 4, 32), np.float32)
weight = np.ones((32,), np.float32)
thread = threading.Thread(target=reinitialize)
thread.start()
calls = 0
try:
    for _ in range({calls}):
        # Converting each numpy argument runs Python: the other thread runs then.
        composite(queries, queries, weight, weight{offset})
        calls += 1
finally:
    stop.set()
    thread.join()
print("calls", calls, "refused", refused)
"""


@pytest.mark.parametrize(
    "make, again, offset",
    [
        ("CompiledDualHeadNorm(1e-6, mode='compiled')", "1e-6", ""),
        (
            "CompiledDualHeadNormRope(1e-6, 16, base=1e4, mode='compiled')",
            "1e-6, 16, base=1e4",
            ", offset=np.int64(3)",
        ),
    ],
)
def test_reinitializing_from_another_thread_mid_call_neither_crashes_nor_closes(
    make, again, offset
):
    """One thread re-runs ``__init__`` in a loop while another calls with
    numpy arguments: every call succeeds (nothing is freed or closed under
    it) and every re-initialization is refused."""
    calls = 3000
    finished = run_python(
        REINITIALIZE_DURING_CALLS.format(make=make, again=again, offset=offset, calls=calls),
        env_overrides={"MALLOC_PERTURB_": "165"},
    )
    assert finished.returncode == 0, describe(finished)
    words = finished.stdout.split()
    assert words[:2] == ["calls", str(calls)], describe(finished)
    assert int(words[3]) > 0, "the other thread never ran during the calls"


# ---- Copies and pickles -----------------------------------------------------------


@pytest.mark.parametrize("make", [norm_object, norm_rope_object])
@pytest.mark.parametrize(
    "duplicate",
    [copy.copy, copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))],
    ids=["copy", "deepcopy", "pickle"],
)
def test_copies_and_pickles_are_new_independent_objects(make, duplicate):
    original = make()
    duplicate_object = duplicate(original)
    assert type(duplicate_object) is type(original)
    assert duplicate_object is not original
    assert repr(duplicate_object) == repr(original)
    original.close()  # closing one leaves the other working
    assert_computes_its_reference(duplicate_object)
    with pytest.raises(DualHeadNormValueError, match="closed"):
        assert_computes_its_reference(original)


# ---- Objects never initialized -------------------------------------------------------


@pytest.mark.parametrize("cls", [CompiledDualHeadNorm, CompiledDualHeadNormRope])
@pytest.mark.parametrize(
    "use",
    [
        lambda o: o(heads(), heads()),
        lambda o: o.close(),
        lambda o: o.eps,
        lambda o: o.mode,
        lambda o: o.__enter__(),
        lambda o: copy.copy(o),
    ],
    ids=["call", "close", "eps", "mode", "with", "copy"],
)
def test_an_object_never_initialized_says_so(cls, use):
    uninitialized = cls.__new__(cls)
    assert repr(uninitialized) == f"{cls.__name__}(<uninitialized>)"
    with pytest.raises(TypeError, match=r"^\[.+\] this .+ was never initialized"):
        use(uninitialized)


# The label of errors the C side raises itself.
APPLY_OPERATION = "dual_head_norm"


@pytest.mark.parametrize("position", ["queries", "keys", "query_weight", "key_weight"])
def test_an_uninitialized_array_is_a_type_error_not_a_crash(position):
    """``mx.array.__new__(mx.array)`` holds no array: reading it crashed the
    process. Run in a fresh interpreter so a regression fails this test
    rather than the whole run."""
    process = run_python(
        f"""
        import mlx.core as mx
        from mlx_dualnorm import CompiledDualHeadNorm
        arguments = {{"queries": mx.ones((2, 8)), "keys": mx.ones((2, 8))}}
        arguments[{position!r}] = mx.array.__new__(mx.array)
        try:
            CompiledDualHeadNorm(1e-6)(**arguments)
        except TypeError as error:
            print("raised", error)
        """
    )
    assert process.returncode == 0, describe(process)
    assert f"raised [{APPLY_OPERATION}] {position} is an mlx.core.array that was never" \
        in process.stdout, describe(process)


def test_a_subclass_that_skips_init_is_a_type_error_and_a_proper_one_works():
    class SkipsInit(mx.array):
        def __init__(self) -> None:  # never calls mx.array.__init__
            pass

    class Proper(mx.array):
        pass

    norm = CompiledDualHeadNorm(1e-6)
    with pytest.raises(TypeError, match="never initialized"):
        norm(SkipsInit(), mx.ones((2, 8)))
    values = mx.random.normal((2, 8), key=mx.random.key(1))
    outputs = norm(Proper(values), values)
    expected = composed_dual_head_norm(values, values, eps=1e-6)
    assert_bit_identical(outputs[0], expected[0])
    assert_bit_identical(outputs[1], expected[1])
