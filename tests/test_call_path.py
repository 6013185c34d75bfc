"""The one path from Python to MLX and back: no Python object crashes the
process, a failure's report travels with the call that failed, and every
failure reads ``[operation] message`` with a documented type.

Each test here pins a failure seen before: a segfault on an uninitialized
``mx.array``, errors blanked by a finalizer running between a failing call
and the read of its report, bare ``std::bad_cast`` for numpy byte orders
MLX does not hold, and messages in three formats.
"""

from __future__ import annotations

import gc
import re

import mlx.core as mx
import numpy as np
import pytest
from conftest import assert_bit_identical
from isolated_process import describe, run_python

from mlx_dualnorm import (
    CompiledDualHeadNorm,
    DualHeadNormValueError,
    MlxCError,
    composed_dual_head_norm,
)
from mlx_dualnorm.dual_head_norm import DUAL_HEAD_NORM_OPERATION as OPERATION

# The labels of errors the C side raises itself.
APPLY_OPERATION = "dual_head_norm"
COMPILE_OPERATION = "dual_head_norm"

MLX_MESSAGE_FORM = re.compile(r"^\[[^\]]+\] \S")
POSITIONS = ("queries", "keys", "query_weight", "key_weight")


def call_with(norm: CompiledDualHeadNorm, position: str, value: object):
    arguments = {"queries": mx.ones((2, 8)), "keys": mx.ones((2, 8))}
    arguments[position] = value
    return norm(**arguments)


@pytest.mark.parametrize("position", POSITIONS)
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


class CyclicGarbage:
    """An unreachable cycle holding an open norm: only the cyclic garbage
    collector frees it, running its finalizer (close, then free) at
    whatever allocation triggers a collection."""

    def __init__(self) -> None:
        self.norm = CompiledDualHeadNorm(1e-5)
        self.cycle = self


def test_a_finalizer_between_failure_and_raise_cannot_blank_the_error():
    """With a collection at almost every allocation, finalizers of cyclic
    garbage norms run between any two bytecodes. Every failing call must
    still raise its own error, whole."""
    norm = CompiledDualHeadNorm(1e-6)
    short_weight = mx.ones((3,))
    previous_threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        for attempt in range(3000):
            CyclicGarbage()
            with pytest.raises(DualHeadNormValueError) as raised:
                norm(mx.ones((2, 8)), mx.ones((2, 8)), short_weight)
            assert raised.value.operation == APPLY_OPERATION, attempt
            assert "has 3 elements" in raised.value.description, attempt
            CyclicGarbage()
            with pytest.raises(DualHeadNormValueError) as raised:
                CompiledDualHeadNorm(-1.0)
            assert raised.value.operation == COMPILE_OPERATION, attempt
    finally:
        gc.set_threshold(*previous_threshold)
        gc.collect()


@pytest.mark.parametrize("dtype", [">f4", ">f2", ">f8", "<f4"])
def test_numpy_arrays_of_either_byte_order_are_converted(dtype):
    values = np.random.default_rng(0).standard_normal((3, 16)).astype(dtype)
    norm = CompiledDualHeadNorm(1e-6)
    outputs = norm(values, values)
    native = mx.array(values.astype(values.dtype.newbyteorder("=")))
    expected = composed_dual_head_norm(native, native, eps=1e-6)
    assert_bit_identical(outputs[0], expected[0])
    assert_bit_identical(outputs[1], expected[1])


def test_a_big_endian_integer_array_is_rejected_as_rms_norm_would():
    """Converted like any numpy array (no std::bad_cast), then refused for
    its dtype, as mx.fast.rms_norm refuses int32."""
    with pytest.raises(DualHeadNormValueError, match="unsupported dtype int32"):
        CompiledDualHeadNorm(1e-6)(np.ones((2, 8), ">i4"), mx.ones((2, 8)))


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("dtype", [np.longdouble, np.clongdouble, "U3", object])
def test_numpy_dtypes_mlx_cannot_hold_are_a_clear_type_error(position, dtype):
    norm = CompiledDualHeadNorm(1e-6)
    size = 8 if position.endswith("weight") else (2, 8)
    with pytest.raises(TypeError, match=rf"^\[{OPERATION}\] {position} has numpy dtype"):
        call_with(norm, position, np.zeros(size, dtype=dtype))


def test_the_converters_type_error_reaches_the_caller_unchanged():
    norm = CompiledDualHeadNorm(1e-6)
    with pytest.raises(TypeError) as raised:
        norm([[1.0, 2.0]], mx.ones((2, 8)))
    assert str(raised.value) == (
        f"[{OPERATION}] queries must be an mlx.core.array or numpy.ndarray, not list"
    )


def failures():
    """One of every kind of failure the facade can raise, with the type it
    must raise."""
    norm = CompiledDualHeadNorm(1e-6)
    closed = CompiledDualHeadNorm(1e-6)
    closed.close()
    ones = mx.ones((2, 8))
    cases = [
        (lambda: norm(ones, ones, mx.ones((3,))), DualHeadNormValueError),
        (lambda: norm(mx.array(1.0), ones), DualHeadNormValueError),
        (lambda: norm(ones.astype(mx.int32), ones), DualHeadNormValueError),
        (lambda: norm("queries", ones), TypeError),
        (lambda: norm(ones, ones, stream="cpu"), TypeError),
        (lambda: closed(ones, ones), DualHeadNormValueError),
        (lambda: CompiledDualHeadNorm(1e-6, mode="fusd"), DualHeadNormValueError),
        (lambda: CompiledDualHeadNorm(1e-6, mode=3), TypeError),
        (lambda: CompiledDualHeadNorm("1e-6"), TypeError),
        (lambda: CompiledDualHeadNorm(-1e-50), DualHeadNormValueError),
        (lambda: CompiledDualHeadNorm(10**400), DualHeadNormValueError),
        (lambda: composed_dual_head_norm(ones, ones, eps="x"), TypeError),
    ]
    if not mx.is_available(mx.gpu):
        cases.append((lambda: norm(ones, ones, stream=mx.gpu), DualHeadNormValueError))
        cases.append((lambda: CompiledDualHeadNorm(1e-6, mode="fused"), DualHeadNormValueError))
    return cases


def test_every_failure_has_a_documented_type_and_the_mlx_message_form():
    for index, (call, expected_type) in enumerate(failures()):
        with pytest.raises(Exception) as raised:
            call()
        assert type(raised.value) is expected_type, (index, raised.value)
        assert MLX_MESSAGE_FORM.match(str(raised.value)), (index, str(raised.value))
        if isinstance(raised.value, MlxCError):
            assert str(raised.value) == (
                f"[{raised.value.operation}] {raised.value.description}"
            )


@pytest.mark.skipif(mx.is_available(mx.gpu), reason="needs a CPU-only MLX")
def test_a_gpu_stream_on_a_cpu_only_mlx_names_the_call_and_keeps_mlxs_reason():
    norm = CompiledDualHeadNorm(1e-6)
    with pytest.raises(DualHeadNormValueError) as raised:
        norm(mx.ones((2, 8)), mx.ones((2, 8)), stream=mx.gpu)
    assert raised.value.operation == OPERATION
    assert "Cannot get gpu stream without gpu backend" in raised.value.description
    outputs = norm(mx.ones((2, 8)), mx.ones((2, 8)), stream=mx.cpu)  # still usable
    mx.eval(outputs)
