/* The norm + RoPE graph builder (private/dual_head_norm_rope_graph.h): for
 * each side, rms_norm (none for an object without norms), the transpose to
 * (B, H, L, D), the input scale where the RoPE has one, then
 * mlx_fast_rope_dynamic, each call as the composed
 * path makes it, so MLX emits the same kernels over the same inputs. The
 * constants are the closure's own copy (dual_head_norm_rope_constants); the
 * RoPE offset and the frequency table are graph inputs, so a decode step at
 * a new position or with a new table of the same shape replays the trace.
 */
#include "private/dual_head_norm_rope_graph.h"

#include "private/weight_set_graphs.h"

#include <stdlib.h>

static const char BUILD_DUAL_HEAD_NORM_ROPE_GRAPH_OPERATION[] = "dual_head_norm_rope_graph";

/* `x.at[..., :dims].multiply(input_scale)` on the (B, H, L, D) `head_major`,
 * as MLX's Python binding builds it: the factor a scalar of x's dtype (the
 * float32 value converted as MLX converts a Python float for that dtype:
 * float32 as is, else one AsType, whose rounding is the same), then a
 * SliceUpdate with the Prod reduction over the first `dims` features.
 * `*scaled` receives a new handle; every other handle made here is freed. */
static int scale_rotated_features(mlx_array* scaled, const mlx_array head_major, int dims,
                                  float input_scale, const mlx_stream stream) {
  const int* shape = mlx_array_shape(head_major);
  const int start[ATTENTION_INPUT_RANK] = {0, 0, 0, 0};
  const int stop[ATTENTION_INPUT_RANK] = {shape[0], shape[1], shape[2], dims};
  const int strides[ATTENTION_INPUT_RANK] = {1, 1, 1, 1};
  mlx_array factor = mlx_array_new_data(&input_scale, NULL, 0, MLX_FLOAT32);
  mlx_array typed_factor = mlx_array_new();
  int status = factor.ctx == NULL ||
               mlx_astype(&typed_factor, factor, mlx_array_dtype(head_major), stream) != 0 ||
               mlx_slice_update_prod(scaled, head_major, typed_factor, start,
                                     ATTENTION_INPUT_RANK, stop, ATTENTION_INPUT_RANK, strides,
                                     ATTENTION_INPUT_RANK, stream) != 0;
  status |= mlx_array_free(factor);
  status |= mlx_array_free(typed_factor);
  return status;
}

/* rms_norm(input, weight, eps) of one (B, L, H, D) side: over each head, or,
 * for a weight of H * D elements (H > 1, the call's checks allowed it),
 * over each token's H * D elements as mlx-lm's OLMo-2 normalizes its whole
 * projection before splitting it into heads: the input as (B, L, H * D),
 * normalized, then as (B, L, H, D) again. `*normalized` receives a new
 * handle; every other handle made here is freed. */
static int normalize_heads(mlx_array* normalized, const mlx_array input,
                           const mlx_array scale_weight, float rms_norm_epsilon,
                           const mlx_stream stream) {
  const int* shape = mlx_array_shape(input);
  bool spans_heads = scale_weight.ctx != NULL && shape[2] > 1 && shape[3] > 0 &&
                     mlx_array_shape(scale_weight)[0] == (long long)shape[2] * shape[3];
  if (!spans_heads) {
    return mlx_fast_rms_norm(normalized, input, scale_weight, rms_norm_epsilon, stream);
  }
  const int projection_shape[3] = {shape[0], shape[1], shape[2] * shape[3]};
  const int head_shape[ATTENTION_INPUT_RANK] = {shape[0], shape[1], shape[2], shape[3]};
  mlx_array projection = mlx_array_new();
  mlx_array normalized_projection = mlx_array_new();
  int status = mlx_reshape(&projection, input, projection_shape, 3, stream) != 0 ||
               mlx_fast_rms_norm(&normalized_projection, projection, scale_weight,
                                 rms_norm_epsilon, stream) != 0 ||
               mlx_reshape(normalized, normalized_projection, head_shape,
                           ATTENTION_INPUT_RANK, stream) != 0;
  status |= mlx_array_free(projection);
  status |= mlx_array_free(normalized_projection);
  return status;
}

/* rope(rms_norm(input, weight, eps).transpose(0, 2, 1, 3)) for one side
 * (the norm as normalize_heads takes it; without norms, rope(input.
 * transpose(0, 2, 1, 3)): the transpose of the input itself),
 * the first `dims` features multiplied by the input scale first where the
 * constants have one; every step on the one stream
 * dualnorm_select_side_stream picks. `freqs` is the call's table (borrowed)
 * or, for an object with a base, an empty handle. */
static int normalize_and_rotate(mlx_array* rotated, const mlx_array input,
                                const mlx_array scale_weight, const mlx_array rope_offset,
                                const mlx_array freqs,
                                const dual_head_norm_rope_constants* constants,
                                const mlx_device default_device) {
  const mlx_dualnorm_rope_parameters* rope = &constants->rope;
  const mlx_optional_float rope_base = {.value = rope->base, .has_value = !rope->with_freqs};
  mlx_stream stream = mlx_stream_new();
  mlx_array normalized = mlx_array_new();
  mlx_array head_major = mlx_array_new();
  mlx_array scaled = mlx_array_new();
  int status =
      dualnorm_select_side_stream(&stream, input, default_device) != 0 ||
      (constants->normalizes
           ? normalize_heads(&normalized, input, scale_weight, constants->rms_norm_epsilon,
                             stream)
           : mlx_array_set(&normalized, input)) != 0 ||
      mlx_transpose_axes(&head_major, normalized, DUALNORM_HEAD_MAJOR_AXES, ATTENTION_INPUT_RANK,
                         stream) != 0 ||
      (rope->input_scale.has_value &&
       scale_rotated_features(&scaled, head_major, rope->dims, rope->input_scale.value,
                              stream) != 0) ||
      mlx_fast_rope_dynamic(rotated, rope->input_scale.has_value ? scaled : head_major,
                            rope->dims, rope->traditional, rope_base, rope->scale, rope_offset,
                            freqs, stream) != 0;
  status |= mlx_array_free(normalized);
  status |= mlx_array_free(head_major);
  status |= mlx_array_free(scaled);
  status |= mlx_stream_free(stream);
  return status;
}

size_t dualnorm_dual_head_norm_rope_input_count(const dual_head_norm_rope_constants* constants) {
  return DUAL_HEAD_NORM_ROPE_FIXED_INPUTS + (size_t)constants->has_query_weight +
         (size_t)constants->has_key_weight + (size_t)constants->rope.with_freqs;
}

bool dualnorm_graph_inputs_expected(const mlx_vector_array* output_vector,
                                    const mlx_vector_array input_vector, size_t expected_inputs) {
  size_t received_inputs = mlx_vector_array_size(input_vector);
  if (output_vector == NULL || received_inputs != expected_inputs) {
    mlx_error("[%s] expected %zu inputs and an output vector, received %zu inputs",
              BUILD_DUAL_HEAD_NORM_ROPE_GRAPH_OPERATION, expected_inputs, received_inputs);
    return false;
  }
  return true;
}

/* Inputs: queries, keys, the RoPE offset, then the query weight and the key
 * weight where the weight set has them, then the frequency table where the
 * RoPE takes one. Output order is the caller's ABI: rotated queries first,
 * keys second, published once at the end. Every handle made here is freed
 * on every path; the input vector belongs to the closure. */
int dualnorm_build_dual_head_norm_rope_graph(mlx_vector_array* output_vector,
                                             const mlx_vector_array input_vector,
                                             void* payload) {
  const dual_head_norm_rope_constants* constants = payload;
  if (!dualnorm_graph_inputs_expected(output_vector, input_vector,
                                      dualnorm_dual_head_norm_rope_input_count(constants))) {
    return 1;
  }
  mlx_array queries = mlx_array_new();
  mlx_array keys = mlx_array_new();
  mlx_array rope_offset = mlx_array_new();
  mlx_array query_scale_weight = mlx_array_new();
  mlx_array key_scale_weight = mlx_array_new();
  mlx_array freqs = mlx_array_new();
  mlx_array rotated[MLX_DUALNORM_ROPE_OUTPUT_COUNT] = {mlx_array_new(), mlx_array_new()};
  mlx_device default_device = mlx_device_new();
  size_t next_input = DUAL_HEAD_NORM_ROPE_FIXED_INPUTS;
  int status =
      mlx_vector_array_get(&queries, input_vector, 0) != 0 ||
      mlx_vector_array_get(&keys, input_vector, 1) != 0 ||
      mlx_vector_array_get(&rope_offset, input_vector, 2) != 0 ||
      (constants->has_query_weight &&
       mlx_vector_array_get(&query_scale_weight, input_vector, next_input++) != 0) ||
      (constants->has_key_weight &&
       mlx_vector_array_get(&key_scale_weight, input_vector, next_input++) != 0) ||
      (constants->rope.with_freqs &&
       mlx_vector_array_get(&freqs, input_vector, next_input++) != 0) ||
      /* The default device's stream, as the composed calls use: the graph
       * builds on a CPU-only MLX, and a default-device change retraces. */
      mlx_get_default_device(&default_device) != 0 ||
      normalize_and_rotate(&rotated[0], queries, query_scale_weight, rope_offset, freqs,
                           constants, default_device) != 0 ||
      normalize_and_rotate(&rotated[1], keys, key_scale_weight, rope_offset, freqs,
                           constants, default_device) != 0 ||
      mlx_vector_array_set_data(output_vector, rotated, MLX_DUALNORM_ROPE_OUTPUT_COUNT) != 0;
  status |= mlx_array_free(queries);
  status |= mlx_array_free(keys);
  status |= mlx_array_free(rope_offset);
  status |= mlx_array_free(query_scale_weight);
  status |= mlx_array_free(key_scale_weight);
  status |= mlx_array_free(freqs);
  status |= mlx_array_free(rotated[0]);
  status |= mlx_array_free(rotated[1]);
  status |= mlx_device_free(default_device);
  return status;
}

mlx_closure dualnorm_new_builder_closure(const dual_head_norm_rope_constants* constants,
                                         int weight_set,
                                         dualnorm_dual_head_norm_rope_builder builder) {
  dual_head_norm_rope_constants* closure_constants = malloc(sizeof *closure_constants);
  if (closure_constants == NULL) {
    mlx_error("[%s] out of host memory", DUALNORM_DUAL_HEAD_NORM_ROPE_OPERATION);
    return mlx_closure_new();
  }
  *closure_constants = *constants;
  closure_constants->has_query_weight = (weight_set & WEIGHT_SET_QUERY) != 0;
  closure_constants->has_key_weight = (weight_set & WEIGHT_SET_KEY) != 0;
  /* The closure owns `closure_constants` from here: `free` runs with its
   * last copy. */
  mlx_closure plain_graph = mlx_closure_new_func_payload(builder, closure_constants, free);
  if (plain_graph.ctx == NULL) {
    free(closure_constants); /* a closure that was never made took no ownership */
  }
  return plain_graph;
}

mlx_closure dualnorm_new_dual_head_norm_rope_graph(const void* constants, int weight_set) {
  return dualnorm_new_builder_closure(constants, weight_set,
                                      dualnorm_build_dual_head_norm_rope_graph);
}

mlx_vector_array dualnorm_dual_head_norm_rope_graph_inputs(
    const dual_head_norm_call* sides, const mlx_dualnorm_rope_inputs* inputs, int* weight_set) {
  mlx_vector_array input_vector = dualnorm_graph_inputs(sides, &inputs->rope_offset, weight_set);
  if (input_vector.ctx != NULL && inputs->freqs.ctx != NULL &&
      mlx_vector_array_append_value(input_vector, inputs->freqs) != 0) {
    mlx_vector_array_free(input_vector); /* already failing: its status adds nothing */
    return (mlx_vector_array){NULL};   /* empty: mlx_vector_array_new() is not */
  }
  return input_vector;
}
