"""CompiledDualHeadNorm against the composed path, on the real MLX."""

from __future__ import annotations

import gc
import math
import weakref

import mlx.core as mx
import numpy as np
import pytest
from helpers.bit_parity import assert_bit_identical, assert_transforms_agree, graph_primitives

from mlx_dualnorm import (
    CompiledDualHeadNorm,
    DualHeadNormValueError,
    MlxCError,
    available_modes,
    composed_dual_head_norm,
)

EPS = 1e-6
FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def random_heads(key: mx.array, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    # Small magnitudes so eps matters to the bits.
    return (mx.random.normal(shape, key=key) * 0.01).astype(dtype)


def assert_matches_composed(norm, queries, keys, query_weight=None, key_weight=None):
    actual = norm(queries, keys, query_weight, key_weight)
    expected = composed_dual_head_norm(queries, keys, query_weight, key_weight, norm.eps)
    assert isinstance(actual, tuple) and len(actual) == 2
    assert_bit_identical(actual[0], expected[0])
    assert_bit_identical(actual[1], expected[1])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("width", [64, 128, 200, 256])
@pytest.mark.parametrize("query_heads,key_heads", [(16, 16), (16, 2)])
@pytest.mark.parametrize("weights", ["none", "both", "query", "key"])
def test_bit_identical_to_two_rms_norm_calls(rng_key, dtype, width, query_heads, key_heads, weights):
    keys_ = mx.random.split(rng_key, 4)
    queries = random_heads(keys_[0], (2, 3, query_heads, width), dtype)
    keys = random_heads(keys_[1], (2, 3, key_heads, width), dtype)
    query_weight = mx.random.normal((width,), key=keys_[2]).astype(dtype)
    key_weight = mx.random.normal((width,), key=keys_[3]).astype(dtype)
    with CompiledDualHeadNorm(EPS) as norm:
        assert_matches_composed(
            norm,
            queries,
            keys,
            query_weight if weights in ("both", "query") else None,
            key_weight if weights in ("both", "key") else None,
        )


def test_float32_weight_promotes_half_inputs_like_the_composed_path(rng_key):
    queries = random_heads(rng_key, (1, 1, 16, 128), mx.bfloat16)
    keys = random_heads(rng_key, (1, 1, 2, 128), mx.float16)
    weight = mx.ones((128,), dtype=mx.float32) * 1.5
    norm = CompiledDualHeadNorm(EPS)
    normalized_queries, normalized_keys = norm(queries, keys, weight, weight)
    assert normalized_queries.dtype == mx.float32
    assert_matches_composed(norm, queries, keys, weight, weight)


def test_new_batch_and_sequence_sizes_give_the_composed_bits(rng_key):
    norm = CompiledDualHeadNorm(1e-5)
    for batch, sequence in [(1, 1), (2, 1), (1, 1), (1, 2), (4, 1), (1, 33), (3, 7)]:
        queries = random_heads(rng_key, (batch, sequence, 16, 128), mx.bfloat16)
        keys = random_heads(rng_key, (batch, sequence, 4, 128), mx.bfloat16)
        assert_matches_composed(norm, queries, keys)


def test_compiled_graph_is_traced_for_the_shape_like_a_shaped_mx_compile(rng_key):
    """A trace for the call's shape folds rms_norm's element count into a
    constant: the same primitives as Python's shape-specialized mx.compile,
    none of the NumberOfElements a shapeless trace keeps (each one more
    dispatch per call at evaluation)."""
    queries = random_heads(rng_key, (1, 1, 16, 128), mx.bfloat16)
    keys = random_heads(rng_key, (1, 1, 8, 128), mx.bfloat16)
    compiled = CompiledDualHeadNorm(EPS, mode="compiled")(queries, keys)
    shaped_peer = mx.compile(lambda q, k: composed_dual_head_norm(q, k, None, None, EPS))
    primitives = graph_primitives(*compiled)
    assert "NumberOfElements" not in primitives
    assert primitives == graph_primitives(*shaped_peer(queries, keys))


def test_each_new_shape_traces_with_its_own_objects_epsilon(rng_key):
    """A new shape traces again, reading the epsilon slot: interleaved
    objects with different epsilons each get their own at every new size."""
    small, large = CompiledDualHeadNorm(1e-6, "compiled"), CompiledDualHeadNorm(1e-2, "compiled")
    for batch in (1, 2, 3):
        for norm in (small, large):
            queries = random_heads(rng_key, (batch, 1, 4, 64), mx.float32)
            keys = random_heads(rng_key, (batch, 1, 2, 64), mx.float32)
            assert_matches_composed(norm, queries, keys)


def test_queries_and_keys_may_differ_in_dtype_and_rank_as_in_the_composed_path(rng_key):
    norm = CompiledDualHeadNorm(EPS)
    queries = random_heads(rng_key, (2, 16, 64), mx.float32)
    keys = random_heads(rng_key, (5, 1, 3, 128), mx.bfloat16)
    assert_matches_composed(norm, queries, keys)


def test_outputs_come_back_queries_first_keys_second(rng_key):
    norm = CompiledDualHeadNorm(EPS)
    queries = random_heads(rng_key, (1, 1, 16, 64), mx.float32)
    keys = random_heads(rng_key, (1, 1, 2, 128), mx.float32) + 3.0
    normalized_queries, normalized_keys = norm(queries, keys)
    assert normalized_queries.shape == queries.shape
    assert normalized_keys.shape == keys.shape
    assert_bit_identical(normalized_queries, mx.fast.rms_norm(queries, None, EPS))
    assert_bit_identical(normalized_keys, mx.fast.rms_norm(keys, None, EPS))


def test_numpy_inputs_are_accepted(rng_key):
    norm = CompiledDualHeadNorm(EPS)
    queries = np.random.default_rng(0).standard_normal((2, 4, 32)).astype(np.float32)
    weight = np.linspace(0.5, 1.5, 32, dtype=np.float32)
    actual = norm(queries, queries, weight, None)
    expected = composed_dual_head_norm(mx.array(queries), mx.array(queries), mx.array(weight), None, EPS)
    assert_bit_identical(actual[0], expected[0])
    assert_bit_identical(actual[1], expected[1])


@pytest.mark.parametrize(
    "query_shape,key_shape",
    [
        ((1, 1, 3072), (1, 1, 3072)),  # decode-sized: the compiled graph (6144 elements)
        ((1, 16, 65536), (1, 16, 65536)),  # few rows, many elements: the composed graph
        ((1024, 16, 128), (1024, 4, 128)),  # prefill-sized: the composed graph
    ],
)
def test_a_call_evaluates_nothing_and_copies_nothing(query_shape, key_shape):
    """Calling allocates no memory at all: the lazy inputs are not
    evaluated, nothing is copied, and the outputs are lazy. A numpy bridge
    (which evaluates and copies) or an eager output would allocate here."""
    norm = CompiledDualHeadNorm(EPS)
    mx.eval(norm(mx.zeros(query_shape), mx.zeros(key_shape)))  # trace outside the count
    gc.collect()
    input_bytes = 4 * (math.prod(query_shape) + math.prod(key_shape))
    # Under half the inputs' bytes: a copy or an evaluation of them would show.
    allowance = min(64 * 1024, input_bytes // 2)
    baseline = mx.get_active_memory()
    lazy_queries = mx.random.normal(query_shape)
    lazy_keys = mx.random.normal(key_shape)
    normalized_queries, normalized_keys = norm(lazy_queries, lazy_keys)
    assert mx.get_active_memory() - baseline < allowance

    mx.eval(lazy_queries, lazy_keys)
    evaluated = mx.get_active_memory()
    assert evaluated - baseline >= input_bytes, "the measurement must see evaluation"
    normalized_queries, normalized_keys = norm(lazy_queries, lazy_keys)
    assert mx.get_active_memory() - evaluated < allowance

    mx.eval(normalized_queries, normalized_keys)
    assert mx.get_active_memory() - evaluated >= 0.9 * input_bytes


@pytest.mark.skipif("fused" not in available_modes(), reason="the fused mode needs MLX's CUDA backend")
@pytest.mark.parametrize(
    "batch,length,width,dtype",
    [
        (1, 1, 128, mx.float32),
        (1, 4, 128, mx.float32),
        (2, 4, 128, mx.bfloat16),
        (1, 4, 1024, mx.float32),  # two chunks a thread: the second read again
    ],
)
def test_the_fused_norm_writes_over_inputs_nothing_else_holds(batch, length, width, dtype):
    """As MLX's RMS norm writes over an input nothing else holds, the fused
    kernel writes its normalized rows over the projections it read: a call
    allocates no more than the projections themselves (a fresh output would
    add at least the smaller side's bytes). An input still held elsewhere
    keeps its values. The bits are the composed path's either way."""
    norm = CompiledDualHeadNorm(EPS, mode="fused")
    keys_ = mx.random.split(mx.random.key(5), 4)
    queries = random_heads(keys_[0], (batch, length, 4, width), dtype)
    keys = random_heads(keys_[1], (batch, length, 2, width), dtype)
    query_weight = mx.random.uniform(0.5, 1.5, (width,), key=keys_[2]).astype(dtype)
    key_weight = mx.random.uniform(0.5, 1.5, (width,), key=keys_[3]).astype(dtype)
    expected = composed_dual_head_norm(queries, keys, query_weight, key_weight, EPS)
    mx.eval(queries, keys, query_weight, key_weight, expected)
    kept = (queries * 1, keys * 1)  # copies, to compare the inputs with after the calls
    mx.eval(kept)
    mx.synchronize()
    # MLX's buffer cache may hand the projections below a larger block that
    # an earlier test freed, and no one (MLX included) writes in place into
    # a block much larger than the output: start from fresh blocks.
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    # Inputs only the node holds (a product by 1 keeps every bit).
    projected = (queries * 1, keys * 1)
    outputs = norm(*projected, query_weight, key_weight)
    del projected
    assert "FusedDualRmsNorm" in graph_primitives(*outputs)
    mx.eval(outputs)
    allocated = mx.get_peak_memory() - before
    assert allocated < queries.nbytes + keys.nbytes + keys.nbytes // 2, allocated
    for output, reference in zip(outputs, expected):
        assert_bit_identical(output, reference)
    # Inputs held by the caller: written to fresh memory, left as they were.
    held = norm(queries, keys, query_weight, key_weight)
    mx.eval(held)
    for output, reference in zip(held, expected):
        assert_bit_identical(output, reference)
    assert_bit_identical(queries, kept[0])
    assert_bit_identical(keys, kept[1])


def test_outputs_are_lazy_mx_arrays_usable_in_further_ops(rng_key):
    norm = CompiledDualHeadNorm(EPS)
    queries = random_heads(rng_key, (1, 1, 16, 128), mx.bfloat16)
    normalized_queries, normalized_keys = norm(queries, queries)
    assert type(normalized_queries) is mx.array
    scores = (normalized_queries * normalized_keys).sum(axis=-1)
    expected_q, expected_k = composed_dual_head_norm(queries, queries, None, None, EPS)
    assert_bit_identical(scores, (expected_q * expected_k).sum(axis=-1))


def test_stream_argument_runs_on_that_stream(rng_key):
    norm = CompiledDualHeadNorm(EPS)
    queries = random_heads(rng_key, (2, 8, 64), mx.float32)
    actual = norm(queries, queries, stream=mx.cpu)
    expected = composed_dual_head_norm(queries, queries, None, None, EPS, stream=mx.cpu)
    assert_bit_identical(actual[0], expected[0])


def test_eps_is_the_float32_mlx_uses():
    assert CompiledDualHeadNorm(1e-6).eps == float(np.float32(1e-6))
    assert CompiledDualHeadNorm(0).eps == 0.0


BAD_EPSILONS = [float("nan"), float("inf"), -1e-6, 1e300]


@pytest.mark.parametrize("eps", BAD_EPSILONS)
def test_bad_eps_is_a_value_error_naming_the_operation(eps):
    with pytest.raises(ValueError, match=r"^\[dual_head_norm\] "):
        CompiledDualHeadNorm(eps)


@pytest.mark.parametrize("eps", ["1e-6", None, True, [1e-6]])
def test_non_number_eps_is_a_type_error(eps):
    with pytest.raises(TypeError, match="eps must be a real number"):
        CompiledDualHeadNorm(eps)


def bad_inputs():
    width = 8
    x = mx.ones((2, width))
    return {
        "0-d queries": ((mx.array(1.0), x), "queries must have at least 1 dimension"),
        "0-d keys": ((x, mx.array(1.0)), "keys must have at least 1 dimension"),
        "short query weight": ((x, x, mx.ones((3,)), None), "query_weight has 3 elements"),
        "long key weight": ((x, x, None, mx.ones((9,))), "key_weight has 9 elements"),
        "2-d weight": ((x, x, mx.ones((1, width)), None), "must have 1 dimension but has 2"),
        "int32 queries": ((x.astype(mx.int32), x), "unsupported dtype int32"),
        "bool keys": ((x, x.astype(mx.bool_)), "unsupported dtype bool"),
        "complex queries": ((x.astype(mx.complex64), x), "unsupported dtype complex64"),
        "int weight on int input": (
            (x.astype(mx.int32), x, mx.ones((width,), dtype=mx.int32), None),
            "do not normalize to a floating dtype",
        ),
    }


@pytest.mark.parametrize("case", list(bad_inputs()))
def test_bad_input_is_a_value_error_naming_the_operation_and_the_next_call_works(case, rng_key):
    arguments, expected_message = bad_inputs()[case]
    norm = CompiledDualHeadNorm(EPS)
    with pytest.raises(DualHeadNormValueError, match=expected_message) as raised:
        norm(*arguments)
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, MlxCError)
    assert raised.value.operation == "dual_head_norm"
    # The composed path rejects the same input.
    with pytest.raises(ValueError):
        mx.eval(composed_dual_head_norm(*arguments, EPS) if len(arguments) == 4
                else composed_dual_head_norm(*arguments, None, None, EPS))
    queries = random_heads(rng_key, (1, 1, 16, 128), mx.bfloat16)
    assert_matches_composed(norm, queries, queries)


def test_short_weight_after_a_good_trace_is_still_rejected():
    """The shapeless replay would not re-check it; the apply does."""
    norm = CompiledDualHeadNorm(EPS)
    x = mx.ones((2, 8))
    mx.eval(norm(x, x, mx.ones((8,)), mx.ones((8,))))
    with pytest.raises(DualHeadNormValueError, match="has 3 elements"):
        norm(x, x, mx.ones((3,)), mx.ones((8,)))


@pytest.mark.parametrize("bad", ["queries", 3.0, [1.0, 2.0], None, object()])
def test_non_array_argument_is_a_type_error(bad):
    norm = CompiledDualHeadNorm(EPS)
    with pytest.raises(TypeError, match=r"^\[dual_head_norm\] queries"):
        norm(bad, mx.ones((2, 8)))
    with pytest.raises(TypeError, match="key_weight must be"):
        norm(mx.ones((2, 8)), mx.ones((2, 8)), None, "weight")


def test_closed_object_raises_and_close_is_idempotent():
    norm = CompiledDualHeadNorm(EPS)
    x = mx.ones((2, 8))
    with norm:
        mx.eval(norm(x, x))
    with pytest.raises(DualHeadNormValueError, match="closed"):
        norm(x, x)
    norm.close()


@pytest.mark.skipif(mx.is_available(mx.gpu), reason="needs a CPU-only MLX")
def test_gpu_stream_on_cpu_only_mlx_is_a_value_error():
    norm = CompiledDualHeadNorm(EPS)
    x = mx.ones((2, 8))
    with pytest.raises(ValueError, match="Cannot get gpu stream"):
        norm(x, x, stream=mx.gpu)
    assert_matches_composed(norm, x, x)


def test_garbage_collection_frees_the_object():
    norm = CompiledDualHeadNorm(EPS)
    mx.eval(norm(mx.ones((2, 8)), mx.ones((2, 8))))
    reference = weakref.ref(norm)
    del norm
    gc.collect()
    assert reference() is None


@pytest.mark.parametrize("count", [1, 3])
def test_a_bridge_giving_other_than_two_outputs_is_an_mlx_error(monkeypatch, rng_key, count):
    """The facade returns the bridge's tuple only when it holds exactly the
    two outputs the C builders publish; anything else is reported, never
    unpacked. (The bridge is replaced here, MLX is not.)"""
    import mlx_dualnorm.dual_head_norm as facade

    queries = random_heads(rng_key, (1, 1, 4, 64), mx.float32)
    monkeypatch.setattr(
        facade, "apply_compiled_dual_head_norm", lambda *arguments: (queries,) * count
    )
    expected = rf"^\[dual_head_norm\] .*returned {count} outputs, expected 2"
    with pytest.raises(MlxCError, match=expected):
        CompiledDualHeadNorm(EPS, "compiled")(queries, queries)


@pytest.mark.parametrize("mode", available_modes())
@pytest.mark.parametrize("transform", ["vjp", "jvp", "vmap", "compile"])
def test_transforms_give_the_composed_calls_bits(mode, transform):
    """Fine-tuning differentiates the norms, and users vmap them: reverse-
    and forward-mode derivatives (every input's, weights included) and
    vmap give the bits of the same transform of the two rms_norm calls."""
    keys_of = mx.random.split(mx.random.key(4), 4)
    queries = mx.random.normal((2, 3, 4, 64), key=keys_of[0])
    keys = mx.random.normal((2, 3, 2, 64), key=keys_of[1])
    query_weight = mx.random.normal((64,), key=keys_of[2])
    key_weight = mx.random.normal((64,), key=keys_of[3])
    primals = [queries, keys, query_weight, key_weight]
    norm = CompiledDualHeadNorm(EPS, mode=mode)

    def ours(q, k, wq, wk):
        return list(norm(q, k, wq, wk))

    def composed(q, k, wq, wk):
        return list(composed_dual_head_norm(q, k, wq, wk, EPS))

    assert_transforms_agree(transform, ours, composed, primals, primals)


@pytest.mark.parametrize(
    "query_shape,key_shape,compiled",
    [
        ((1, 1, 20, 256), (1, 1, 4, 256), True),  # 6144 elements: the bound
        ((1, 1, 20, 256), (1, 1, 5, 256), False),  # one row of 256 past it
        ((1, 1, 2048), (1, 1, 2048), True),  # OLMo 2's whole-projection norms, batch 1
        ((2, 1, 2048), (2, 1, 2048), False),  # the same at batch 2
        ((1, 1, 32, 128), (1, 1, 16, 128), True),  # 48 rows of 128
        ((1, 1, 48, 128), (1, 1, 1, 128), False),  # 49 rows of 128
    ],
)
def test_calls_take_the_compiled_graph_up_to_an_element_count(query_shape, key_shape, compiled):
    """Up to 6144 elements in all a call replays the compiled graph (the
    primitives of a shaped mx.compile); past it, it builds the composed
    graph: which one, whatever the row width, and the composed bits either way.
    On the CPU stream, where the two graphs differ (on a GPU a shaped
    mx.compile leaves the composed graph's primitives as they are)."""
    with mx.stream(mx.cpu):
        check_the_route_by_element_count(query_shape, key_shape, compiled)


def check_the_route_by_element_count(query_shape, key_shape, compiled):
    keys_ = mx.random.split(mx.random.key(11), 4)
    queries = random_heads(keys_[0], query_shape, mx.bfloat16)
    keys = random_heads(keys_[1], key_shape, mx.bfloat16)
    query_weight = mx.random.normal((query_shape[-1],), key=keys_[2]).astype(mx.bfloat16)
    key_weight = mx.random.normal((key_shape[-1],), key=keys_[3]).astype(mx.bfloat16)
    norm = CompiledDualHeadNorm(EPS, mode="compiled")
    actual = norm(queries, keys, query_weight, key_weight)
    composed = composed_dual_head_norm(queries, keys, query_weight, key_weight, EPS)
    shaped_peer = mx.compile(lambda q, k, wq, wk: composed_dual_head_norm(q, k, wq, wk, EPS))
    peer_primitives = graph_primitives(*shaped_peer(queries, keys, query_weight, key_weight))
    assert peer_primitives != graph_primitives(*composed), "the routes must be told apart"
    expected_primitives = peer_primitives if compiled else graph_primitives(*composed)
    assert graph_primitives(*actual) == expected_primitives
    assert_matches_composed(norm, queries, keys, query_weight, key_weight)
