/* The norm + RoPE with the KV-cache write (dual_head_norm_rope_cache.h;
 * shared parts: private/norm_rope.h): the norm + RoPE, then the two writes
 * of mlx-lm's KVCache.update_and_fetch (`keys[..., w:w+L, :] = rotated
 * keys`, the same for the transposed values) as MLX slice updates.
 * mlx-lm's indexing makes a SliceUpdate whose position is a constant;
 * here the position is an int32 scalar INPUT of the graph (MLX's
 * DynamicSliceUpdate), so a decode step at the next row replays one trace.
 * Both copy the buffer (or take its memory when MLX may donate it) and then
 * the update's elements, cast to the buffer's dtype: the same bits in every
 * element. The graphs are compiled per input shape as the norm + RoPE's,
 * so a buffer that grew traces once per capacity.
 *
 * In FUSED mode one launch does the norm + RoPE and both writes where the
 * backend takes the write (dualnorm_one_launch_writes_cache); else the
 * launch is followed by MLX's slice updates at a constant row.
 */
#define _POSIX_C_SOURCE 200809L

#include "private/norm_rope.h"

#include "private/call_errors.h"

#include <stdint.h>

/* The cache axis of (B, H, capacity, D) buffers, where rows are written. */
static const int CACHE_ROW_AXIS[1] = {2};

/* Rows [w, w + L) of both buffers written, on `stream`: `written[0]` the key
 * buffer with the rotated keys (B, Hk, L, D), `written[1]` the value buffer
 * with the values (B, L, Hk, Dv) transposed to (B, Hk, L, Dv). With
 * `constant_row` NULL the row is `write_offset`, an int32 scalar read when
 * the graph runs (MLX's DynamicSliceUpdate: a trace replays at every row);
 * else it is *constant_row, MLX's SliceUpdate, what mlx-lm's indexing
 * builds, for the eager fused route (no trace to replay there, and MLX's
 * CUDA DynamicSliceUpdate launches a kernel per write to compute the
 * offset). `written` holds two empty handles on entry and receives new
 * arrays the caller frees; everything else is borrowed. */
static int write_cache_rows(mlx_array written[2], const mlx_array rotated_keys,
                            const mlx_array values, const mlx_array key_cache,
                            const mlx_array value_cache, const mlx_array write_offset,
                            const int* constant_row, const mlx_stream stream) {
  const mlx_array buffers[2] = {key_cache, value_cache};
  mlx_array head_major_values = mlx_array_new();
  int status = mlx_transpose_axes(&head_major_values, values, DUALNORM_HEAD_MAJOR_AXES,
                                  ATTENTION_INPUT_RANK, stream) != 0;
  const mlx_array updates[2] = {rotated_keys, head_major_values};
  for (int side = 0; status == 0 && side < 2; ++side) {
    if (constant_row == NULL) {
      status = mlx_slice_update_dynamic(&written[side], buffers[side], updates[side],
                                        write_offset, CACHE_ROW_AXIS, 1, stream) != 0;
      continue;
    }
    const int* shape = mlx_array_shape(buffers[side]);
    const int length = mlx_array_shape(updates[side])[2];
    const int start[ATTENTION_INPUT_RANK] = {0, 0, *constant_row, 0};
    const int stop[ATTENTION_INPUT_RANK] = {shape[0], shape[1], *constant_row + length,
                                            shape[3]};
    const int strides[ATTENTION_INPUT_RANK] = {1, 1, 1, 1};
    status = mlx_slice_update(&written[side], buffers[side], updates[side], start,
                              ATTENTION_INPUT_RANK, stop, ATTENTION_INPUT_RANK, strides,
                              ATTENTION_INPUT_RANK, stream) != 0;
  }
  status |= mlx_array_free(head_major_values);
  return status;
}

/* Sets `*res` (owned by the caller) to the call's outputs in the caller's
 * ABI order, published once at the end: the rotated queries of `rotated`
 * (the norm + RoPE's two outputs, borrowed), then both buffers written
 * (write_cache_rows) from the cache inputs at `inputs[first_cache_input]`
 * onwards (borrowed), on the default device's stream as mlx-lm's indexing
 * writes. Every handle made here is freed on every path. */
static int publish_cache_outputs(mlx_vector_array* res, const mlx_vector_array rotated,
                                 const mlx_vector_array inputs, size_t first_cache_input,
                                 const int* constant_row) {
  mlx_array cache_inputs[CACHE_GRAPH_EXTRA_INPUTS] = {mlx_array_new(), mlx_array_new(),
                                                      mlx_array_new(), mlx_array_new()};
  mlx_array outputs[MLX_DUALNORM_CACHE_WRITE_OUTPUT_COUNT] = {
      mlx_array_new(), mlx_array_new(), mlx_array_new()};
  mlx_array rotated_keys = mlx_array_new();
  mlx_device default_device = mlx_device_new();
  mlx_stream stream = mlx_stream_new();
  int status = 0;
  for (size_t index = 0; status == 0 && index < CACHE_GRAPH_EXTRA_INPUTS; ++index) {
    status = mlx_vector_array_get(&cache_inputs[index], inputs, first_cache_input + index) != 0;
  }
  status = status || mlx_vector_array_get(&outputs[0], rotated, 0) != 0 ||
           mlx_vector_array_get(&rotated_keys, rotated, 1) != 0 ||
           mlx_get_default_device(&default_device) != 0 ||
           mlx_get_default_stream(&stream, default_device) != 0 ||
           write_cache_rows(&outputs[1], rotated_keys, cache_inputs[0], cache_inputs[1],
                            cache_inputs[2], cache_inputs[3], constant_row, stream) != 0 ||
           mlx_vector_array_set_data(res, outputs, MLX_DUALNORM_CACHE_WRITE_OUTPUT_COUNT) != 0;
  for (size_t index = 0; index < CACHE_GRAPH_EXTRA_INPUTS; ++index) {
    status |= mlx_array_free(cache_inputs[index]);
  }
  for (size_t index = 0; index < MLX_DUALNORM_CACHE_WRITE_OUTPUT_COUNT; ++index) {
    status |= mlx_array_free(outputs[index]);
  }
  status |= mlx_array_free(rotated_keys);
  status |= mlx_stream_free(stream);
  status |= mlx_device_free(default_device);
  return status;
}

/* Inputs: the norm + RoPE graph's (dualnorm_norm_rope_graph_inputs), then
 * values, key_cache, value_cache and the write offset. Outputs:
 * publish_cache_outputs's. The input vector belongs to the closure; every
 * handle made here is freed on every path. */
static int build_norm_rope_cache_graph(mlx_vector_array* output_vector,
                                       const mlx_vector_array input_vector, void* payload) {
  size_t norm_rope_inputs = dualnorm_norm_rope_input_count(payload);
  if (!dualnorm_graph_inputs_expected(output_vector, input_vector,
                                      norm_rope_inputs + CACHE_GRAPH_EXTRA_INPUTS)) {
    return 1;
  }
  mlx_array norm_rope_input_arrays[NORM_ROPE_MAX_INPUTS];
  for (size_t index = 0; index < NORM_ROPE_MAX_INPUTS; ++index) {
    norm_rope_input_arrays[index] = mlx_array_new();
  }
  mlx_vector_array norm_rope_inputs_vector = mlx_vector_array_new();
  mlx_vector_array rotated = mlx_vector_array_new();
  int status = 0;
  for (size_t index = 0; status == 0 && index < norm_rope_inputs; ++index) {
    status = mlx_vector_array_get(&norm_rope_input_arrays[index], input_vector, index) != 0;
  }
  status = status ||
           mlx_vector_array_set_data(&norm_rope_inputs_vector, norm_rope_input_arrays,
                                     norm_rope_inputs) != 0 ||
           dualnorm_build_norm_rope_graph(&rotated, norm_rope_inputs_vector, payload) != 0 ||
           publish_cache_outputs(output_vector, rotated, input_vector, norm_rope_inputs,
                                 NULL) != 0;
  for (size_t index = 0; index < NORM_ROPE_MAX_INPUTS; ++index) {
    status |= mlx_array_free(norm_rope_input_arrays[index]);
  }
  status |= mlx_vector_array_free(norm_rope_inputs_vector);
  status |= mlx_vector_array_free(rotated);
  return status;
}

mlx_closure dualnorm_new_plain_cache_graph(const void* owner, int weight_set) {
  return dualnorm_new_norm_rope_closure(owner, weight_set, build_norm_rope_cache_graph);
}

/* Appends the write position to `inputs` as an int32 scalar: the object's
 * last one while the position stays the same, else a new one it keeps. */
static int append_write_offset(mlx_vector_array inputs,
                               mlx_dualnorm_dual_head_norm_rope* norm_rope, int write_offset) {
  pthread_mutex_lock(&norm_rope->write_offset_lock);
  int status = 0;
  if (norm_rope->write_offset_scalar.ctx == NULL ||
      norm_rope->write_offset_value != write_offset) {
    int32_t value = write_offset;
    mlx_array scalar = mlx_array_new_data(&value, NULL, 0, MLX_INT32);
    if (scalar.ctx == NULL) {
      status = 1;
    } else {
      status |= mlx_array_free(norm_rope->write_offset_scalar);
      norm_rope->write_offset_scalar = scalar; /* owned by the object from here */
      norm_rope->write_offset_value = write_offset;
    }
  }
  if (status == 0) {
    status = mlx_vector_array_append_value(inputs, norm_rope->write_offset_scalar) != 0;
  }
  pthread_mutex_unlock(&norm_rope->write_offset_lock);
  return status;
}

/* Sets `*res` to the outputs of a cache write, `written` (borrowed: rotated
 * queries, both buffers written) followed by rows [0, end) of both
 * buffers, MLX slices on the default device's stream: what the class's
 * `buffer[..., :end, :]` fetches (the graphs cannot hold them: their
 * shape changes at every decode step). Every handle made here is freed
 * on every path; `*res` is set only once everything is built. */
static int publish_with_fetched_rows(mlx_vector_array* res, const mlx_vector_array written,
                                     int end) {
  mlx_array outputs[MLX_DUALNORM_CACHE_FETCH_OUTPUT_COUNT] = {
      mlx_array_new(), mlx_array_new(), mlx_array_new(), mlx_array_new(), mlx_array_new()};
  mlx_device default_device = mlx_device_new();
  mlx_stream stream = mlx_stream_new();
  int status = mlx_get_default_device(&default_device) != 0 ||
               mlx_get_default_stream(&stream, default_device) != 0;
  for (size_t index = 0; status == 0 && index < MLX_DUALNORM_CACHE_WRITE_OUTPUT_COUNT;
       ++index) {
    status = mlx_vector_array_get(&outputs[index], written, index) != 0;
  }
  /* Outputs 1 and 2 are the buffers written; their rows go to 3 and 4. */
  for (int buffer = 1; status == 0 && buffer < MLX_DUALNORM_CACHE_WRITE_OUTPUT_COUNT; ++buffer) {
    const int* shape = mlx_array_shape(outputs[buffer]);
    const int start[ATTENTION_INPUT_RANK] = {0, 0, 0, 0};
    const int stop[ATTENTION_INPUT_RANK] = {shape[0], shape[1], end, shape[3]};
    const int strides[ATTENTION_INPUT_RANK] = {1, 1, 1, 1};
    mlx_array* fetched_rows = &outputs[buffer + MLX_DUALNORM_CACHE_WRITE_OUTPUT_COUNT - 1];
    status = mlx_slice(fetched_rows, outputs[buffer], start, ATTENTION_INPUT_RANK, stop,
                       ATTENTION_INPUT_RANK, strides, ATTENTION_INPUT_RANK, stream) != 0;
  }
  status = status ||
           mlx_vector_array_set_data(res, outputs, MLX_DUALNORM_CACHE_FETCH_OUTPUT_COUNT) != 0;
  for (size_t index = 0; index < MLX_DUALNORM_CACHE_FETCH_OUTPUT_COUNT; ++index) {
    status |= mlx_array_free(outputs[index]);
  }
  status |= mlx_stream_free(stream);
  status |= mlx_device_free(default_device);
  return status;
}

/* The cache graph's input vector (owned by the caller): the norm + RoPE
 * graph's, then values, the buffers and the write position; `*weight_set`
 * the call's. An empty handle, with the reason sent to mlx_error, on
 * failure. */
static mlx_vector_array cache_graph_inputs(mlx_dualnorm_dual_head_norm_rope* norm_rope,
                                           const dual_head_norm_call* sides,
                                           const mlx_dualnorm_rope_inputs* inputs,
                                           const mlx_dualnorm_cache_write* write,
                                           int* weight_set) {
  mlx_vector_array input_vector = dualnorm_norm_rope_graph_inputs(sides, inputs, weight_set);
  if (input_vector.ctx == NULL) {
    return input_vector;
  }
  if (mlx_vector_array_append_value(input_vector, write->values) != 0 ||
      mlx_vector_array_append_value(input_vector, write->key_cache) != 0 ||
      mlx_vector_array_append_value(input_vector, write->value_cache) != 0 ||
      append_write_offset(input_vector, norm_rope, write->write_offset) != 0) {
    mlx_vector_array_free(input_vector); /* already failing: its status adds nothing */
    return (mlx_vector_array){NULL};   /* empty: mlx_vector_array_new() is not */
  }
  return input_vector;
}

/* FUSED mode, a call the kernel takes but not with its write: one launch
 * for the norm + RoPE, then the writes at the constant row
 * (write_cache_rows). `input_vector` is the cache graph's (borrowed). */
static int apply_fused_then_write(mlx_vector_array* res,
                                  mlx_dualnorm_dual_head_norm_rope* norm_rope,
                                  const mlx_dualnorm_rope_inputs* inputs,
                                  const mlx_vector_array input_vector, int write_offset,
                                  mlx_dualnorm_error* error) {
  const char* operation = DUALNORM_NORM_ROPE_CACHE_OPERATION;
  mlx_vector_array rotated = mlx_vector_array_new();
  int status = dualnorm_apply_fused_norm_rope(&rotated, norm_rope, inputs, NULL, operation,
                                              error);
  if (status == MLX_DUALNORM_OK &&
      publish_cache_outputs(res, rotated, input_vector,
                            mlx_vector_array_size(input_vector) - CACHE_GRAPH_EXTRA_INPUTS,
                            &write_offset) != 0) {
    status = dualnorm_fail_in_mlx(error, operation);
  }
  return dualnorm_free_vector_after(status, rotated, operation, error);
}

/* The three outputs of a cache write into `*res`, by the fused launch then
 * MLX's writes, or by the cache graph; everything made here is freed. */
static int write_cache(mlx_vector_array* res, mlx_dualnorm_dual_head_norm_rope* norm_rope,
                       const norm_rope_facts* facts, const mlx_dualnorm_rope_inputs* inputs,
                       const mlx_dualnorm_cache_write* write, mlx_dualnorm_error* error) {
  const char* operation = DUALNORM_NORM_ROPE_CACHE_OPERATION;
  int weight_set = WEIGHT_SET_NONE;
  mlx_vector_array input_vector =
      cache_graph_inputs(norm_rope, &facts->sides, inputs, write, &weight_set);
  if (input_vector.ctx == NULL) {
    return dualnorm_fail_in_mlx(error, operation);
  }
  int status =
      facts->fused
          ? apply_fused_then_write(res, norm_rope, inputs, input_vector, write->write_offset,
                                   error)
          : dualnorm_run_weight_set_graph(res, norm_rope, &norm_rope->cache_graphs,
                                          &facts->sides, weight_set, input_vector, operation,
                                          error);
  return dualnorm_free_vector_after(status, input_vector, operation, error);
}

/* write_cache, then the rows [0, write_offset + L) of both buffers written
 * (publish_with_fetched_rows). The written outputs are owned here, freed
 * on every path. */
static int write_cache_and_fetch(mlx_vector_array* res,
                                 mlx_dualnorm_dual_head_norm_rope* norm_rope,
                                 const norm_rope_facts* facts,
                                 const mlx_dualnorm_rope_inputs* inputs,
                                 const mlx_dualnorm_cache_write* write,
                                 mlx_dualnorm_error* error) {
  const char* operation = DUALNORM_NORM_ROPE_CACHE_OPERATION;
  mlx_vector_array written = mlx_vector_array_new();
  if (written.ctx == NULL) {
    return dualnorm_fail_in_mlx(error, operation);
  }
  int status = write_cache(&written, norm_rope, facts, inputs, write, error);
  int end = write->write_offset + mlx_array_shape(inputs->keys)[1];
  if (status == MLX_DUALNORM_OK && publish_with_fetched_rows(res, written, end) != 0) {
    status = dualnorm_fail_in_mlx(error, operation);
  }
  return dualnorm_free_vector_after(status, written, operation, error);
}

int dualnorm_apply_norm_rope_with_cache(mlx_vector_array* res,
                                        mlx_dualnorm_dual_head_norm_rope* norm_rope,
                                        const norm_rope_facts* facts,
                                        const mlx_dualnorm_rope_inputs* inputs,
                                        const mlx_dualnorm_cache_write* cache_write,
                                        mlx_dualnorm_error* error) {
  if (facts->fused && dualnorm_one_launch_writes_cache(norm_rope, &facts->sides, cache_write)) {
    return dualnorm_apply_fused_norm_rope(res, norm_rope, inputs, cache_write,
                                          DUALNORM_NORM_ROPE_CACHE_OPERATION, error);
  }
  return cache_write->fetch
             ? write_cache_and_fetch(res, norm_rope, facts, inputs, cache_write, error)
             : write_cache(res, norm_rope, facts, inputs, cache_write, error);
}

int mlx_dualnorm_dual_head_norm_rope_apply_with_cache(
    mlx_vector_array* res, mlx_dualnorm_dual_head_norm_rope* norm_rope,
    const mlx_array queries, const mlx_array keys, const mlx_array values,
    const mlx_array query_scale_weight, const mlx_array key_scale_weight,
    const mlx_array rope_offset, const mlx_array freqs, const mlx_array key_cache,
    const mlx_array value_cache, int write_offset, bool fetch, mlx_dualnorm_error* error) {
  const mlx_dualnorm_cache_write cache_write = {
      .values = values,
      .key_cache = key_cache,
      .value_cache = value_cache,
      .write_offset = write_offset,
      .fetch = fetch,
  };
  const mlx_dualnorm_dual_head_norm_rope_call call = {
      .struct_size = sizeof call,
      .inputs = {queries, keys, query_scale_weight, key_scale_weight, rope_offset, freqs},
      .cache_write = &cache_write,
  };
  return mlx_dualnorm_dual_head_norm_rope_apply_call(res, norm_rope, &call, error);
}
