"""The mlx-c API the package is built with (the bundled subset, or upstream
mlx-c with MLX_C_DIR), driven through cffi against the real libmlx.

Every call's return code is checked; failures must come back as codes and
messages (the package's handler records them), never as a process exit.
Tests state mlx-c's contract, not one implementation's wording: a failing
call returns non-zero (or an empty handle) and hands the installed handler
one non-empty message naming what failed.
"""

from __future__ import annotations

import queue
import threading

import mlx.core as mx
import numpy as np
import pytest
from helpers.isolated_process import describe, run_python

import mlx_dualnorm  # noqa: F401  (installs the error handler)
from mlx_dualnorm._native import ffi, lib

BUILDER_SIGNATURE = "int(mlx_vector_array*, const mlx_vector_array)"
PAYLOAD_BUILDER_SIGNATURE = "int(mlx_vector_array*, const mlx_vector_array, void*)"


def new_float32_array(values: np.ndarray):
    """A new owned mlx_array holding a copy of `values` (float32)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    shape = ffi.new("int[]", list(values.shape))
    handle = lib.mlx_array_new_data(ffi.from_buffer(values), shape, values.ndim, lib.MLX_FLOAT32)
    assert handle.ctx != ffi.NULL
    return handle


def read_float32_array(handle) -> np.ndarray:
    assert lib.mlx_array_eval(handle) == 0
    ndim = lib.mlx_array_ndim(handle)
    shape = tuple(lib.mlx_array_shape(handle)[i] for i in range(ndim))
    data = lib.mlx_array_data_float32(handle)
    assert data != ffi.NULL
    count = int(np.prod(shape)) if shape else 1
    return np.frombuffer(ffi.buffer(data, count * 4), dtype=np.float32).reshape(shape).copy()


def vector_of(*arrays):
    handles = ffi.new("mlx_array[]", list(arrays))
    vector = lib.mlx_vector_array_new_data(handles, len(arrays))
    assert vector.ctx != ffi.NULL
    return vector


def vector_item(vector, index):
    item = ffi.new("mlx_array*", lib.mlx_array_new())
    assert lib.mlx_vector_array_get(item, vector, index) == 0
    return item[0]


def default_stream():
    device = ffi.new("mlx_device*", lib.mlx_device_new())
    stream = ffi.new("mlx_stream*", lib.mlx_stream_new())
    assert lib.mlx_get_default_device(device) == 0
    assert lib.mlx_get_default_stream(stream, device[0]) == 0
    assert lib.mlx_device_free(device[0]) == 0
    return stream[0]


def test_array_round_trip_keeps_shape_dtype_and_values():
    values = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7
    handle = new_float32_array(values)
    assert lib.mlx_array_ndim(handle) == 3
    assert lib.mlx_array_dim(handle, 1) == 3
    assert lib.mlx_array_size(handle) == 24
    assert lib.mlx_array_itemsize(handle) == 4
    assert lib.mlx_array_nbytes(handle) == 96
    assert lib.mlx_array_dtype(handle) == lib.MLX_FLOAT32
    np.testing.assert_array_equal(read_float32_array(handle), values)
    assert lib.mlx_array_free(handle) == 0


def test_new_data_copies_the_callers_buffer():
    values = np.ones(4, dtype=np.float32)
    handle = new_float32_array(values)
    values[:] = 5
    np.testing.assert_array_equal(read_float32_array(handle), np.ones(4, dtype=np.float32))
    assert lib.mlx_array_free(handle) == 0


def test_int32_round_trip_and_dtype_sizes():
    values = np.array([[1, -2, 3]], dtype=np.int32)
    handle = lib.mlx_array_new_data(ffi.from_buffer(values), ffi.new("int[]", [1, 3]), 2, lib.MLX_INT32)
    assert lib.mlx_array_eval(handle) == 0
    data = lib.mlx_array_data_int32(handle)
    assert [data[i] for i in range(3)] == [1, -2, 3]
    assert lib.mlx_dtype_size(lib.MLX_BFLOAT16) == 2
    assert lib.mlx_dtype_size(lib.MLX_COMPLEX64) == 8
    assert lib.mlx_array_free(handle) == 0


def test_data_accessor_reads_the_bytes_as_its_own_element_type(mlx_c_messages):
    """mlx-c's accessors do not check the dtype: the caller picks the one
    matching mlx_array_dtype, and any other reinterprets the same bytes."""
    values = np.array([1.0, -2.5, 3.0], dtype=np.float32)
    handle = new_float32_array(values)
    assert lib.mlx_array_eval(handle) == 0
    mlx_c_messages.clear()
    data = lib.mlx_array_data_int32(handle)
    assert data != ffi.NULL
    assert [data[i] for i in range(3)] == values.view(np.int32).tolist()
    assert mlx_c_messages == []
    assert lib.mlx_array_free(handle) == 0


def test_empty_handles_fail_with_a_message_and_do_not_exit(mlx_c_messages):
    empty = lib.mlx_array_new()
    assert lib.mlx_array_eval(empty) == 1
    assert "mlx_array" in mlx_c_messages[0]  # names the handle type
    assert lib.mlx_array_free(empty) == 0  # freeing an empty handle is a no-op
    new_vector = lib.mlx_vector_array_new()
    assert lib.mlx_vector_array_size(new_vector) == 0
    assert lib.mlx_vector_array_free(new_vector) == 0


def test_size_of_an_empty_vector_handle_is_an_error(mlx_c_messages):
    mlx_c_messages.clear()
    assert lib.mlx_vector_array_size(ffi.new("mlx_vector_array*")[0]) == 0
    assert "mlx_vector_array" in mlx_c_messages[0]


def test_vector_get_out_of_range_fails(mlx_c_messages):
    handle = new_float32_array(np.ones(2))
    vector = vector_of(handle)
    assert lib.mlx_vector_array_size(vector) == 1
    item = ffi.new("mlx_array*", lib.mlx_array_new())
    assert lib.mlx_vector_array_get(item, vector, 1) == 1
    assert mlx_c_messages and mlx_c_messages[0]
    assert item[0].ctx == ffi.NULL, "a failed get leaves the result alone"
    assert lib.mlx_vector_array_append_value(vector, handle) == 0
    assert lib.mlx_vector_array_size(vector) == 2
    assert lib.mlx_vector_array_free(vector) == 0
    assert lib.mlx_array_free(handle) == 0


def test_fast_rms_norm_matches_mlx_bit_for_bit():
    values = np.random.default_rng(3).standard_normal((4, 96)).astype(np.float32)
    weight_values = np.random.default_rng(4).standard_normal(96).astype(np.float32)
    x, weight = new_float32_array(values), new_float32_array(weight_values)
    stream = default_stream()
    result = ffi.new("mlx_array*", lib.mlx_array_new())
    assert lib.mlx_fast_rms_norm(result, x, weight, 1e-5, stream) == 0
    expected = mx.fast.rms_norm(mx.array(values), mx.array(weight_values), 1e-5)
    np.testing.assert_array_equal(read_float32_array(result[0]), np.array(expected))
    # An empty weight handle means no weight.
    assert lib.mlx_fast_rms_norm(result, x, lib.mlx_array_new(), 1e-5, stream) == 0
    expected = mx.fast.rms_norm(mx.array(values), None, 1e-5)
    np.testing.assert_array_equal(read_float32_array(result[0]), np.array(expected))
    for handle in (result[0], x, weight):
        assert lib.mlx_array_free(handle) == 0
    assert lib.mlx_stream_free(stream) == 0


def test_fast_rms_norm_reports_mlx_argument_errors(mlx_c_messages):
    x = new_float32_array(np.ones((2, 8)))
    short_weight = new_float32_array(np.ones(3))
    stream = default_stream()
    result = ffi.new("mlx_array*", lib.mlx_array_new())
    assert lib.mlx_fast_rms_norm(result, x, short_weight, 1e-6, stream) == 1
    assert mlx_c_messages[0].startswith("[rms_norm]")
    assert result[0].ctx == ffi.NULL
    for handle in (x, short_weight):
        assert lib.mlx_array_free(handle) == 0
    assert lib.mlx_stream_free(stream) == 0


def test_default_device_and_cpu_stream():
    device = ffi.new("mlx_device*", lib.mlx_device_new())
    assert lib.mlx_get_default_device(device) == 0
    device_type = ffi.new("mlx_device_type*")
    assert lib.mlx_device_get_type(device_type, device[0]) == 0
    expected = lib.MLX_GPU if mx.default_device() == mx.gpu else lib.MLX_CPU
    assert device_type[0] == expected
    assert lib.mlx_device_free(device[0]) == 0
    cpu_stream = lib.mlx_default_cpu_stream_new()
    assert cpu_stream.ctx != ffi.NULL
    assert lib.mlx_stream_free(cpu_stream) == 0


@pytest.mark.skipif(mx.is_available(mx.gpu), reason="needs a CPU-only MLX")
def test_gpu_stream_on_cpu_only_mlx_is_an_error_not_an_exit(mlx_c_messages):
    stream = lib.mlx_default_gpu_stream_new()
    assert stream.ctx == ffi.NULL
    assert "Cannot get gpu stream without gpu backend" in mlx_c_messages[0]


class CountingRmsNormBuilder:
    """A graph builder written in Python through cffi: rms_norm of its one
    input, counting how often MLX calls it (i.e. traces)."""

    def __init__(self, eps: float = 1e-6, status: int = 0) -> None:
        self.calls = 0
        self.eps = eps
        self.status = status
        self.callback = ffi.callback(BUILDER_SIGNATURE, self.build)

    def build(self, output_vector, input_vector) -> int:
        self.calls += 1
        if self.status != 0:
            return self.status
        stream = default_stream()
        queries = vector_item(input_vector, 0)
        normalized = ffi.new("mlx_array*", lib.mlx_array_new())
        status = lib.mlx_fast_rms_norm(normalized, queries, lib.mlx_array_new(), self.eps, stream)
        if status == 0:
            status = lib.mlx_vector_array_set_data(output_vector, normalized, 1)
        lib.mlx_array_free(normalized[0])
        lib.mlx_array_free(queries)
        lib.mlx_stream_free(stream)
        return status


def apply_closure(closure, *arrays):
    inputs = vector_of(*arrays)
    outputs = ffi.new("mlx_vector_array*", lib.mlx_vector_array_new())
    status = lib.mlx_closure_apply(outputs, closure, inputs)
    assert lib.mlx_vector_array_free(inputs) == 0
    return status, outputs[0]


def first_output(outputs) -> np.ndarray:
    assert lib.mlx_vector_array_size(outputs) == 1
    item = vector_item(outputs, 0)
    result = read_float32_array(item)
    assert lib.mlx_array_free(item) == 0
    assert lib.mlx_vector_array_free(outputs) == 0
    return result


def test_closure_calls_the_c_function_and_returns_its_outputs():
    builder = CountingRmsNormBuilder()
    closure = lib.mlx_closure_new_func(builder.callback)
    values = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    x = new_float32_array(values)
    status, outputs = apply_closure(closure, x)
    assert status == 0
    np.testing.assert_array_equal(first_output(outputs), np.array(mx.fast.rms_norm(mx.array(values), None, 1e-6)))
    assert builder.calls == 1
    assert lib.mlx_closure_free(closure) == 0
    assert lib.mlx_array_free(x) == 0


def test_a_failing_c_function_fails_the_apply_without_exiting(mlx_c_messages):
    builder = CountingRmsNormBuilder(status=7)
    closure = lib.mlx_closure_new_func(builder.callback)
    x = new_float32_array(np.ones(4))
    status, outputs = apply_closure(closure, x)
    assert status == 1
    assert builder.calls == 1
    assert "mlx_closure" in mlx_c_messages[0]
    assert lib.mlx_vector_array_free(outputs) == 0
    assert lib.mlx_closure_free(closure) == 0
    assert lib.mlx_array_free(x) == 0


def test_a_c_function_that_leaves_its_result_empty_fails_the_apply(mlx_c_messages):
    @ffi.callback(BUILDER_SIGNATURE)
    def leaves_result_empty(output_vector, input_vector):
        return 0

    closure = lib.mlx_closure_new_func(leaves_result_empty)
    x = new_float32_array(np.ones(2))
    mlx_c_messages.clear()
    status, outputs = apply_closure(closure, x)
    assert status == 1
    assert "mlx_vector_array" in mlx_c_messages[0]
    assert lib.mlx_vector_array_free(outputs) == 0
    assert lib.mlx_closure_free(closure) == 0
    assert lib.mlx_array_free(x) == 0


def test_compiled_closure_traces_once_and_shapeless_reuses_the_trace():
    builder = CountingRmsNormBuilder()
    closure = lib.mlx_closure_new_func(builder.callback)
    compiled = ffi.new("mlx_closure*", lib.mlx_closure_new())
    assert lib.mlx_compile(compiled, closure, True) == 0
    assert builder.calls == 0, "compiling only wraps; tracing happens at the first call"
    for rows in (2, 2, 5):
        values = np.random.default_rng(rows).standard_normal((rows, 32)).astype(np.float32)
        x = new_float32_array(values)
        status, outputs = apply_closure(compiled[0], x)
        assert status == 0
        expected = np.array(mx.fast.rms_norm(mx.array(values), None, 1e-6))
        np.testing.assert_array_equal(first_output(outputs), expected)
        assert lib.mlx_array_free(x) == 0
    assert builder.calls == 1
    assert lib.mlx_closure_free(compiled[0]) == 0
    assert lib.mlx_closure_free(closure) == 0


def compile_counting_rms_norm(fun_id: int):
    """A counting rms-norm closure compiled (shapeless) under ``fun_id``, a
    (2, 8) input, and a function that applies the compiled closure to it once
    and returns how many times the closure has been traced so far."""
    builder = CountingRmsNormBuilder()
    closure = lib.mlx_closure_new_func(builder.callback)
    compiled = ffi.new("mlx_closure*", lib.mlx_closure_new())
    assert lib.mlx_detail_compile(compiled, closure, fun_id, True, ffi.NULL, 0) == 0
    x = new_float32_array(np.ones((2, 8)))

    def apply_and_count() -> int:
        status, outputs = apply_closure(compiled[0], x)
        assert status == 0
        assert lib.mlx_vector_array_free(outputs) == 0
        return builder.calls

    return builder, closure, compiled, x, apply_and_count


def test_detail_compile_erase_clear_cache_and_disable_force_retraces():
    fun_id = 0x5EED
    builder, closure, compiled, x, apply_and_count = compile_counting_rms_norm(fun_id)

    assert apply_and_count() == 1
    assert apply_and_count() == 1
    assert lib.mlx_detail_compile_erase(fun_id) == 0
    assert apply_and_count() == 2
    assert lib.mlx_detail_compile_clear_cache() == 0
    assert apply_and_count() == 3
    assert lib.mlx_closure_free(compiled[0]) == 0
    assert lib.mlx_closure_free(closure) == 0
    assert lib.mlx_detail_compile_erase(fun_id) == 0
    assert lib.mlx_array_free(x) == 0


def test_detail_compile_erase_drops_only_the_calling_threads_entry():
    """MLX's compile caches are per thread, and mlx_detail_compile_erase
    erases from the caller's: a worker thread that traced keeps its entry
    (no retrace there) while the erasing thread traces anew."""
    fun_id = 0x5EEE
    builder, closure, compiled, x, apply_and_count = compile_counting_rms_norm(fun_id)

    # The worker stays alive between requests: its cache lives as long as it.
    requests: queue.Queue = queue.Queue()
    replies: queue.Queue = queue.Queue()

    def worker() -> None:
        for request in iter(requests.get, None):
            replies.put(request())

    def on_worker(request):
        requests.put(request)
        return replies.get(timeout=60)

    def traces_of(run) -> int:
        before = builder.calls
        assert run() == builder.calls
        return builder.calls - before

    def settle(run) -> None:
        """Calls until one hits the cache (a thread's first calls may
        trace more than once while MLX sets up its default stream)."""
        for _ in range(4):
            if traces_of(run) == 0:
                return
        pytest.fail("the compiled closure never stopped retracing")

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        settle(lambda: on_worker(apply_and_count))
        settle(apply_and_count)
        assert lib.mlx_detail_compile_erase(fun_id) == 0
        assert traces_of(lambda: on_worker(apply_and_count)) == 0, "the worker's entry survives"
        assert traces_of(apply_and_count) == 1, "this thread's entry is gone"
        assert on_worker(lambda: lib.mlx_detail_compile_erase(fun_id)) == 0
        assert traces_of(lambda: on_worker(apply_and_count)) == 1
    finally:
        requests.put(None)
        thread.join()
    assert lib.mlx_detail_compile_erase(fun_id) == 0
    assert lib.mlx_closure_free(compiled[0]) == 0
    assert lib.mlx_closure_free(closure) == 0
    assert lib.mlx_array_free(x) == 0


def test_compiling_while_compile_is_disabled_yields_the_plain_function():
    """MLX decides at compile time: a closure compiled while compilation is
    disabled runs its builder on every call."""
    builder = CountingRmsNormBuilder()
    closure = lib.mlx_closure_new_func(builder.callback)
    compiled = ffi.new("mlx_closure*", lib.mlx_closure_new())
    assert lib.mlx_disable_compile() == 0
    try:
        assert lib.mlx_compile(compiled, closure, True) == 0
    finally:
        assert lib.mlx_enable_compile() == 0
    x = new_float32_array(np.ones((2, 8)))
    for expected_calls in (1, 2, 3):
        status, outputs = apply_closure(compiled[0], x)
        assert status == 0
        assert lib.mlx_vector_array_free(outputs) == 0
        assert builder.calls == expected_calls
    assert lib.mlx_closure_free(compiled[0]) == 0
    assert lib.mlx_closure_free(closure) == 0
    assert lib.mlx_array_free(x) == 0


def test_payload_closure_passes_the_payload_and_runs_dtor_after_the_last_copy():
    seen_payloads: list[int] = []
    destroyed: list[int] = []

    @ffi.callback(PAYLOAD_BUILDER_SIGNATURE)
    def identity_builder(output_vector, input_vector, payload):
        seen_payloads.append(int(ffi.cast("uintptr_t", payload)))
        item = vector_item(input_vector, 0)
        status = lib.mlx_vector_array_set_data(output_vector, ffi.new("mlx_array[]", [item]), 1)
        lib.mlx_array_free(item)
        return status

    @ffi.callback("void(void*)")
    def destroy_payload(payload):
        destroyed.append(int(ffi.cast("uintptr_t", payload)))

    payload = ffi.cast("void*", 1234)
    closure = lib.mlx_closure_new_func_payload(identity_builder, payload, destroy_payload)
    compiled = ffi.new("mlx_closure*", lib.mlx_closure_new())
    assert lib.mlx_compile(compiled, closure, False) == 0
    x = new_float32_array(np.arange(3))
    status, outputs = apply_closure(compiled[0], x)
    assert status == 0
    np.testing.assert_array_equal(first_output(outputs), np.arange(3, dtype=np.float32))
    assert seen_payloads == [1234]
    assert lib.mlx_closure_free(closure) == 0
    assert destroyed == [], "the compiled closure still holds a copy"
    assert lib.mlx_closure_free(compiled[0]) == 0
    assert destroyed == [1234]
    assert lib.mlx_array_free(x) == 0


def test_error_handler_receives_messages_and_its_data_is_released_on_replacement():
    received: list[str] = []
    released: list[int] = []

    @ffi.callback("mlx_error_handler_func")
    def collect(message, data):
        received.append(ffi.string(message).decode())

    @ffi.callback("void(void*)")
    def release(data):
        released.append(int(ffi.cast("uintptr_t", data)))

    lib.mlx_set_error_handler(collect, ffi.cast("void*", 99), release)
    try:
        assert lib.mlx_array_eval(lib.mlx_array_new()) == 1
    finally:
        lib.mlx_dualnorm_install_error_handler()
    assert len(received) == 1 and "mlx_array" in received[0], received
    assert released == [99]


def test_error_messages_end_with_where_they_were_reported():
    """mlx_error appends " at FILE:LINE" to the formatted message."""
    received: list[str] = []

    @ffi.callback("mlx_error_handler_func")
    def collect(message, data):
        received.append(ffi.string(message).decode())

    lib.mlx_set_error_handler(collect, ffi.NULL, ffi.NULL)
    try:
        lib._mlx_error(b"caller.c", 42, b"[%s] went wrong", ffi.new("char[]", b"probe"))
    finally:
        lib.mlx_dualnorm_install_error_handler()
    assert received == ["[probe] went wrong at caller.c:42"]


def test_the_default_error_handler_prints_and_exits():
    """Without an installed handler, mlx-c prints the message and ends the
    process: the reason the package installs its own at import."""
    process = run_python(
        """
        import mlx_dualnorm
        from mlx_dualnorm._native import ffi, lib
        lib.mlx_set_error_handler(ffi.NULL, ffi.NULL, ffi.NULL)
        lib.mlx_array_eval(lib.mlx_array_new())
        print("still running")
        """
    )
    assert process.returncode != 0, describe(process)
    assert "still running" not in process.stdout
    assert "MLX error: " in process.stdout and "mlx_array" in process.stdout, describe(process)


# ---- The package's versioned call struct -------------------------------------
# mlx_dualnorm_dual_head_norm_rope_apply_call (dual_head_norm_rope.h), the
# entry every norm + RoPE apply fills: its outputs are the older entries'
# bit for bit, and a struct_size below the first version's is refused.

ROPE_DIMS = 32


def _owned(handle):
    return ffi.gc(ffi.new("mlx_array *", handle), lambda owned: lib.mlx_array_free(owned[0]))


def _rope_call_arrays(seed: int):
    """Queries (1, 1, 4, 64), keys and values (1, 1, 2, 64), weights (64,),
    buffers (1, 2, 8, 64) and an int32 offset, as owned handles."""
    generator = np.random.default_rng(seed)
    shapes = {"queries": (1, 1, 4, 64), "keys": (1, 1, 2, 64), "values": (1, 1, 2, 64),
              "query_weight": (64,), "key_weight": (64,), "key_cache": (1, 2, 8, 64),
              "value_cache": (1, 2, 8, 64)}
    arrays = {name: _owned(new_float32_array(generator.standard_normal(shape)))
              for name, shape in shapes.items()}
    offset_value = ffi.new("int32_t *", 3)
    arrays["offset"] = _owned(lib.mlx_array_new_data(offset_value, ffi.NULL, 0, lib.MLX_INT32))
    return arrays


def _new_norm_rope():
    created = ffi.new("mlx_dualnorm_dual_head_norm_rope **")
    rope = ffi.new("mlx_dualnorm_rope_parameters *", dict(dims=ROPE_DIMS, base=1e4, scale=1.0))
    error = ffi.new("mlx_dualnorm_error *")
    assert lib.mlx_dualnorm_dual_head_norm_rope_new(
        created, 1e-5, rope[0], lib.MLX_DUALNORM_MODE_AUTO, error) == lib.MLX_DUALNORM_OK
    return ffi.gc(created[0], lib.mlx_dualnorm_dual_head_norm_rope_free)


def _outputs(vector_pointer) -> list[np.ndarray]:
    count = lib.mlx_vector_array_size(vector_pointer[0])
    outputs = []
    for index in range(count):
        item = vector_item(vector_pointer[0], index)
        outputs.append(read_float32_array(item))
        assert lib.mlx_array_free(item) == 0
    assert lib.mlx_vector_array_free(vector_pointer[0]) == 0
    return outputs


def _call_struct(arrays, cache_write=ffi.NULL, struct_size=None):
    call = ffi.new("mlx_dualnorm_dual_head_norm_rope_call *")
    call.struct_size = (ffi.sizeof("mlx_dualnorm_dual_head_norm_rope_call")
                        if struct_size is None else struct_size)
    call.inputs.queries = arrays["queries"][0]
    call.inputs.keys = arrays["keys"][0]
    call.inputs.query_scale_weight = arrays["query_weight"][0]
    call.inputs.key_scale_weight = arrays["key_weight"][0]
    call.inputs.rope_offset = arrays["offset"][0]
    call.inputs.freqs = lib.mlx_array_new()  # an object with a base takes no table
    call.cache_write = cache_write
    return call


def _cache_write(arrays, fetch: bool):
    write = ffi.new("mlx_dualnorm_cache_write *")
    write.values = arrays["values"][0]
    write.key_cache = arrays["key_cache"][0]
    write.value_cache = arrays["value_cache"][0]
    write.write_offset = 3
    write.fetch = fetch
    return write


@pytest.mark.parametrize("fetch", [False, True])
def test_apply_call_with_a_cache_write_is_apply_with_cache_bit_for_bit(fetch):
    arrays = _rope_call_arrays(1)
    norm_rope = _new_norm_rope()
    error = ffi.new("mlx_dualnorm_error *")
    write = _cache_write(arrays, fetch)
    through_struct = ffi.new("mlx_vector_array *", lib.mlx_vector_array_new())
    assert lib.mlx_dualnorm_dual_head_norm_rope_apply_call(
        through_struct, norm_rope, _call_struct(arrays, write), error) == lib.MLX_DUALNORM_OK
    through_arguments = ffi.new("mlx_vector_array *", lib.mlx_vector_array_new())
    assert lib.mlx_dualnorm_dual_head_norm_rope_apply_with_cache(
        through_arguments, norm_rope, arrays["queries"][0], arrays["keys"][0],
        arrays["values"][0], arrays["query_weight"][0], arrays["key_weight"][0],
        arrays["offset"][0], lib.mlx_array_new(), arrays["key_cache"][0],
        arrays["value_cache"][0], 3, fetch, error) == lib.MLX_DUALNORM_OK
    expected_count = (lib.MLX_DUALNORM_CACHE_FETCH_OUTPUT_COUNT if fetch
                      else lib.MLX_DUALNORM_CACHE_WRITE_OUTPUT_COUNT)
    actual, expected = _outputs(through_struct), _outputs(through_arguments)
    assert len(actual) == len(expected) == expected_count
    for actual_array, expected_array in zip(actual, expected):
        assert actual_array.shape == expected_array.shape
        assert actual_array.tobytes() == expected_array.tobytes()
    # Row 3 of the key buffer written holds the rotated keys, not the input's.
    key_buffer_before = read_float32_array(arrays["key_cache"][0])
    assert actual[1][:, :, 3].tobytes() != key_buffer_before[:, :, 3].tobytes()


def test_apply_call_without_a_cache_write_is_apply_bit_for_bit():
    arrays = _rope_call_arrays(2)
    norm_rope = _new_norm_rope()
    error = ffi.new("mlx_dualnorm_error *")
    through_struct = ffi.new("mlx_vector_array *", lib.mlx_vector_array_new())
    assert lib.mlx_dualnorm_dual_head_norm_rope_apply_call(
        through_struct, norm_rope, _call_struct(arrays), error) == lib.MLX_DUALNORM_OK
    through_arguments = ffi.new("mlx_vector_array *", lib.mlx_vector_array_new())
    assert lib.mlx_dualnorm_dual_head_norm_rope_apply(
        through_arguments, norm_rope, arrays["queries"][0], arrays["keys"][0],
        arrays["query_weight"][0], arrays["key_weight"][0], arrays["offset"][0],
        error) == lib.MLX_DUALNORM_OK
    actual, expected = _outputs(through_struct), _outputs(through_arguments)
    assert len(actual) == len(expected) == lib.MLX_DUALNORM_ROPE_OUTPUT_COUNT
    for actual_array, expected_array in zip(actual, expected):
        assert actual_array.tobytes() == expected_array.tobytes()


@pytest.mark.parametrize("struct_size", [0, 1, "one field short"])
def test_apply_call_refuses_a_struct_size_below_the_first_version(struct_size):
    if struct_size == "one field short":
        struct_size = ffi.sizeof("mlx_dualnorm_dual_head_norm_rope_call") - ffi.sizeof("void *")
    arrays = _rope_call_arrays(3)
    norm_rope = _new_norm_rope()
    error = ffi.new("mlx_dualnorm_error *")
    untouched = ffi.new("mlx_vector_array *", lib.mlx_vector_array_new())
    status = lib.mlx_dualnorm_dual_head_norm_rope_apply_call(
        untouched, norm_rope, _call_struct(arrays, _cache_write(arrays, False), struct_size),
        error)
    assert status == lib.MLX_DUALNORM_INVALID_ARGUMENT
    assert ffi.string(error.operation) == b"dual_head_norm_rope"
    assert ffi.string(error.description) == (
        f"the call's struct_size ({struct_size}) is smaller than the first version's "
        f"({ffi.sizeof('mlx_dualnorm_dual_head_norm_rope_call')})"
    ).encode()
    assert lib.mlx_vector_array_size(untouched[0]) == 0
    assert lib.mlx_vector_array_free(untouched[0]) == 0
    fresh = ffi.new("mlx_vector_array *", lib.mlx_vector_array_new())
    status = lib.mlx_dualnorm_dual_head_norm_rope_apply_call(fresh, norm_rope, ffi.NULL, error)
    assert status == lib.MLX_DUALNORM_INVALID_ARGUMENT
    assert ffi.string(error.description) == b"the call is NULL"
    assert lib.mlx_vector_array_size(fresh[0]) == 0
    assert lib.mlx_vector_array_free(fresh[0]) == 0


def test_apply_call_labels_a_cache_write_error_as_that_call():
    arrays = _rope_call_arrays(4)
    norm_rope = _new_norm_rope()
    error = ffi.new("mlx_dualnorm_error *")
    write = _cache_write(arrays, True)
    write.write_offset = 8  # the buffers have 8 rows: row 8 is past their end
    result = ffi.new("mlx_vector_array *", lib.mlx_vector_array_new())
    status = lib.mlx_dualnorm_dual_head_norm_rope_apply_call(
        result, norm_rope, _call_struct(arrays, write), error)
    assert status == lib.MLX_DUALNORM_INVALID_ARGUMENT
    assert ffi.string(error.operation) == b"dual_head_norm_rope_with_cache"
    assert ffi.string(error.description) == b"rows [8, 9) are outside the 8 rows of key_cache"
    assert lib.mlx_vector_array_free(result[0]) == 0


def test_one_int32_scalar_is_held_per_position():
    """private/position_scalar.h: the RoPE offset given as an int and the
    KV-cache write row take their int32 scalar from one holder, which keeps
    the last position's and makes a new one only for a new position; each
    handle it gives holds its own reference to the array."""

    def position_scalar(position: int):
        handle = ffi.new("mlx_array*", lib.mlx_array_new())
        assert lib.dualnorm_position_scalar(handle, position) == 0
        assert lib.mlx_array_ndim(handle[0]) == 0
        assert lib.mlx_array_dtype(handle[0]) == lib.MLX_INT32
        return handle[0]

    first, same, other = position_scalar(41), position_scalar(41), position_scalar(-7)
    first_data, same_data, other_data = (
        lib.mlx_array_data_int32(handle) for handle in (first, same, other)
    )
    assert first_data == same_data  # the one array held for position 41
    assert other_data != first_data
    assert (first_data[0], other_data[0]) == (41, -7)
    assert lib.mlx_array_free(first) == 0
    assert lib.mlx_array_data_int32(same)[0] == 41  # `same` keeps the array alive
    assert lib.mlx_array_free(same) == 0
    assert lib.mlx_array_free(other) == 0
