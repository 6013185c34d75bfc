"""CompiledDualHeadNormRope: bit parity with the composed q/k prework of a
full-attention layer (rms_norm, transpose, rope for queries and keys), the
constants contract, bad input, close, and memory over many calls."""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools

import mlx.core as mx
import numpy as np
import pytest
from helpers.bit_parity import assert_bit_identical, assert_transforms_agree, graph_primitives
from helpers.memory import resident_set_kib
from helpers.threads import WorkerThread, run_on_threads

from mlx_dualnorm import (
    CompiledDualHeadNormRope,
    DualHeadNormValueError,
    available_modes,
    composed_dual_head_norm_rope,
)
from mlx_dualnorm.bits import count_bit_differences
from mlx_dualnorm._native import ffi, lib

DTYPES = (mx.bfloat16, mx.float16, mx.float32)
WIDTHS = (64, 128, 256)
# Ints, an mx.array already computed (in the fused mode, its value is read
# on the host and passed as a kernel parameter), and one still lazy when
# the call is made (read by the kernel).
OFFSETS = (0, 7, 4096, "array", "lazy array")


def rope_offset_of(offset):
    if offset == "array":
        return mx.array(11, dtype=mx.int32)
    if offset == "lazy array":
        return mx.array(5, dtype=mx.int32) + 6
    return offset
# "fused" where this build and MLX have the CUDA kernel and a GPU.
FUSED_AVAILABLE = "fused" in available_modes()
MODES = ("compiled", "composed") + (("fused",) if FUSED_AVAILABLE else ())
# What "auto" resolves to here.
AUTO_MODE = "fused" if FUSED_AVAILABLE else "compiled"


def random_inputs(shape_queries, shape_keys, dtype, seed, weighted=True):
    keys_of = mx.random.split(mx.random.key(seed), 4)
    width = shape_queries[-1]
    queries = (3 * mx.random.normal(shape_queries, key=keys_of[0])).astype(dtype)
    keys = mx.random.normal(shape_keys, key=keys_of[1]).astype(dtype)
    query_weight = mx.random.normal((width,), key=keys_of[2]).astype(dtype) if weighted else None
    key_weight = mx.random.normal((width,), key=keys_of[3]).astype(dtype) if weighted else None
    return queries, keys, query_weight, key_weight


def assert_matches_composed(outputs, inputs, *, eps, dims, base, traditional, scale, offset,
                            context=""):
    assert isinstance(outputs, tuple) and len(outputs) == 2, outputs
    expected = composed_dual_head_norm_rope(
        *inputs, eps=eps, dims=dims, base=base, traditional=traditional, scale=scale,
        offset=offset,
    )
    for side, actual, reference in zip(("queries", "keys"), outputs, expected):
        try:
            assert_bit_identical(actual, reference)
        except AssertionError as failure:
            raise AssertionError(f"{context} {side}: {failure}") from None


# ---- Bit parity -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", WIDTHS)
def test_bit_identical_to_the_composed_path(dtype, width):
    """Every combination of partial rotary, traditional, base, scale,
    offset (ints, a computed and a lazy mx.array), sequence length 1 and 5, weights or
    none, with 4 query and 2 key heads (compiled route) and every mode
    available here (the fused kernel on a CUDA GPU)."""
    cases = itertools.product(
        (width, width // 4), (False, True), (1e4, 1e6), (1.0, 0.25), OFFSETS, (1, 5),
        (True, False),
    )
    objects = {}
    for seed, (dims, traditional, base, scale, offset, length, weighted) in enumerate(cases):
        inputs = random_inputs((1, length, 4, width), (1, length, 2, width), dtype, seed, weighted)
        for mode in MODES:
            rope_offset = rope_offset_of(offset)
            constants = (dims, traditional, base, scale, mode)
            if constants not in objects:
                objects[constants] = CompiledDualHeadNormRope(
                    1e-6, dims, base=base, traditional=traditional, scale=scale, mode=mode
                )
            outputs = objects[constants](*inputs, offset=rope_offset)
            assert outputs[0].shape == (1, 4, length, width)
            assert outputs[1].shape == (1, 2, length, width)
            assert_matches_composed(
                outputs, inputs, eps=1e-6, dims=dims, base=base, traditional=traditional,
                scale=scale, offset=rope_offset,
                context=f"{mode} dims={dims} trad={traditional} base={base} scale={scale} "
                f"offset={offset} L={length} weighted={weighted}",
            )


@pytest.mark.parametrize(
    "query_shape, key_shape",
    [
        ((1, 1, 16, 128), (1, 1, 8, 128)),  # Qwen3 decode
        ((1, 1, 16, 256), (1, 1, 2, 256)),  # Qwen3-Next full attention
        ((1, 37, 16, 128), (1, 37, 8, 128)),  # prefill: the plain builder
        ((3, 2, 4, 64), (3, 2, 1, 64)),
    ],
)
def test_decode_and_prefill_shapes(query_shape, key_shape):
    norm_rope = CompiledDualHeadNormRope(1e-6, query_shape[-1], base=1e6)
    inputs = random_inputs(query_shape, key_shape, mx.bfloat16, 1)
    for offset in (0, 1, 2, 4096, 4097):  # a decode walk replays one trace
        outputs = norm_rope(*inputs, offset=offset)
        assert_matches_composed(outputs, inputs, eps=1e-6, dims=query_shape[-1], base=1e6,
                                traditional=False, scale=1.0, offset=offset)


@pytest.mark.parametrize(
    "query_shape, key_shape, compiled",
    [
        ((1, 1, 96, 128), (1, 1, 8, 128), True),  # GLM-4.5 decode
        ((1, 1, 120, 128), (1, 1, 8, 128), True),  # 16384 elements: the bound
        ((1, 1, 120, 128), (1, 1, 9, 128), False),  # one row past it
        ((2, 1, 96, 128), (2, 1, 8, 128), False),  # GLM-4.5 decode at batch 2
    ],
)
def test_partial_rotary_decode_shapes_around_the_compiled_bound(query_shape, key_shape, compiled):
    """Many heads, half the head width rotated, on both sides of the
    element count up to which calls replay the compiled graph (whose
    outputs, on the CPU, come from MLX's fused Compiled primitives; on the
    GPU rms_norm and rope are primitives of their own, so the route leaves
    no mark) instead of building the composed ops: the composed bits
    either way."""
    norm_rope = CompiledDualHeadNormRope(1e-5, 64, base=1e6, mode="compiled")
    inputs = random_inputs(query_shape, key_shape, mx.bfloat16, 3)
    mx.eval(*(array for array in inputs if array is not None))
    for offset in (0, 12, 13, 4097):
        outputs = norm_rope(*inputs, offset=offset)
        if mx.default_device() == mx.cpu:
            fused = any(name.startswith("Compiled") for name in graph_primitives(*outputs))
            assert fused is compiled, f"{query_shape} {key_shape}: compiled graph {fused}"
        assert_matches_composed(outputs, inputs, eps=1e-5, dims=64, base=1e6,
                                traditional=False, scale=1.0, offset=offset,
                                context=f"{query_shape} {key_shape} offset={offset}")


def test_offsets_as_mlx_rope_takes_them():
    """Ints beyond int32, numpy integers, integer arrays of any width and
    per-batch offset vectors give rope's own results."""
    norm_rope = CompiledDualHeadNormRope(1e-5, 64, base=1e4, traditional=True)
    inputs = random_inputs((2, 3, 4, 64), (2, 3, 2, 64), mx.float32, 2)
    for offset in (-5, 2**31 - 1, 2**31, -(2**31) - 1, np.int64(9), np.array(12),
                   mx.array(3, dtype=mx.uint8), mx.array(2**40, dtype=mx.int64),
                   mx.array([5, 900], dtype=mx.int32), mx.array([1, 2], dtype=mx.int16)):
        outputs = norm_rope(*inputs, offset=offset)
        assert_matches_composed(outputs, inputs, eps=1e-5, dims=64, base=1e4, traditional=True,
                                scale=1.0, offset=offset, context=repr(offset))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch, length", [(1, 1), (1, 3), (2, 1), (2, 3)])
def test_negative_offsets(mode, batch, length):
    """MLX's RoPE turns the position into a float two ways (its one-row
    kernel for B == 1 and L == 1 from the signed offset, its general
    kernel from the unsigned sum of position and offset); negative offsets
    tell them apart, and every mode must follow MLX's choice."""
    inputs = random_inputs((batch, length, 4, 64), (batch, length, 2, 64), mx.bfloat16, 12)
    norm_rope = CompiledDualHeadNormRope(1e-6, 64, base=1e4, mode=mode)
    for offset in (-1, -7, mx.array([-3] * batch, dtype=mx.int32)):
        outputs = norm_rope(*inputs, offset=offset)
        assert_matches_composed(outputs, inputs, eps=1e-6, dims=64, base=1e4, traditional=False,
                                scale=1.0, offset=offset, context=f"{mode} offset={offset}")


def test_strided_views_and_mixed_layouts():
    """Qwen3-Next's queries are a split view of the projection; a query
    weight without a key weight and the reverse take their own graphs."""
    projection = mx.random.normal((1, 1, 16, 512), key=mx.random.key(4)).astype(mx.bfloat16)
    queries, _gate = mx.split(projection, 2, axis=-1)
    keys = mx.random.normal((1, 1, 2, 256), key=mx.random.key(5)).astype(mx.bfloat16)
    weight = mx.random.normal((256,), key=mx.random.key(6)).astype(mx.bfloat16)
    norm_rope = CompiledDualHeadNormRope(1e-6, 64, base=1e7)
    for query_weight, key_weight in ((weight, None), (None, weight), (weight, weight)):
        inputs = (queries, keys, query_weight, key_weight)
        outputs = norm_rope(*inputs, offset=33)
        assert_matches_composed(outputs, inputs, eps=1e-6, dims=64, base=1e7, traditional=False,
                                scale=1.0, offset=33)


def test_mixed_dtypes_promote_as_rms_norm_does():
    queries, keys, _, _ = random_inputs((1, 1, 4, 64), (1, 1, 2, 64), mx.bfloat16, 7)
    float32_weight = mx.ones((64,), dtype=mx.float32) * 1.5
    norm_rope = CompiledDualHeadNormRope(1e-6, 64, base=1e4)
    inputs = (queries, keys.astype(mx.float16), float32_weight, None)
    outputs = norm_rope(*inputs)
    assert outputs[0].dtype == mx.float32 and outputs[1].dtype == mx.float16
    assert_matches_composed(outputs, inputs, eps=1e-6, dims=64, base=1e4, traditional=False,
                            scale=1.0, offset=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("empty_axis", [0, 1, 2])
def test_empty_inputs(mode, empty_axis):
    shape = [2, 3, 4, 64]
    shape[empty_axis] = 0
    inputs = random_inputs(tuple(shape), tuple(shape), mx.float32, 8)
    offset = 5
    outputs = CompiledDualHeadNormRope(1e-6, 32, base=1e4, mode=mode)(*inputs, offset=offset)
    assert_matches_composed(outputs, inputs, eps=1e-6, dims=32, base=1e4, traditional=False,
                            scale=1.0, offset=offset)


def test_numpy_inputs_are_accepted():
    inputs = random_inputs((1, 2, 4, 64), (1, 2, 2, 64), mx.float32, 9)
    numpy_inputs = tuple(np.array(array) for array in inputs)
    outputs = CompiledDualHeadNormRope(1e-6, 64, base=1e4)(*numpy_inputs, offset=3)
    assert_matches_composed(outputs, inputs, eps=1e-6, dims=64, base=1e4, traditional=False,
                            scale=1.0, offset=3)


def test_stream_argument():
    inputs = random_inputs((1, 1, 4, 64), (1, 1, 2, 64), mx.float32, 10)
    outputs = CompiledDualHeadNormRope(1e-6, 64, base=1e4)(*inputs, offset=2, stream=mx.cpu)
    # The reference on the same stream: MLX's CPU and GPU RoPE differ in bits.
    with mx.stream(mx.cpu):
        assert_matches_composed(outputs, inputs, eps=1e-6, dims=64, base=1e4,
                                traditional=False, scale=1.0, offset=2)


# ---- The constants contract -------------------------------------------------------

# Objects that differ in exactly one constant each, so an output computed
# with any other object's constants is told apart.
CONTRACT_CONSTANTS = (
    dict(eps=1e-2, dims=64, base=1e4, traditional=False, scale=1.0),
    dict(eps=1e-4, dims=64, base=1e4, traditional=False, scale=1.0),
    dict(eps=1e-2, dims=32, base=1e4, traditional=False, scale=1.0),
    dict(eps=1e-2, dims=64, base=1e6, traditional=False, scale=1.0),
    dict(eps=1e-2, dims=64, base=1e4, traditional=True, scale=1.0),
    dict(eps=1e-2, dims=64, base=1e4, traditional=False, scale=0.25),
)


def contract_inputs(dtype, seed):
    # Small values, so that eps dominates the mean square and shows.
    queries, keys, query_weight, key_weight = random_inputs(
        (1, 2, 4, 64), (1, 2, 2, 64), mx.float32, seed
    )
    return (
        (queries * 1e-2).astype(dtype), (keys * 1e-2).astype(dtype),
        query_weight.astype(dtype), key_weight.astype(dtype),
    )


def assert_used_own_constants(outputs, inputs, own, offset, context):
    assert_matches_composed(outputs, inputs, offset=offset, context=context, **own)
    for other in CONTRACT_CONSTANTS:
        if other == own:
            continue
        wrong = composed_dual_head_norm_rope(*inputs, offset=offset, **other)
        differing = sum(count_bit_differences(a, w) for a, w in zip(outputs, wrong))
        assert differing > 0, f"{context}: {own} gave the output of {other}"


def new_contract_object(constants, mode="compiled"):
    return CompiledDualHeadNormRope(
        constants["eps"], constants["dims"], base=constants["base"],
        traditional=constants["traditional"], scale=constants["scale"], mode=mode,
    )


@pytest.mark.parametrize("mode", MODES)
def test_every_trace_uses_its_own_objects_constants(mode):
    """Objects first called in every order, then retraced by a dtype change
    and a shape change right after another object's call."""
    objects = [new_contract_object(constants, mode) for constants in CONTRACT_CONSTANTS]
    order = list(range(len(objects)))
    for round_index, dtype in enumerate((mx.float32, mx.bfloat16, mx.float16, mx.float32)):
        inputs = contract_inputs(dtype, round_index)
        order = order[::-1] if round_index % 2 else order[1:] + order[:1]
        for index in order:
            offset = 3 + index
            outputs = objects[index](*inputs, offset=offset)
            assert_used_own_constants(outputs, inputs, CONTRACT_CONSTANTS[index], offset,
                                      f"{mode} round {round_index} object {index}")


def test_interleaved_threads_use_their_own_objects_constants():
    """Six objects shared by four threads, each calling them in its own
    order over three dtypes (each thread traces anew: MLX's compile cache is
    per thread); every output checked afterwards."""
    objects = [new_contract_object(constants) for constants in CONTRACT_CONSTANTS]
    inputs_of = {dtype: contract_inputs(dtype, 11) for dtype in DTYPES}
    mx.eval(inputs_of)
    results = []

    def worker(thread_index):
        for step in range(36):
            index = (step * (thread_index + 1) + thread_index) % len(objects)
            dtype = DTYPES[(step + thread_index) % len(DTYPES)]
            outputs = objects[index](*inputs_of[dtype], offset=step)
            mx.eval(outputs)
            results.append((index, dtype, step, outputs))

    run_on_threads(*(functools.partial(worker, index) for index in range(4)), together=True)
    assert len(results) == 4 * 36
    for index, dtype, step, outputs in results:
        assert_used_own_constants(outputs, inputs_of[dtype], CONTRACT_CONSTANTS[index], step,
                                  f"thread call object {index} {dtype} offset {step}")


def test_a_closed_object_does_not_disturb_the_others():
    inputs = contract_inputs(mx.float32, 12)
    first, second = (new_contract_object(constants) for constants in CONTRACT_CONSTANTS[:2])
    first(*inputs)
    second(*inputs)
    first.close()
    replacement = new_contract_object(CONTRACT_CONSTANTS[2])
    for norm_rope, constants in ((second, CONTRACT_CONSTANTS[1]),
                                 (replacement, CONTRACT_CONSTANTS[2])):
        assert_used_own_constants(norm_rope(*inputs, offset=4), inputs, constants, 4, "after close")


# ---- Bad input --------------------------------------------------------------------


def _good():
    return random_inputs((1, 2, 4, 64), (1, 2, 2, 64), mx.float32, 13)


def _with(index, value):
    inputs = list(_good())
    inputs[index] = value
    return tuple(inputs)


# name -> (inputs, offset, message); each one mx.fast.rms_norm, the
# transpose or mx.fast.rope rejects as well.
BAD_CALLS = {
    "queries_rank_3": (lambda: _with(0, mx.ones((2, 4, 64))), 0, "queries must have 4 dim"),
    "keys_rank_5": (lambda: _with(1, mx.ones((1, 1, 2, 2, 64))), 0, "keys must have 4 dim"),
    "scalar_queries": (lambda: _with(0, mx.array(1.0)), 0, "at least 1 dimension"),
    "short_weight": (lambda: _with(2, mx.ones((32,))), 0, "query_weight has 32 elements"),
    "matrix_weight": (lambda: _with(3, mx.ones((2, 64))), 0, "key_weight must have 1"),
    "integer_queries": (
        lambda: (mx.ones((1, 2, 4, 64), mx.int32), _good()[1], None, None), 0, "dtype int32"
    ),
    "complex_keys": (lambda: _with(1, mx.ones((1, 2, 2, 64), mx.complex64)), 0, "complex64"),
    "float_offset": (_good, mx.array(1.5), "offset must be an integer but has dtype float32"),
    "python_float_offset": (_good, 1.5, "offset must be an integer"),
    "bool_offset": (_good, True, "offset must be an integer but has dtype bool"),
    "matrix_offset": (_good, mx.zeros((1, 1), mx.int32), "at most 1 dimension"),
    "offset_per_wrong_batch": (_good, mx.array([1, 2], mx.int32), "one element per batch"),
    "dims_past_width": (lambda: _with(1, mx.ones((1, 2, 2, 32))), 0, "must not exceed"),
}


def run_composed(inputs, offset, dims=64):
    return composed_dual_head_norm_rope(*inputs, eps=1e-6, dims=dims, base=1e4, offset=offset)


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
@pytest.mark.parametrize("mode", MODES)
def test_bad_calls_raise_what_the_composed_path_raises(case, mode):
    make_inputs, offset, message = BAD_CALLS[case]
    inputs = make_inputs()
    if case == "dims_past_width":
        inputs = (inputs[0], inputs[1], inputs[2], None)
    with pytest.raises(ValueError):
        mx.eval(run_composed(inputs, offset))
    norm_rope = CompiledDualHeadNormRope(1e-6, 64, base=1e4, mode=mode)
    with pytest.raises(DualHeadNormValueError, match=message) as raised:
        norm_rope(*inputs, offset=offset)
    assert str(raised.value).startswith("[dual_head_norm_rope] ")
    # The object still works after a refused call.
    good = _good()
    assert_matches_composed(norm_rope(*good), good, eps=1e-6, dims=64, base=1e4,
                            traditional=False, scale=1.0, offset=0)


@pytest.mark.parametrize(
    "arguments, error, message",
    [
        (dict(queries=[1.0]), TypeError, "queries must be an mlx.core.array or numpy"),
        (dict(key_weight="w"), TypeError, "key_weight must be an mlx.core.array"),
        (dict(offset="7"), TypeError, "offset must be an int or an mlx.core.array"),
        (dict(offset=None), TypeError, "offset must be an int"),
        (dict(offset=2**80), DualHeadNormValueError, "offset"),
        (dict(stream="cpu"), TypeError, "stream must be a stream"),
    ],
)
def test_wrong_argument_types(arguments, error, message):
    queries, keys, query_weight, key_weight = _good()
    call = dict(queries=queries, keys=keys, query_weight=query_weight, key_weight=key_weight)
    call.update(arguments)
    norm_rope = CompiledDualHeadNormRope(1e-6, 64, base=1e4)
    with pytest.raises(error, match=message) as raised:
        norm_rope(**call)
    assert str(raised.value).startswith("[dual_head_norm_rope] ")


@pytest.mark.parametrize(
    "arguments, error, message",
    [
        (dict(eps=-1e-6), DualHeadNormValueError, "eps must be finite, >= 0"),
        (dict(eps=float("nan")), DualHeadNormValueError, "eps must be finite"),
        (dict(eps=1e39), DualHeadNormValueError, "within float32's range"),
        (dict(eps="1e-6"), TypeError, "eps must be a real number"),
        (dict(dims=0), DualHeadNormValueError, "dims must be positive and even, got 0"),
        (dict(dims=-4), DualHeadNormValueError, "positive and even"),
        (dict(dims=63), DualHeadNormValueError, "positive and even, got 63"),
        (dict(dims=2**40), DualHeadNormValueError, "positive and even"),
        (dict(dims=64.0), TypeError, "dims must be an int"),
        (dict(dims=True), TypeError, "dims must be an int"),
        (dict(base="1e4"), TypeError, "base must be a real number"),
        (dict(scale=None), TypeError, "scale must be a real number"),
        (dict(traditional=1), TypeError, "traditional must be a bool"),
        *(() if FUSED_AVAILABLE else (
            (dict(mode="fused"), DualHeadNormValueError, "mode 'fused' needs a build with"),)),
        (dict(mode="fast"), DualHeadNormValueError, "mode must be one of"),
        (dict(mode=2), TypeError, "mode must be a str"),
    ],
)
def test_bad_constructor_arguments(arguments, error, message):
    call = dict(eps=1e-6, dims=64, base=1e4)
    call.update(arguments)
    with pytest.raises(error, match=message) as raised:
        CompiledDualHeadNormRope(call.pop("eps"), call.pop("dims"), **call)
    # One label, whether the Python checks or the C library's raised it.
    assert str(raised.value).startswith("[dual_head_norm_rope] ")


# Refused in the C library's argument checks, beside input_scale's.
@pytest.mark.parametrize("base", [float("nan"), float("inf"), -1e4, 0.0])
def test_a_base_that_is_not_finite_and_positive_is_refused_like_input_scale(base):
    with pytest.raises(DualHeadNormValueError, match=r"^\[dual_head_norm_rope\] base must be"):
        CompiledDualHeadNormRope(1e-6, 64, base=base)


def test_c_api_refuses_null_and_empty_handles():
    error = ffi.new("mlx_dualnorm_error *")
    empty = ffi.new("mlx_array *")[0]
    result = ffi.new("mlx_vector_array *")
    status = lib.mlx_dualnorm_dual_head_norm_rope_apply(
        result, ffi.NULL, empty, empty, empty, empty, empty, error
    )
    assert status == lib.MLX_DUALNORM_INVALID_ARGUMENT
    assert b"NULL" in ffi.string(error.description)
    created = ffi.new("mlx_dualnorm_dual_head_norm_rope **")
    rope = ffi.new("mlx_dualnorm_rope_parameters *", dict(dims=4, base=1e4, scale=1.0))
    assert lib.mlx_dualnorm_dual_head_norm_rope_new(created, 1e-6, rope[0], 0, error) == 0
    norm_rope = ffi.gc(created[0], lib.mlx_dualnorm_dual_head_norm_rope_free)
    status = lib.mlx_dualnorm_dual_head_norm_rope_apply(
        result, norm_rope, empty, empty, empty, empty, empty, error
    )
    assert status == lib.MLX_DUALNORM_INVALID_ARGUMENT
    assert ffi.string(error.description) == b"queries is an empty array handle"
    assert lib.mlx_dualnorm_dual_head_norm_rope_new(ffi.NULL, 1e-6, rope[0], 0, error) != 0
    assert lib.mlx_dualnorm_dual_head_norm_rope_close(ffi.NULL, error) != 0
    lib.mlx_dualnorm_dual_head_norm_rope_free(ffi.NULL)  # a no-op


# ---- Close, with, properties -------------------------------------------------------


def test_properties_and_repr():
    norm_rope = CompiledDualHeadNormRope(1e-6, 32, base=1e6, traditional=True, scale=0.25)
    assert norm_rope.eps == float(np.float32(1e-6))
    assert (norm_rope.dims, norm_rope.traditional, norm_rope.base, norm_rope.scale) == (
        32, True, 1e6, 0.25)
    assert norm_rope.mode == AUTO_MODE
    for mode in MODES:
        assert CompiledDualHeadNormRope(1e-6, 32, base=1e4, mode=mode).mode == mode
    assert repr(norm_rope) == (
        "CompiledDualHeadNormRope(eps=1e-06, dims=32, base=1000000.0, "
        f"traditional=True, scale=0.25, mode={AUTO_MODE!r})"
    )


def test_close_and_with():
    inputs = _good()
    with CompiledDualHeadNormRope(1e-6, 64, base=1e4) as norm_rope:
        mx.eval(norm_rope(*inputs))
    with pytest.raises(DualHeadNormValueError, match="is closed"):
        norm_rope(*inputs)
    norm_rope.close()  # twice is fine
    other = CompiledDualHeadNormRope(1e-6, 64, base=1e4)
    outputs = other(*inputs, offset=1)
    other.close()
    # Outputs made before the close stay valid.
    assert_matches_composed(outputs, inputs, eps=1e-6, dims=64, base=1e4, traditional=False,
                            scale=1.0, offset=1)


def test_close_on_another_thread_waits_for_no_one():
    norm_rope = CompiledDualHeadNormRope(1e-6, 64, base=1e4)
    inputs = _good()
    mx.eval(norm_rope(*inputs))
    run_on_threads(norm_rope.close, timeout=30)  # fails if the close never returns
    with pytest.raises(DualHeadNormValueError, match="is closed"):
        norm_rope(*inputs)


# ---- Memory --------------------------------------------------------------------------


def _decode_calls(norm_rope, inputs, calls):
    for step in range(calls):
        mx.eval(norm_rope(*inputs, offset=step))


def _memory_after(action):
    gc.collect()
    action()
    gc.collect()
    return mx.get_active_memory(), resident_set_kib()


def test_memory_stays_flat_over_many_calls():
    inputs = random_inputs((1, 1, 16, 128), (1, 1, 8, 128), mx.bfloat16, 14)
    mx.eval(inputs)
    norm_rope = CompiledDualHeadNormRope(1e-6, 128, base=1e6)
    active_before, rss_before = _memory_after(lambda: _decode_calls(norm_rope, inputs, 300))
    active_after, rss_after = _memory_after(lambda: _decode_calls(norm_rope, inputs, 6000))
    assert active_after == active_before
    assert rss_after - rss_before <= 2048


@pytest.mark.parametrize("caller_thread", [False, True], ids=["same_thread", "worker_calls"])
def test_memory_stays_flat_over_many_objects(caller_thread):
    """Objects built, traced and closed; with ``worker_calls`` the calls run
    on a long-lived worker thread and the objects are closed on this one,
    so their traces must be erased from the worker's cache."""
    inputs = random_inputs((1, 1, 16, 128), (1, 1, 8, 128), mx.bfloat16, 15)
    mx.eval(inputs)

    def churn(objects, worker):
        for index in range(objects):
            norm_rope = CompiledDualHeadNormRope(1e-6 * (1 + index % 3), 128, base=1e6)
            if worker:
                worker.call(functools.partial(_decode_calls, norm_rope, inputs, 3))
            else:
                _decode_calls(norm_rope, inputs, 3)
            norm_rope.close()

    # One worker thread for every call, as a server's generation thread.
    with WorkerThread() if caller_thread else contextlib.nullcontext() as worker:
        active_before, rss_before = _memory_after(lambda: churn(30, worker))
        active_after, rss_after = _memory_after(lambda: churn(300, worker))
    assert active_after == active_before
    assert rss_after - rss_before <= 2048



def test_lazy_outputs_keep_their_offset_when_the_next_call_changes_it():
    """The bridge reuses the scalar of an unchanged int offset and replaces
    it when the offset changes: outputs built before, still lazy, must keep
    the offset they were built with."""
    inputs = random_inputs((1, 1, 4, 64), (1, 1, 2, 64), mx.bfloat16, 11)
    norm_rope = CompiledDualHeadNormRope(1e-6, 64, base=1e4)
    offsets = (7, 7, 8, 7, 2**31 - 1, 0)
    lazy_outputs = [norm_rope(*inputs, offset=offset) for offset in offsets]
    for offset, outputs in zip(offsets, lazy_outputs):
        assert_matches_composed(outputs, inputs, eps=1e-6, dims=64, base=1e4,
                                traditional=False, scale=1.0, offset=offset,
                                context=f"offset {offset}")


@pytest.mark.parametrize("count", [1, 3])
def test_a_bridge_giving_other_than_two_outputs_is_an_mlx_error(monkeypatch, count):
    """As for the dual head norm: exactly two outputs or an MlxCError naming
    the operation. (The bridge is replaced here, MLX is not.)"""
    import mlx_dualnorm.dual_head_norm_rope as facade
    from mlx_dualnorm import MlxCError

    queries, keys, query_weight, key_weight = random_inputs(
        (1, 1, 4, 64), (1, 1, 2, 64), mx.float32, 5
    )
    monkeypatch.setattr(
        facade, "apply_compiled_dual_head_norm_rope", lambda *arguments: (queries,) * count
    )
    norm_rope = CompiledDualHeadNormRope(1e-6, 64, base=10_000.0, mode="compiled")
    expected = rf"^\[dual_head_norm_rope\] .*returned {count} outputs"
    with pytest.raises(MlxCError, match=expected):
        norm_rope(queries, keys, query_weight, key_weight)


# ---- Transforms ------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("transform", ["vjp", "jvp", "vmap", "compile"])
def test_transforms_give_the_composed_calls_bits(mode, transform):
    """Fine-tuning differentiates the prework, and users vmap it: reverse-
    and forward-mode derivatives (every input's, weights included), vmap
    and a user's mx.compile give the bits of the same transform of the
    composed calls. The
    fused node transforms the composed calls themselves; the compiled
    graph is theirs."""
    queries, keys, query_weight, key_weight = random_inputs(
        (2, 3, 4, 64), (2, 3, 2, 64), mx.float32, 9
    )
    primals = [queries, keys, query_weight, key_weight]
    norm = CompiledDualHeadNormRope(1e-5, 32, base=1e4, mode=mode)

    def ours(q, k, wq, wk):
        return list(norm(q, k, wq, wk, offset=5))

    def composed(q, k, wq, wk):
        return list(
            composed_dual_head_norm_rope(q, k, wq, wk, eps=1e-5, dims=32, base=1e4, offset=5)
        )

    # Two (B, L, H, D) problems stacked on a leading axis for vmap.
    stacked = [mx.stack([side, 0.5 * side]) for side in (queries, keys)]
    assert_transforms_agree(
        transform, ours, composed, primals, [*stacked, query_weight, key_weight]
    )
