"""CompiledDualHeadNormRope.apply_with_cache: bit parity with the norm +
RoPE followed by mlx-lm's cache writes (``buffer[..., w:w+L, :] = ...``),
in every mode; its transforms; the buffers as inputs (never visibly
modified, donated when nothing else holds them); bad input."""

from __future__ import annotations

import copy
import itertools

import mlx.core as mx
import pytest
from helpers.bit_parity import assert_bit_identical, graph_primitives

from mlx_dualnorm import CompiledDualHeadNormRope, DualHeadNormValueError, available_modes

FUSED_AVAILABLE = "fused" in available_modes()
MODES = ("compiled", "composed") + (("fused",) if FUSED_AVAILABLE else ())
EPS, DIMS, BASE = 1e-6, 128, 1_000_000.0
HEADS_Q, HEADS_K, WIDTH, CAPACITY = 4, 2, 128, 64


def random(shape, dtype, seed):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def layer_inputs(batch, length, dtype, seed=0, value_width=WIDTH):
    queries = 3 * random((batch, length, HEADS_Q, WIDTH), dtype, seed)
    keys = random((batch, length, HEADS_K, WIDTH), dtype, seed + 1)
    values = random((batch, length, HEADS_K, value_width), dtype, seed + 2)
    query_weight = random((WIDTH,), dtype, seed + 3)
    key_weight = random((WIDTH,), dtype, seed + 4)
    return queries, keys, values, query_weight, key_weight


def buffers(batch, dtype, seed=10, value_width=WIDTH, capacity=CAPACITY):
    return (random((batch, HEADS_K, capacity, WIDTH), dtype, seed),
            random((batch, HEADS_K, capacity, value_width), dtype, seed + 1))


def composed_with_cache(norm_rope, queries, keys, values, query_weight, key_weight,
                        key_cache, value_cache, offset, write_offset):
    """The reference: the norm + RoPE in composed mode, then mlx-lm's
    KVCache writes, on new handles of the buffers (indexing assignment
    replaces the handle's array, not the caller's)."""
    composed = CompiledDualHeadNormRope(
        norm_rope.eps, norm_rope.dims, base=norm_rope.base, traditional=norm_rope.traditional,
        scale=norm_rope.scale, mode="composed",
    )
    rotated_queries, rotated_keys = composed(queries, keys, query_weight, key_weight,
                                             offset=offset)
    key_cache, value_cache = copy.copy(key_cache), copy.copy(value_cache)
    end = write_offset + keys.shape[1]
    key_cache[..., write_offset:end, :] = rotated_keys
    value_cache[..., write_offset:end, :] = values.transpose(0, 2, 1, 3)
    return rotated_queries, key_cache, value_cache


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "dtype, batch, length, write_offset",
    [
        (mx.bfloat16, 1, 1, 0),
        (mx.bfloat16, 1, 1, 37),
        (mx.bfloat16, 1, 1, CAPACITY - 1),
        (mx.float16, 2, 1, 5),
        (mx.float32, 1, 4, 60),
        (mx.bfloat16, 1, 25, 3),  # 19200 elements: the plain graph
        (mx.bfloat16, 1, 0, 7),  # nothing to write
    ],
)
def test_matches_rope_then_cache_writes(mode, dtype, batch, length, write_offset):
    norm_rope = CompiledDualHeadNormRope(EPS, DIMS, base=BASE, mode=mode)
    inputs = layer_inputs(batch, length, dtype)
    key_cache, value_cache = buffers(batch, dtype)
    for offset in (write_offset, mx.array(write_offset + 3)):
        actual = norm_rope.apply_with_cache(
            *inputs, key_cache=key_cache, value_cache=value_cache, offset=offset,
            write_offset=write_offset,
        )
        expected = composed_with_cache(norm_rope, *inputs, key_cache, value_cache, offset,
                                       write_offset)
        assert len(actual) == 3
        for actual_array, expected_array in zip(actual, expected):
            assert_bit_identical(actual_array, expected_array)


@pytest.mark.parametrize("mode", MODES)
def test_per_row_offsets_weightless_and_other_value_widths(mode):
    """BatchKVCache's case: one RoPE offset per batch entry, one write row;
    and values of another width than the keys, norms without weights."""
    norm_rope = CompiledDualHeadNormRope(EPS, 64, base=10_000.0, traditional=True, mode=mode)
    queries, keys, values, _, _ = layer_inputs(3, 1, mx.bfloat16, seed=5, value_width=96)
    key_cache, value_cache = buffers(3, mx.bfloat16, value_width=96)
    offsets = mx.array([4, -2, 9])
    actual = norm_rope.apply_with_cache(queries, keys, values, key_cache=key_cache,
                                        value_cache=value_cache, offset=offsets, write_offset=9)
    expected = composed_with_cache(norm_rope, queries, keys, values, None, None, key_cache,
                                   value_cache, offsets, 9)
    for actual_array, expected_array in zip(actual, expected):
        assert_bit_identical(actual_array, expected_array)


@pytest.mark.parametrize("mode", MODES)
def test_a_frequency_table_and_input_scale_reach_the_cache(mode):
    """An object made with base=None (a scaled RoPE's table) and an input
    scale: the rotated keys written are the table's."""
    norm_rope = CompiledDualHeadNormRope(EPS, DIMS, base=None, input_scale=1.25, mode=mode)
    freqs = mx.power(10_000.0, mx.arange(0, DIMS, 2, dtype=mx.float32) / DIMS) * 1.5
    inputs = layer_inputs(1, 1, mx.bfloat16)
    key_cache, value_cache = buffers(1, mx.bfloat16)
    actual = norm_rope.apply_with_cache(*inputs, key_cache=key_cache, value_cache=value_cache,
                                        offset=17, freqs=freqs)
    rotated_queries, rotated_keys = norm_rope(*inputs[:2], *inputs[3:], offset=17, freqs=freqs)
    key_reference, value_reference = copy.copy(key_cache), copy.copy(value_cache)
    key_reference[..., 17:18, :] = rotated_keys
    value_reference[..., 17:18, :] = inputs[2].transpose(0, 2, 1, 3)
    for actual_array, expected_array in zip(actual, (rotated_queries, key_reference,
                                                     value_reference)):
        assert_bit_identical(actual_array, expected_array)
    with pytest.raises(DualHeadNormValueError, match="freqs are required"):
        norm_rope.apply_with_cache(*inputs, key_cache=key_cache, value_cache=value_cache,
                                   offset=17)


def test_updates_of_another_dtype_are_cast_as_indexing_casts():
    norm_rope = CompiledDualHeadNormRope(EPS, DIMS, base=BASE)
    inputs = layer_inputs(1, 1, mx.float32)
    key_cache, value_cache = buffers(1, mx.bfloat16)
    actual = norm_rope.apply_with_cache(*inputs, key_cache=key_cache, value_cache=value_cache,
                                        offset=12)
    expected = composed_with_cache(norm_rope, *inputs, key_cache, value_cache, 12, 12)
    assert actual[1].dtype == actual[2].dtype == mx.bfloat16
    for actual_array, expected_array in zip(actual, expected):
        assert_bit_identical(actual_array, expected_array)


def test_successive_rows_replay_one_graph_and_agree():
    """Decode: the write row changes every step (an input of the graph)."""
    norm_rope = CompiledDualHeadNormRope(EPS, DIMS, base=BASE, mode="compiled")
    key_cache, value_cache = buffers(1, mx.bfloat16)
    reference_keys, reference_values = key_cache, value_cache
    for row in range(20, 30):
        inputs = layer_inputs(1, 1, mx.bfloat16, seed=row)
        rotated, key_cache, value_cache = norm_rope.apply_with_cache(
            *inputs, key_cache=key_cache, value_cache=value_cache, offset=row)
        expected = composed_with_cache(norm_rope, *inputs, reference_keys, reference_values,
                                       row, row)
        _, reference_keys, reference_values = expected
        mx.eval(rotated, key_cache, value_cache, reference_keys, reference_values)
        assert_bit_identical(rotated, expected[0])
    assert_bit_identical(key_cache, reference_keys)
    assert_bit_identical(value_cache, reference_values)


def test_a_buffer_the_caller_still_holds_is_not_modified():
    norm_rope = CompiledDualHeadNormRope(EPS, DIMS, base=BASE)
    inputs = layer_inputs(1, 1, mx.bfloat16)
    key_cache, value_cache = buffers(1, mx.bfloat16)
    mx.eval(key_cache, value_cache)
    before = [mx.array(key_cache), mx.array(value_cache)]
    mx.eval(before)
    _, written_keys, written_values = norm_rope.apply_with_cache(
        *inputs, key_cache=key_cache, value_cache=value_cache, offset=30)
    mx.eval(written_keys, written_values)
    assert_bit_identical(key_cache, before[0])
    assert_bit_identical(value_cache, before[1])
    assert not mx.array_equal(written_keys, key_cache).item()
    assert mx.array_equal(written_keys[..., :30, :], key_cache[..., :30, :]).item()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fetch", [False, True])
def test_a_buffer_nothing_else_holds_is_written_in_place(mode, fetch):
    """Replacing the caller's reference by the result, as a cache does: the
    buffer's memory is reused (MLX's donation; the fused kernel's own, for
    its multi-output node), so evaluating a step allocates far less than
    one buffer (no copy of it). The fetched rows of one step, evaluated
    with it and let go before the next, as attention uses them, do not
    stop the next step's reuse."""
    norm_rope = CompiledDualHeadNormRope(EPS, DIMS, base=BASE, mode=mode)
    capacity = 4096
    key_cache, value_cache = buffers(1, mx.bfloat16, capacity=capacity)
    mx.eval(key_cache, value_cache)
    buffer_bytes = key_cache.nbytes
    peaks = []
    for row in range(8):
        inputs = layer_inputs(1, 1, mx.bfloat16, seed=row)
        mx.eval(inputs)
        outputs = norm_rope.apply_with_cache(
            *inputs, key_cache=key_cache, value_cache=value_cache, offset=row, fetch=fetch)
        key_cache, value_cache = outputs[1], outputs[2]
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(outputs)
        peaks.append(mx.get_peak_memory() - before)
        del outputs
    assert max(peaks[1:]) < buffer_bytes // 4, (peaks, buffer_bytes)


# (batch, length, dtype, norm over the whole projection)
IN_PLACE_CASES = {
    "decode": (1, 1, mx.float32, False),
    "prompt": (1, 4, mx.float32, False),
    "batch2-bfloat16": (2, 4, mx.bfloat16, False),
    "whole-projection": (1, 4, mx.float32, True),
}


@pytest.mark.skipif(not FUSED_AVAILABLE, reason="the fused mode needs MLX's CUDA backend")
@pytest.mark.parametrize("case", list(IN_PLACE_CASES))
@pytest.mark.parametrize("with_cache", [False, True], ids=["norm-rope", "with-cache"])
def test_rotated_rows_take_the_projections_memory_in_mlx_s_layout(case, with_cache):
    """The fused kernel lays its rotated rows out as MLX's RoPE leaves
    mlx-lm's transposed queries and keys (in the projection's token-major
    order), so it writes them over the projections it read when nothing
    else holds them, as MLX's RMS norm and RoPE write over their inputs: a
    step, one token or a prefill, allocates no more than the projections
    themselves. And attention's output, which follows the queries' layout,
    goes back to (B, L, H * D) without a copy. The bits are the composed
    path's."""
    batch, length, dtype, whole_projection = IN_PLACE_CASES[case]
    norm_rope = CompiledDualHeadNormRope(EPS, DIMS, base=BASE, mode="fused")
    queries, keys, values, query_weight, key_weight = layer_inputs(batch, length, dtype)
    if whole_projection:  # OLMo-2's norms over each token's H * D features
        query_weight = random((HEADS_Q * WIDTH,), dtype, 20)
        key_weight = random((HEADS_K * WIDTH,), dtype, 21)
    key_cache, value_cache = buffers(batch, dtype)
    mx.eval(queries, keys, values, query_weight, key_weight, key_cache, value_cache)
    if with_cache:
        expected = composed_with_cache(norm_rope, queries, keys, values, query_weight,
                                       key_weight, key_cache, value_cache, 3, 3)
    else:
        composed = CompiledDualHeadNormRope(EPS, DIMS, base=BASE, mode="composed")
        expected = composed(queries, keys, query_weight, key_weight, offset=3)
    mx.eval(expected)
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    # Projections only the node holds (a product by 1 keeps every bit).
    projected = (queries * 1, keys * 1)
    if with_cache:
        outputs = norm_rope.apply_with_cache(
            *projected, values, query_weight, key_weight, key_cache=key_cache,
            value_cache=value_cache, offset=3)
        key_cache = value_cache = None  # the node's alone: written in place
    else:
        outputs = norm_rope(*projected, query_weight, key_weight, offset=3)
    del projected
    assert "FusedDualRmsNormRope" in graph_primitives(*outputs)
    mx.eval(outputs)
    allocated = mx.get_peak_memory() - before
    for output, reference in zip(outputs, expected):
        assert_bit_identical(output, reference)
    # The projections and the offset; a fresh rotated output would add at
    # least the smaller side's bytes.
    projection_bytes = queries.nbytes + keys.nbytes
    assert allocated < projection_bytes + min(queries.nbytes, keys.nbytes) // 2, allocated
    # Back to (B, L, Hq * D) as attention's output goes: a view, no copy
    # (a head-major layout would copy every row).
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    flattened = outputs[0].transpose(0, 2, 1, 3).reshape(batch, length, -1)
    mx.eval(flattened)
    assert mx.get_peak_memory() - before < outputs[0].nbytes // 2
    assert_bit_identical(flattened,
                         expected[0].transpose(0, 2, 1, 3).reshape(batch, length, -1))


@pytest.mark.skipif(not FUSED_AVAILABLE, reason="the fused mode needs MLX's CUDA backend")
@pytest.mark.parametrize("with_cache", [False, True], ids=["norm-rope", "with-cache"])
def test_under_a_transform_the_fused_mode_builds_the_composed_graph(with_cache):
    """Traced by grad (or any transform) the fused mode gives MLX's own
    nodes, in the composed path's order, so a transform sums cotangents as
    it does over mlx-lm's ops; outside a transform, its one node. The
    gradients are the composed path's bits."""
    fused = CompiledDualHeadNormRope(EPS, DIMS, base=BASE, mode="fused")
    composed = CompiledDualHeadNormRope(EPS, DIMS, base=BASE, mode="composed")
    queries, keys, values, query_weight, key_weight = layer_inputs(1, 1, mx.float32)
    key_cache, value_cache = buffers(1, mx.float32)
    graphs = []

    def loss(norm_rope, queries, keys):
        if with_cache:
            outputs = norm_rope.apply_with_cache(
                queries, keys, values, query_weight, key_weight, key_cache=key_cache,
                value_cache=value_cache, offset=3)
        else:
            outputs = norm_rope(queries, keys, query_weight, key_weight, offset=3)
        graphs.append(graph_primitives(*outputs))
        return sum((output * output).sum() for output in outputs)

    expected = mx.grad(lambda q, k: loss(composed, q, k), argnums=(0, 1))(queries, keys)
    actual = mx.grad(lambda q, k: loss(fused, q, k), argnums=(0, 1))(queries, keys)
    assert "FusedDualRmsNormRope" not in graphs[-1], graphs[-1]
    for gradient, reference in zip(actual, expected):
        assert_bit_identical(gradient, reference)
    loss(fused, queries, keys)
    assert "FusedDualRmsNormRope" in graphs[-1], graphs[-1]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["strided values", "strided key buffer", "one buffer twice"])
def test_views_and_a_buffer_given_twice_are_written_as_indexing_writes(mode, case):
    """Inputs that are views (read with their strides; a view's buffer is
    copied, never written in place: its memory is shared) and one array
    given as both buffers (each output is that array with its own rows
    written)."""
    norm_rope = CompiledDualHeadNormRope(EPS, DIMS, base=BASE, mode=mode)
    queries, keys, values, query_weight, key_weight = layer_inputs(1, 2, mx.bfloat16, seed=3)
    key_cache, value_cache = buffers(1, mx.bfloat16)
    if case == "strided values":
        values = random((1, HEADS_K, 2, WIDTH), mx.bfloat16, 20).transpose(0, 2, 1, 3)
    elif case == "strided key buffer":
        key_cache = random((1, CAPACITY, HEADS_K, WIDTH), mx.bfloat16, 21).transpose(0, 2, 1, 3)
    else:
        value_cache = key_cache
    mx.eval(values, key_cache, value_cache)
    actual = norm_rope.apply_with_cache(queries, keys, values, query_weight, key_weight,
                                        key_cache=key_cache, value_cache=value_cache, offset=40)
    expected = composed_with_cache(norm_rope, queries, keys, values, query_weight, key_weight,
                                   key_cache, value_cache, 40, 40)
    for actual_array, expected_array in zip(actual, expected):
        assert_bit_identical(actual_array, expected_array)


def fetched(outputs, end):
    """The reference outputs with what ``fetch=True`` adds: rows [0, end)
    of both written buffers, sliced as KVCache.update_and_fetch slices."""
    return (*outputs, outputs[1][..., :end, :], outputs[2][..., :end, :])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "dtype, batch, length, write_offset",
    [(mx.bfloat16, 1, 1, 37), (mx.float16, 2, 1, 0), (mx.float32, 1, 3, 61),
     (mx.bfloat16, 1, 1, CAPACITY - 1), (mx.bfloat16, 1, 25, 3)],
)
def test_fetch_adds_the_rows_update_and_fetch_returns(mode, dtype, batch, length, write_offset):
    norm_rope = CompiledDualHeadNormRope(EPS, DIMS, base=BASE, mode=mode)
    inputs = layer_inputs(batch, length, dtype, seed=7)
    key_cache, value_cache = buffers(batch, dtype)
    actual = norm_rope.apply_with_cache(*inputs, key_cache=key_cache, value_cache=value_cache,
                                        offset=write_offset, fetch=True)
    expected = fetched(composed_with_cache(norm_rope, *inputs, key_cache, value_cache,
                                           write_offset, write_offset), write_offset + length)
    assert len(actual) == 5
    for actual_array, expected_array in zip(actual, expected):
        assert actual_array.shape == expected_array.shape
        assert_bit_identical(actual_array, expected_array)
    # What attention does with them: the same bits from the same rows.
    for actual_rows, expected_rows in zip(actual[3:], expected[3:]):
        assert_bit_identical(actual_rows * 2 + 1, expected_rows * 2 + 1)
    with pytest.raises(TypeError, match=r"\[dual_head_norm_rope_with_cache\] fetch must be a bool"):
        norm_rope.apply_with_cache(*inputs, key_cache=key_cache, value_cache=value_cache,
                                   offset=write_offset, fetch=1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fetch", [False, True])
@pytest.mark.parametrize("transform", ["vjp", "jvp", "vmap", "compile"])
def test_transforms_match_the_composed_path(transform, fetch, mode):
    norm_rope = CompiledDualHeadNormRope(EPS, DIMS, base=BASE, mode=mode)
    queries, keys, values, query_weight, key_weight = layer_inputs(1, 2, mx.float32)
    key_cache, value_cache = buffers(1, mx.float32)

    def actual(queries, keys, values, key_cache, value_cache):
        return list(norm_rope.apply_with_cache(
            queries, keys, values, query_weight, key_weight, key_cache=key_cache,
            value_cache=value_cache, offset=6, fetch=fetch))

    def expected(queries, keys, values, key_cache, value_cache):
        outputs = composed_with_cache(norm_rope, queries, keys, values, query_weight,
                                      key_weight, key_cache, value_cache, 6, 6)
        return list(fetched(outputs, 8) if fetch else outputs)

    primals = [queries, keys, values, key_cache, value_cache]
    if transform == "vjp":
        cotangents = [random(output.shape, mx.float32, 40 + index)
                      for index, output in enumerate(expected(*primals))]
        results = [mx.vjp(function, primals, cotangents)[1] for function in (actual, expected)]
    elif transform == "jvp":
        tangents = [random(primal.shape, mx.float32, 50 + index)
                    for index, primal in enumerate(primals)]
        results = [mx.jvp(function, primals, tangents)[1] for function in (actual, expected)]
    elif transform == "compile":  # a user's mx.compile of the step
        results = [mx.compile(function)(*primals) for function in (actual, expected)]
    else:
        batched = [mx.stack([primal, 2 * primal]) for primal in primals]
        results = [mx.vmap(function)(*batched) for function in (actual, expected)]
    assert len(results[0]) == len(results[1])
    for actual_array, expected_array in zip(*results):
        assert_bit_identical(actual_array, expected_array)


BAD_CALLS = {
    "row past the buffer": (dict(offset=CAPACITY), "outside the 64 rows of key_cache"),
    "negative row": (dict(offset=-1), "rows [-1, 0) are outside"),
    "rows straddling the end": (dict(offset=0, write_offset=CAPACITY), "outside"),
    "row beyond int32": (dict(offset=0, write_offset=2**40), "outside the buffers"),
    "values of other heads": (dict(values=mx.zeros((1, 1, 3, WIDTH), mx.bfloat16)),
                              "must have the batch, length and heads of keys"),
    "value buffer of another width": (
        dict(value_cache=mx.zeros((1, HEADS_K, CAPACITY, 64), mx.bfloat16)),
        "value_cache (1, 2, 64, 64) must be (batch 1, heads 2, capacity, width 128)"),
    "key buffer of other heads": (
        dict(key_cache=mx.zeros((1, 1, CAPACITY, WIDTH), mx.bfloat16)), "key_cache (1, 1, 64"),
    "key buffer of rank 3": (dict(key_cache=mx.zeros((HEADS_K, CAPACITY, WIDTH))),
                             "key_cache must have 4 dimensions but has 3"),
    "queries of rank 3": (dict(queries=mx.zeros((1, HEADS_Q, WIDTH), mx.bfloat16)),
                          "queries must have 4 dimensions"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_input_is_a_labelled_value_error(case):
    changes, message = BAD_CALLS[case]
    norm_rope = CompiledDualHeadNormRope(EPS, DIMS, base=BASE)
    queries, keys, values, query_weight, key_weight = layer_inputs(1, 1, mx.bfloat16)
    key_cache, value_cache = buffers(1, mx.bfloat16)
    arguments = dict(queries=queries, keys=keys, values=values, key_cache=key_cache,
                     value_cache=value_cache, offset=3)
    arguments.update(changes)
    positional = [arguments.pop(name) for name in ("queries", "keys", "values")]
    with pytest.raises(DualHeadNormValueError) as raised:
        norm_rope.apply_with_cache(*positional, query_weight, key_weight, **arguments)
    assert str(raised.value).startswith("[dual_head_norm_rope_with_cache] ")
    assert message in str(raised.value)


@pytest.mark.parametrize("write_offset, offset", [(1.0, 0), (True, 0), (None, mx.array(3))])
def test_a_write_row_that_is_not_an_int_is_a_type_error(write_offset, offset):
    norm_rope = CompiledDualHeadNormRope(EPS, DIMS, base=BASE)
    key_cache, value_cache = buffers(1, mx.bfloat16)
    with pytest.raises(TypeError, match=r"^\[dual_head_norm_rope_with_cache\] "):
        norm_rope.apply_with_cache(*layer_inputs(1, 1, mx.bfloat16), key_cache=key_cache,
                                   value_cache=value_cache, offset=offset,
                                   write_offset=write_offset)


def test_a_closed_object_refuses_and_many_objects_and_rows_agree():
    norm_ropes = [CompiledDualHeadNormRope(EPS, DIMS, base=base) for base in (1e4, 1e6)]
    key_cache, value_cache = buffers(1, mx.bfloat16)
    inputs = layer_inputs(1, 1, mx.bfloat16)
    for norm_rope, row in itertools.product(norm_ropes, (0, 1, 1, 2)):
        actual = norm_rope.apply_with_cache(*inputs, key_cache=key_cache,
                                            value_cache=value_cache, offset=row)
        expected = composed_with_cache(norm_rope, *inputs, key_cache, value_cache, row, row)
        for actual_array, expected_array in zip(actual, expected):
            assert_bit_identical(actual_array, expected_array)
    norm_ropes[0].close()
    with pytest.raises(DualHeadNormValueError, match="closed"):
        norm_ropes[0].apply_with_cache(*inputs, key_cache=key_cache, value_cache=value_cache,
                                       offset=0)


def test_c_api_three_outputs_in_order_and_refusals():
    """The C call: exactly three new arrays, queries then the key buffer
    then the value buffer, equal to the facade's; NULL pointers and empty
    handles refused with this call's label."""
    import numpy as np

    from mlx_dualnorm._native import ffi, lib

    def handle_of(values):
        values = np.ascontiguousarray(values, dtype=np.float32)
        shape = ffi.new("int[]", list(values.shape))
        handle = lib.mlx_array_new_data(ffi.from_buffer(values), shape, values.ndim,
                                        lib.MLX_FLOAT32)
        assert handle.ctx != ffi.NULL
        return ffi.gc(ffi.new("mlx_array *", handle), lambda h: lib.mlx_array_free(h[0]))

    def read(handle):
        assert lib.mlx_array_eval(handle) == 0
        shape = tuple(lib.mlx_array_shape(handle)[i] for i in range(lib.mlx_array_ndim(handle)))
        data = lib.mlx_array_data_float32(handle)
        return np.frombuffer(ffi.buffer(data, int(np.prod(shape)) * 4),
                             dtype=np.float32).reshape(shape).copy()

    inputs = [np.array(array) for array in layer_inputs(1, 1, mx.float32)]
    key_cache, value_cache = (np.array(buffer) for buffer in buffers(1, mx.float32))
    handles = [handle_of(array) for array in (*inputs, key_cache, value_cache)]
    offset_value = ffi.new("int32_t *", 9)  # the RoPE offset, an int32 scalar
    offset = ffi.gc(ffi.new("mlx_array *", lib.mlx_array_new_data(
        offset_value, ffi.NULL, 0, lib.MLX_INT32)), lambda h: lib.mlx_array_free(h[0]))
    created = ffi.new("mlx_dualnorm_dual_head_norm_rope **")
    rope = ffi.new("mlx_dualnorm_rope_parameters *", dict(dims=DIMS, base=BASE, scale=1.0))
    error = ffi.new("mlx_dualnorm_error *")
    assert lib.mlx_dualnorm_dual_head_norm_rope_new(created, EPS, rope[0], 0, error) == 0
    norm_rope = ffi.gc(created[0], lib.mlx_dualnorm_dual_head_norm_rope_free)
    result = ffi.new("mlx_vector_array *", lib.mlx_vector_array_new())
    q, k, v, wq, wk, kc, vc = (handle[0] for handle in handles)
    no_freqs = ffi.new("mlx_array *")[0]  # an object with a base takes no table
    assert lib.mlx_dualnorm_dual_head_norm_rope_apply_with_cache(
        result, norm_rope, q, k, v, wq, wk, offset[0], no_freqs, kc, vc, 9, False,
        error) == lib.MLX_DUALNORM_OK
    assert lib.mlx_vector_array_size(result[0]) == 3
    expected = CompiledDualHeadNormRope(EPS, DIMS, base=BASE).apply_with_cache(
        *(mx.array(array) for array in inputs), key_cache=mx.array(key_cache),
        value_cache=mx.array(value_cache), offset=9)
    for index in range(3):
        item = ffi.new("mlx_array *", lib.mlx_array_new())
        assert lib.mlx_vector_array_get(item, result[0], index) == 0
        assert np.array_equal(read(item[0]), np.array(expected[index]))
        assert lib.mlx_array_free(item[0]) == 0
    assert lib.mlx_vector_array_free(result[0]) == 0

    empty = ffi.new("mlx_array *")[0]
    status = lib.mlx_dualnorm_dual_head_norm_rope_apply_with_cache(
        ffi.NULL, norm_rope, q, k, v, wq, wk, offset[0], no_freqs, kc, vc, 0, False, error)
    assert status == lib.MLX_DUALNORM_INVALID_ARGUMENT
    assert ffi.string(error.operation) == b"dual_head_norm_rope_with_cache"
    untouched = ffi.new("mlx_vector_array *", lib.mlx_vector_array_new())
    status = lib.mlx_dualnorm_dual_head_norm_rope_apply_with_cache(
        untouched, norm_rope, q, k, empty, wq, wk, offset[0], no_freqs, kc, vc, 0, True, error)
    assert status == lib.MLX_DUALNORM_INVALID_ARGUMENT
    assert ffi.string(error.description) == b"values is an empty array handle"
    assert lib.mlx_vector_array_size(untouched[0]) == 0
    assert lib.mlx_vector_array_free(untouched[0]) == 0
