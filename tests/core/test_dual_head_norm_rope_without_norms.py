"""CompiledDualHeadNormRope made with ``eps=None``: the RoPE (and the
KV-cache write) of attention without q/k norms, bit-identical to
``mx.fast.rope`` over the transposed inputs, in every mode and under
every transform; weights refused; the constants read back."""

from __future__ import annotations

import copy
import math
import pickle

import mlx.core as mx
import pytest
from helpers.bit_parity import assert_bit_identical, assert_transforms_agree, graph_primitives

from mlx_dualnorm import (
    CompiledDualHeadNormRope,
    DualHeadNormValueError,
    available_modes,
    composed_dual_head_norm_rope,
)
from mlx_dualnorm._native import ffi, lib

FUSED_AVAILABLE = "fused" in available_modes()
MODES = ("compiled", "composed") + (("fused",) if FUSED_AVAILABLE else ())
DTYPES = (mx.bfloat16, mx.float16, mx.float32)


def random(shape, dtype, seed):
    return (3 * mx.random.normal(shape, key=mx.random.key(seed))).astype(dtype)


def reference(queries, keys, offset, **rope):
    return composed_dual_head_norm_rope(queries, keys, norms=False, offset=offset, **rope)


# name -> (query shape, key shape, RoPE constants)
CASES = {
    "decode": ((1, 1, 8, 64), (1, 1, 2, 64), {"dims": 64, "base": 10000.0}),
    "decode-batch4": ((4, 1, 8, 128), (4, 1, 2, 128), {"dims": 128, "base": 500000.0}),
    "prefill": ((1, 37, 16, 64), (1, 37, 4, 64), {"dims": 64, "base": 10000.0}),
    "partial-traditional": (
        (2, 3, 4, 96), (2, 3, 4, 96), {"dims": 32, "base": 1e4, "traditional": True},
    ),
    "scaled-positions": ((1, 2, 4, 64), (1, 2, 1, 64), {"dims": 64, "base": 1e4, "scale": 0.25}),
}
OFFSETS = (0, 4095, "array", "per-batch")


def offset_of(name, batch):
    if name == "array":
        return mx.array(17, dtype=mx.int32)
    if name == "per-batch":
        return mx.arange(3, 3 + 5 * batch, 5, dtype=mx.int32)
    return name


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_rotates_as_mlx_rope_over_the_transposed_inputs(mode, dtype, case):
    query_shape, key_shape, rope = CASES[case]
    queries, keys = random(query_shape, dtype, 1), random(key_shape, dtype, 2)
    composite = CompiledDualHeadNormRope(None, mode=mode, **rope)
    for offset_name in OFFSETS:
        offset = offset_of(offset_name, query_shape[0])
        outputs = composite(queries, keys, offset=offset)
        expected = reference(queries, keys, offset, **rope)
        assert len(outputs) == 2
        for side, actual, wanted in zip(("queries", "keys"), outputs, expected):
            assert actual.shape == wanted.shape and actual.dtype == wanted.dtype, side
            assert_bit_identical(actual, wanted)


@pytest.mark.parametrize("mode", MODES)
def test_a_frequency_table_input_scale_and_strided_views(mode):
    """The scaled RoPEs of mlx-lm (a table, an input scale) and inputs that
    are views, as mlx-lm's projections may be."""
    table = mx.exp(mx.linspace(0.0, 9.0, 32))
    wide = random((2, 3, 8, 128), mx.bfloat16, 3)
    queries = wide[..., ::2]  # a strided view, (2, 3, 8, 64)
    keys = random((2, 4, 3, 64), mx.bfloat16, 4).transpose(0, 2, 1, 3)  # a transposed view
    composite = CompiledDualHeadNormRope(None, 64, base=None, input_scale=0.7, mode=mode)
    outputs = composite(queries, keys, offset=9, freqs=table)
    expected = reference(queries, keys, 9, dims=64, base=None, freqs=table, input_scale=0.7)
    for actual, wanted in zip(outputs, expected):
        assert_bit_identical(actual, wanted)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["contiguous", "heads sliced", "features strided"])
@pytest.mark.parametrize("batch, length", [(1, 1), (1, 3), (2, 1)])
def test_negative_offsets_follow_mlx_s_kernel_choice(mode, layout, batch, length):
    """MLX's RoPE turns the position into a float two ways: its one-row
    kernel (a row-contiguous input, B == 1 and L == 1) from the signed
    offset, its general kernel from the unsigned sum. Without norms RoPE
    reads the input itself, so a view (a head sliced out of a fused
    projection, as internlm2's keys are) takes the general kernel even at
    B == 1 and L == 1; negative offsets tell the two apart."""
    wide = random((batch, length, 4, 3, 128), mx.bfloat16, 21)
    queries = random((batch, length, 8, 64), mx.bfloat16, 22)
    if layout == "heads sliced":  # (B, L, 4, 64), a head's stride 3 * 128
        keys = wide[..., 1, :64]
    elif layout == "features strided":
        keys = wide[..., 0, ::2]
    else:
        keys = random((batch, length, 4, 64), mx.bfloat16, 23)
    composite = CompiledDualHeadNormRope(None, 64, base=1e4, mode=mode)
    for offset in (-1, -7, mx.array([-3] * batch, dtype=mx.int32)):
        outputs = composite(queries, keys, offset=offset)
        expected = reference(queries, keys, offset, dims=64, base=1e4)
        for actual, wanted in zip(outputs, expected):
            assert_bit_identical(actual, wanted)


def cache_inputs(batch, length, dtype, capacity=32):
    queries = random((batch, length, 8, 64), dtype, 5)
    keys = random((batch, length, 2, 64), dtype, 6)
    values = random((batch, length, 2, 64), dtype, 7)
    key_cache = random((batch, 2, capacity, 64), dtype, 8)
    value_cache = random((batch, 2, capacity, 64), dtype, 9)
    return queries, keys, values, key_cache, value_cache


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch, length, row", [(1, 1, 0), (1, 1, 31), (2, 1, 5), (1, 4, 10)])
def test_the_cache_write_gives_what_update_and_fetch_leaves(mode, dtype, batch, length, row):
    """mlx-lm's Llama decode step: rope of q and k at the offset, then
    ``KVCache.update_and_fetch``'s writes and the rows it returns."""
    queries, keys, values, key_cache, value_cache = cache_inputs(batch, length, dtype)
    composite = CompiledDualHeadNormRope(None, 64, base=10000.0, mode=mode)
    outputs = composite.apply_with_cache(
        queries, keys, values, key_cache=key_cache, value_cache=value_cache, offset=row,
        fetch=True,
    )
    rotated_queries, rotated_keys = reference(queries, keys, row, dims=64, base=10000.0)
    expected_keys, expected_values = copy.copy(key_cache), copy.copy(value_cache)
    expected_keys[..., row:row + length, :] = rotated_keys
    expected_values[..., row:row + length, :] = values.transpose(0, 2, 1, 3)
    expected = (
        rotated_queries, expected_keys, expected_values,
        expected_keys[..., : row + length, :], expected_values[..., : row + length, :],
    )
    assert len(outputs) == 5
    for actual, wanted in zip(outputs, expected):
        assert_bit_identical(actual, wanted)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("transform", ["vjp", "jvp", "vmap", "compile"])
def test_transforms_give_the_composed_calls_bits(mode, transform):
    queries, keys = random((2, 3, 4, 64), mx.float32, 10), random((2, 3, 2, 64), mx.float32, 11)
    composite = CompiledDualHeadNormRope(None, 32, base=1e4, mode=mode)

    # The helper's functions take (queries, keys, query_weight, key_weight):
    # here the "weights" are two more inputs the outputs depend on linearly,
    # so every primal has a tangent and a cotangent that matter.
    def ours(q, k, a, b):
        rotated = composite(q * a, k * b, offset=5)
        return list(rotated)

    def composed(q, k, a, b):
        return list(reference(q * a, k * b, 5, dims=32, base=1e4))

    scale_q, scale_k = random((64,), mx.float32, 12), random((64,), mx.float32, 13)
    stacked = [mx.stack([side, 0.5 * side]) for side in (queries, keys)]
    assert_transforms_agree(
        transform, ours, composed, [queries, keys, scale_q, scale_k],
        [*stacked, scale_q, scale_k],
    )


@pytest.mark.parametrize("mode", MODES)
def test_grad_through_the_cache_write(mode):
    """Fine-tuning through a cached step: gradients of queries, keys and
    values are the composed path's bits."""
    queries, keys, values, key_cache, value_cache = cache_inputs(1, 2, mx.float32)
    composite = CompiledDualHeadNormRope(None, 64, base=10000.0, mode=mode)

    def ours(q, k, v):
        outputs = composite.apply_with_cache(
            q, k, v, key_cache=key_cache, value_cache=value_cache, offset=3, fetch=True
        )
        return sum((output * output).sum() for output in outputs)

    def composed(q, k, v):
        rotated_queries, rotated_keys = reference(q, k, 3, dims=64, base=10000.0)
        written_keys, written_values = copy.copy(key_cache), copy.copy(value_cache)
        written_keys[..., 3:5, :] = rotated_keys
        written_values[..., 3:5, :] = v.transpose(0, 2, 1, 3)
        outputs = (rotated_queries, written_keys, written_values,
                   written_keys[..., :5, :], written_values[..., :5, :])
        return sum((output * output).sum() for output in outputs)

    actual = mx.grad(ours, argnums=(0, 1, 2))(queries, keys, values)
    expected = mx.grad(composed, argnums=(0, 1, 2))(queries, keys, values)
    for gradient, wanted in zip(actual, expected):
        assert_bit_identical(gradient, wanted)


@pytest.mark.parametrize("mode", MODES)
def test_weights_are_refused_naming_the_operation(mode):
    composite = CompiledDualHeadNormRope(None, 64, base=10000.0, mode=mode)
    queries, keys, values, key_cache, value_cache = cache_inputs(1, 1, mx.float32)
    weight = mx.ones((64,))
    with pytest.raises(DualHeadNormValueError, match=r"^\[dual_head_norm_rope\] .*without norms"):
        composite(queries, keys, weight, offset=0)
    with pytest.raises(
        DualHeadNormValueError, match=r"^\[dual_head_norm_rope_with_cache\] .*without norms"
    ):
        composite.apply_with_cache(
            queries, keys, values, None, weight, key_cache=key_cache, value_cache=value_cache,
            offset=0,
        )


def test_the_reference_refuses_an_epsilon_or_weights_without_norms():
    queries, keys = random((1, 1, 2, 64), mx.float32, 1), random((1, 1, 2, 64), mx.float32, 2)
    with pytest.raises(TypeError, match=r"^\[composed_dual_head_norm_rope\] norms=False"):
        composed_dual_head_norm_rope(queries, keys, eps=1e-6, dims=64, base=1e4, norms=False)
    with pytest.raises(TypeError, match=r"^\[composed_dual_head_norm_rope\] norms must be"):
        composed_dual_head_norm_rope(queries, keys, eps=1e-6, dims=64, base=1e4, norms=1)


def test_a_graph_without_norms_has_no_norm_node():
    """The graph holds the transposes and ropes only: no norm (an RMSNorm
    node on the GPU, its Rsqrt on the CPU, where rms_norm is MLX's op
    graph), where the same object with norms holds two."""
    queries, keys = random((1, 1, 4, 64), mx.float32, 1), random((1, 1, 2, 64), mx.float32, 2)

    def norm_nodes(outputs):
        return sum(name in ("RMSNorm", "Rsqrt") for name in graph_primitives(*outputs))

    without = CompiledDualHeadNormRope(None, 64, base=1e4, mode="composed")(queries, keys)
    with_norms = CompiledDualHeadNormRope(1e-6, 64, base=1e4, mode="composed")(queries, keys)
    assert norm_nodes(without) == 0
    assert norm_nodes(with_norms) == 2


def test_constants_repr_copies_and_pickles():
    composite = CompiledDualHeadNormRope(None, 64, base=10000.0, traditional=True)
    assert composite.eps is None
    assert repr(composite).startswith("CompiledDualHeadNormRope(eps=None, dims=64,")
    queries, keys = random((1, 1, 4, 64), mx.float32, 1), random((1, 1, 2, 64), mx.float32, 2)
    expected = composite(queries, keys, offset=3)
    for twin in (copy.copy(composite), pickle.loads(pickle.dumps(composite))):
        assert twin.eps is None and twin.traditional is True
        for actual, wanted in zip(twin(queries, keys, offset=3), expected):
            assert_bit_identical(actual, wanted)
    assert CompiledDualHeadNormRope(1e-6, 64, base=10000.0).eps == pytest.approx(1e-6)


def test_c_api_reports_no_norms_and_a_nan_epsilon():
    rope = ffi.new("mlx_dualnorm_rope_parameters *")
    rope.dims, rope.base, rope.scale = 64, 10000.0, 1.0
    created = ffi.new("mlx_dualnorm_dual_head_norm_rope **")
    error = ffi.new("mlx_dualnorm_error *")
    status = lib.mlx_dualnorm_dual_head_norm_rope_new_without_norms(
        created, rope[0], lib.MLX_DUALNORM_MODE_COMPILED, error
    )
    assert status == lib.MLX_DUALNORM_OK
    try:
        assert not lib.mlx_dualnorm_dual_head_norm_rope_normalizes(created[0])
        assert math.isnan(lib.mlx_dualnorm_dual_head_norm_rope_epsilon(created[0]))
    finally:
        lib.mlx_dualnorm_dual_head_norm_rope_free(created[0])
    assert not lib.mlx_dualnorm_dual_head_norm_rope_normalizes(ffi.NULL)
    # Bad RoPE constants are refused as for an object with norms.
    rope.dims = 63
    status = lib.mlx_dualnorm_dual_head_norm_rope_new_without_norms(
        created, rope[0], lib.MLX_DUALNORM_MODE_COMPILED, error
    )
    assert status == lib.MLX_DUALNORM_INVALID_ARGUMENT
    assert ffi.string(error.operation).decode() == "dual_head_norm_rope"


@pytest.mark.skipif(not FUSED_AVAILABLE, reason="the fused mode needs MLX's CUDA backend")
@pytest.mark.parametrize("with_cache", [False, True], ids=["rope", "with-cache"])
def test_the_fused_mode_is_one_node_with_the_composed_bits(with_cache):
    queries, keys, values, key_cache, value_cache = cache_inputs(1, 1, mx.bfloat16)
    fused = CompiledDualHeadNormRope(None, 64, base=10000.0, mode="fused")
    if with_cache:
        outputs = fused.apply_with_cache(
            queries, keys, values, key_cache=key_cache, value_cache=value_cache, offset=4
        )
    else:
        outputs = fused(queries, keys, offset=4)
    assert "FusedDualRmsNormRope" in graph_primitives(*outputs)
    rotated_queries, rotated_keys = reference(queries, keys, 4, dims=64, base=10000.0)
    assert_bit_identical(outputs[0], rotated_queries)
    if with_cache:
        written_keys = copy.copy(key_cache)
        written_keys[..., 4:5, :] = rotated_keys
        written_values = copy.copy(value_cache)
        written_values[..., 4:5, :] = values.transpose(0, 2, 1, 3)
        assert_bit_identical(outputs[1], written_keys)
        assert_bit_identical(outputs[2], written_values)
    else:
        assert_bit_identical(outputs[1], rotated_keys)
