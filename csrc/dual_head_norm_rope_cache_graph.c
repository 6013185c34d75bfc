/* The dual head norm + RoPE's cache graph builder
 * (private/dual_head_norm_rope_cache_graph.h): the norm + RoPE, then the
 * two writes of mlx-lm's KVCache.update_and_fetch (`keys[..., w:w+L, :] =
 * rotated keys`, the same for the transposed values) as MLX slice updates.
 * mlx-lm's indexing makes a SliceUpdate whose position is a constant;
 * here the position is an int32 scalar INPUT of the graph (MLX's
 * DynamicSliceUpdate), so a decode step at the next row replays one trace.
 * Both copy the buffer (or take its memory when MLX may donate it) and then
 * the update's elements, cast to the buffer's dtype: the same bits in every
 * element. The writes at a constant row and the rows fetched are shared
 * with the fused route (dual_head_norm_rope_cache_route.c).
 */
#include "private/dual_head_norm_rope_cache_graph.h"

#include "private/dual_head_norm_rope_graph.h"

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

int dualnorm_publish_cache_outputs(mlx_vector_array* res, const mlx_vector_array rotated,
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

/* Inputs: the norm + RoPE graph's (dualnorm_dual_head_norm_rope_graph_inputs),
 * then values, key_cache, value_cache and the write offset. Outputs:
 * dualnorm_publish_cache_outputs's. The input vector belongs to the closure; every
 * handle made here is freed on every path. */
static int build_dual_head_norm_rope_cache_graph(mlx_vector_array* output_vector,
                                                 const mlx_vector_array input_vector,
                                                 void* payload) {
  size_t dual_head_norm_rope_inputs = dualnorm_dual_head_norm_rope_input_count(payload);
  if (!dualnorm_graph_inputs_expected(output_vector, input_vector,
                                      dual_head_norm_rope_inputs + CACHE_GRAPH_EXTRA_INPUTS)) {
    return 1;
  }
  mlx_array dual_head_norm_rope_input_arrays[DUAL_HEAD_NORM_ROPE_MAX_INPUTS];
  for (size_t index = 0; index < DUAL_HEAD_NORM_ROPE_MAX_INPUTS; ++index) {
    dual_head_norm_rope_input_arrays[index] = mlx_array_new();
  }
  mlx_vector_array dual_head_norm_rope_input_vector = mlx_vector_array_new();
  mlx_vector_array rotated = mlx_vector_array_new();
  int status = 0;
  for (size_t index = 0; status == 0 && index < dual_head_norm_rope_inputs; ++index) {
    status =
        mlx_vector_array_get(&dual_head_norm_rope_input_arrays[index], input_vector, index) != 0;
  }
  status =
      status ||
      mlx_vector_array_set_data(&dual_head_norm_rope_input_vector, dual_head_norm_rope_input_arrays,
                                dual_head_norm_rope_inputs) != 0 ||
      dualnorm_build_dual_head_norm_rope_graph(&rotated, dual_head_norm_rope_input_vector,
                                               payload) != 0 ||
      dualnorm_publish_cache_outputs(output_vector, rotated, input_vector,
                                     dual_head_norm_rope_inputs, NULL) != 0;
  for (size_t index = 0; index < DUAL_HEAD_NORM_ROPE_MAX_INPUTS; ++index) {
    status |= mlx_array_free(dual_head_norm_rope_input_arrays[index]);
  }
  status |= mlx_vector_array_free(dual_head_norm_rope_input_vector);
  status |= mlx_vector_array_free(rotated);
  return status;
}

mlx_closure dualnorm_new_dual_head_norm_rope_cache_graph(const void* constants, int weight_set) {
  return dualnorm_new_builder_closure(constants, weight_set,
                                      build_dual_head_norm_rope_cache_graph);
}

int dualnorm_publish_with_fetched_rows(mlx_vector_array* res, const mlx_vector_array written,
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
