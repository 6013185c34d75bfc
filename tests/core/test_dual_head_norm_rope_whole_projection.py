"""The norm + RoPE with weights of ``H * D`` elements: one norm over each
token's heads, as mlx-lm's OLMo-2 family normalizes its whole q/k
projection before splitting it into heads. Every mode gives the bits of
``rms_norm(x.reshape(B, L, H * D), w).reshape(B, L, H, D)``, then the
transpose and RoPE, in the forward, vjp, jvp and vmap and with the KV-cache
write; a weight of any other length is refused, naming both lengths."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers.bit_parity import assert_bit_identical, assert_transforms_agree

from mlx_dualnorm import CompiledDualHeadNormRope, DualHeadNormValueError, available_modes

MODES = ("compiled", "composed") + (("fused",) if "fused" in available_modes() else ())
EPS = 1e-6
BASE = 500_000.0
OFFSET = 37


def whole_projection_reference(inputs, weight, dims, offset=OFFSET):
    """mlx-lm's OLMo-2 attention: the norm over the whole projection, the
    split into heads, the transpose and nn.RoPE."""
    batch, length, heads, width = inputs.shape
    normalized = mx.fast.rms_norm(inputs.reshape(batch, length, heads * width), weight, EPS)
    head_major = normalized.reshape(batch, length, heads, width).transpose(0, 2, 1, 3)
    return mx.fast.rope(head_major, dims, traditional=False, base=BASE, scale=1.0, offset=offset)


def per_head_reference(inputs, weight, dims, offset=OFFSET):
    head_major = mx.fast.rms_norm(inputs, weight, EPS).transpose(0, 2, 1, 3)
    return mx.fast.rope(head_major, dims, traditional=False, base=BASE, scale=1.0, offset=offset)


def random_case(batch, length, query_heads, key_heads, width, dtype, seed=0):
    keys_of = mx.random.split(mx.random.key(seed), 5)
    queries = (3 * mx.random.normal((batch, length, query_heads, width), key=keys_of[0]))
    keys = mx.random.normal((batch, length, key_heads, width), key=keys_of[1])
    query_weight = mx.random.normal((query_heads * width,), key=keys_of[2])
    key_weight = mx.random.normal((key_heads * width,), key=keys_of[3])
    per_head_weight = mx.random.normal((width,), key=keys_of[4])
    return [array.astype(dtype) for array in
            (queries, keys, query_weight, key_weight, per_head_weight)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", (mx.bfloat16, mx.float16, mx.float32), ids=str)
@pytest.mark.parametrize(
    "shape",
    [
        (1, 1, 16, 16, 128, 128),  # OLMo-2 1B's decode step
        (2, 1, 8, 2, 64, 32),  # batched, grouped keys, partial rotary
        (1, 9, 4, 4, 64, 64),  # a prefill
        (1, 1, 32, 8, 128, 128),  # 4096 wide: OLMo-2 7B's query projection
    ],
    ids=str,
)
def test_one_norm_over_each_tokens_heads(mode, dtype, shape):
    batch, length, query_heads, key_heads, width, dims = shape
    queries, keys, query_weight, key_weight, per_head_weight = random_case(
        batch, length, query_heads, key_heads, width, dtype
    )
    norm_rope = CompiledDualHeadNormRope(EPS, dims, base=BASE, mode=mode)
    rotated_queries, rotated_keys = norm_rope(queries, keys, query_weight, key_weight, offset=OFFSET)
    assert_bit_identical(rotated_queries, whole_projection_reference(queries, query_weight, dims))
    assert_bit_identical(rotated_keys, whole_projection_reference(keys, key_weight, dims))
    # One side over its heads, the other per head: each as its weight says.
    rotated_queries, rotated_keys = norm_rope(
        queries, keys, query_weight, per_head_weight, offset=OFFSET
    )
    assert_bit_identical(rotated_queries, whole_projection_reference(queries, query_weight, dims))
    assert_bit_identical(rotated_keys, per_head_reference(keys, per_head_weight, dims))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("transform", ["vjp", "jvp", "vmap", "compile"])
def test_transforms_are_those_of_the_whole_projection_norm(mode, transform):
    """The weights' gradients sum over the tokens' rows as mlx-lm's do."""
    queries, keys, query_weight, key_weight, _ = random_case(2, 3, 4, 2, 32, mx.float32, seed=3)
    norm_rope = CompiledDualHeadNormRope(EPS, 32, base=BASE, mode=mode)

    def package(queries, keys, query_weight, key_weight):
        return list(norm_rope(queries, keys, query_weight, key_weight, offset=OFFSET))

    def reference(queries, keys, query_weight, key_weight):
        return [whole_projection_reference(queries, query_weight, 32),
                whole_projection_reference(keys, key_weight, 32)]

    primals = [queries, keys, query_weight, key_weight]
    batched = [mx.stack([queries, 2 * queries]), mx.stack([keys, keys - 1]), query_weight,
               key_weight]
    assert_transforms_agree(transform, package, reference, primals, batched)


@pytest.mark.parametrize("mode", MODES)
def test_the_cache_write_of_a_whole_projection_norm(mode):
    """A decode step of OLMo-2's shape with mlx-lm's KV-cache write: the
    rotated queries, both buffers and the fetched rows."""
    queries, keys, query_weight, key_weight, _ = random_case(1, 1, 8, 8, 64, mx.bfloat16, seed=5)
    values = mx.random.normal((1, 1, 8, 64), key=mx.random.key(6)).astype(mx.bfloat16)
    key_cache = mx.random.normal((1, 8, 32, 64), key=mx.random.key(7)).astype(mx.bfloat16)
    value_cache = mx.random.normal((1, 8, 32, 64), key=mx.random.key(8)).astype(mx.bfloat16)
    mx.eval(key_cache, value_cache)
    expected_keys, expected_values = mx.array(key_cache), mx.array(value_cache)
    expected_keys[..., 12:13, :] = whole_projection_reference(keys, key_weight, 64, 12)
    expected_values[..., 12:13, :] = values.transpose(0, 2, 1, 3)
    norm_rope = CompiledDualHeadNormRope(EPS, 64, base=BASE, mode=mode)
    outputs = norm_rope.apply_with_cache(
        queries, keys, values, query_weight, key_weight, key_cache=key_cache,
        value_cache=value_cache, offset=12, fetch=True,
    )
    expected = [whole_projection_reference(queries, query_weight, 64, 12), expected_keys,
                expected_values, expected_keys[..., :13, :], expected_values[..., :13, :]]
    assert len(outputs) == len(expected)
    for actual, reference in zip(outputs, expected):
        assert_bit_identical(actual, reference)


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_of_another_length_is_refused(mode):
    queries, keys, query_weight, key_weight, _ = random_case(1, 1, 4, 2, 16, mx.float32)
    norm_rope = CompiledDualHeadNormRope(EPS, 16, base=BASE, mode=mode)
    with pytest.raises(DualHeadNormValueError) as raised:
        norm_rope(queries, keys, query_weight, mx.ones((48,)), offset=0)
    assert str(raised.value) == (
        "[dual_head_norm_rope] key_weight has 48 elements but the last dimension of keys is 16 "
        "(or 32 for a norm over all 2 heads)"
    )
