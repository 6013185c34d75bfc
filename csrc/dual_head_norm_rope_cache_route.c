/* The route of a dual head norm + RoPE call with a KV-cache write
 * (private/dual_head_norm_rope_cache_route.h; what the call computes:
 * dual_head_norm_rope_cache.h). The compiled route runs the cache graph
 * (dual_head_norm_rope_cache_graph.c), whose write position is a graph
 * input; the graphs are compiled per input shape as the norm + RoPE's, so
 * a buffer that grew traces once per capacity.
 *
 * In FUSED mode one launch does the norm + RoPE and both writes where the
 * backend takes the write (dualnorm_one_launch_writes_cache); else the
 * launch is followed by MLX's slice updates at a constant row.
 */
#define _POSIX_C_SOURCE 200809L

#include "private/dual_head_norm_rope_cache_route.h"

#include "private/call_errors.h"
#include "private/dual_head_norm_rope_cache_graph.h"
#include "private/dual_head_norm_rope_graph.h"
#include "private/dual_head_norm_rope_object.h"
#include "private/position_scalar.h"

/* Appends the write row to `inputs` as the int32 scalar of that position
 * (position_scalar.h: the one holder, shared with the RoPE offset of the
 * same number). The vector takes its own reference; the handle made here
 * is freed on every path. */
static int append_write_row(mlx_vector_array inputs, int write_offset) {
  mlx_array write_row = mlx_array_new();
  int status = dualnorm_position_scalar(&write_row, write_offset) != 0 ||
               mlx_vector_array_append_value(inputs, write_row) != 0;
  status |= mlx_array_free(write_row);
  return status;
}

/* The cache graph's input vector (owned by the caller): the norm + RoPE
 * graph's, then values, the buffers and the write position; `*weight_set`
 * the call's. An empty handle, with the reason sent to mlx_error, on
 * failure. */
static mlx_vector_array cache_graph_inputs(const dual_head_norm_call* sides,
                                           const mlx_dualnorm_rope_inputs* inputs,
                                           const mlx_dualnorm_cache_write* write,
                                           int* weight_set) {
  mlx_vector_array input_vector =
      dualnorm_dual_head_norm_rope_graph_inputs(sides, inputs, weight_set);
  if (input_vector.ctx == NULL) {
    return input_vector;
  }
  if (mlx_vector_array_append_value(input_vector, write->values) != 0 ||
      mlx_vector_array_append_value(input_vector, write->key_cache) != 0 ||
      mlx_vector_array_append_value(input_vector, write->value_cache) != 0 ||
      append_write_row(input_vector, write->write_offset) != 0) {
    mlx_vector_array_free(input_vector); /* already failing: its status adds nothing */
    return (mlx_vector_array){NULL};   /* empty: mlx_vector_array_new() is not */
  }
  return input_vector;
}

/* FUSED mode, a call the kernel takes but not with its write: one launch
 * for the norm + RoPE, then the writes at the constant row
 * (dualnorm_publish_cache_outputs). `input_vector` is the cache graph's
 * (borrowed). */
static int apply_fused_then_write(mlx_vector_array* res,
                                  mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
                                  const mlx_dualnorm_rope_inputs* inputs,
                                  const mlx_vector_array input_vector, int write_offset,
                                  mlx_dualnorm_error* error) {
  const char* operation = DUALNORM_DUAL_HEAD_NORM_ROPE_CACHE_OPERATION;
  mlx_vector_array rotated = mlx_vector_array_new();
  int status =
      dualnorm_run_fused_launch(&rotated, dual_head_norm_rope, inputs, NULL, operation, error);
  if (status == MLX_DUALNORM_OK &&
      dualnorm_publish_cache_outputs(
          res, rotated, input_vector,
          mlx_vector_array_size(input_vector) - CACHE_GRAPH_EXTRA_INPUTS, &write_offset) != 0) {
    status = dualnorm_fail_in_mlx(error, operation);
  }
  return dualnorm_free_vector_after(status, rotated, operation, error);
}

/* The three outputs of a cache write into `*res`, by the fused launch then
 * MLX's writes, or by the cache graph; everything made here is freed. */
static int write_cache(mlx_vector_array* res, mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
                       const dual_head_norm_rope_facts* facts,
                       const mlx_dualnorm_rope_inputs* inputs,
                       const mlx_dualnorm_cache_write* write, mlx_dualnorm_error* error) {
  const char* operation = DUALNORM_DUAL_HEAD_NORM_ROPE_CACHE_OPERATION;
  int weight_set = WEIGHT_SET_NONE;
  mlx_vector_array input_vector =
      cache_graph_inputs(&facts->sides, inputs, write, &weight_set);
  if (input_vector.ctx == NULL) {
    return dualnorm_fail_in_mlx(error, operation);
  }
  int status = facts->fused ? apply_fused_then_write(res, dual_head_norm_rope, inputs, input_vector,
                                                     write->write_offset, error)
                            : dualnorm_run_weight_set_graph(
                                  res, dual_head_norm_rope, &dual_head_norm_rope->cache_graphs,
                                  &facts->sides, weight_set, input_vector, operation, error);
  return dualnorm_free_vector_after(status, input_vector, operation, error);
}

/* write_cache, then the rows [0, write_offset + L) of both buffers written
 * (dualnorm_publish_with_fetched_rows). The written outputs are owned here, freed
 * on every path. */
static int write_cache_and_fetch(mlx_vector_array* res,
                                 mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
                                 const dual_head_norm_rope_facts* facts,
                                 const mlx_dualnorm_rope_inputs* inputs,
                                 const mlx_dualnorm_cache_write* write, mlx_dualnorm_error* error) {
  const char* operation = DUALNORM_DUAL_HEAD_NORM_ROPE_CACHE_OPERATION;
  mlx_vector_array written = mlx_vector_array_new();
  if (written.ctx == NULL) {
    return dualnorm_fail_in_mlx(error, operation);
  }
  int status = write_cache(&written, dual_head_norm_rope, facts, inputs, write, error);
  int end = write->write_offset + mlx_array_shape(inputs->keys)[1];
  if (status == MLX_DUALNORM_OK && dualnorm_publish_with_fetched_rows(res, written, end) != 0) {
    status = dualnorm_fail_in_mlx(error, operation);
  }
  return dualnorm_free_vector_after(status, written, operation, error);
}

int dualnorm_apply_dual_head_norm_rope_with_cache(
    mlx_vector_array* res, mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
    const dual_head_norm_rope_facts* facts, const mlx_dualnorm_rope_inputs* inputs,
    const mlx_dualnorm_cache_write* cache_write, mlx_dualnorm_error* error) {
  if (facts->fused &&
      dualnorm_one_launch_writes_cache(dual_head_norm_rope, &facts->sides, cache_write)) {
    return dualnorm_run_fused_launch(res, dual_head_norm_rope, inputs, cache_write,
                                     DUALNORM_DUAL_HEAD_NORM_ROPE_CACHE_OPERATION, error);
  }
  return cache_write->fetch
             ? write_cache_and_fetch(res, dual_head_norm_rope, facts, inputs, cache_write, error)
             : write_cache(res, dual_head_norm_rope, facts, inputs, cache_write, error);
}
