/* The norm + RoPE's checks and route choice
 * (private/dual_head_norm_rope_checks.h): every
 * input read and checked once per call, so bad input is an invalid
 * argument naming the operation, never an MLX failure inside a trace, and
 * the facts read choose the route (fused kernel, compiled graph, plain
 * builder) without reading an input twice.
 *
 * The checks are rms_norm's preconditions (head_norm_input.h), the rank 4
 * the transpose needs, and rope's own checks as MLX 0.32.4 makes them: an
 * offset of at most one dimension, with one element or one per batch
 * entry, of an integer dtype; dims at most the last dimension; a table of
 * shape (dims / 2,) exactly where the object has no base. The KV-cache
 * write adds the shapes of the values and buffers and the rows written.
 */
#define _POSIX_C_SOURCE 200809L

#include "private/dual_head_norm_rope_checks.h"

#include "private/call_errors.h"
#include "private/compile_erasure.h"
#include "private/dual_head_norm_rope_object.h"
#include "private/mode_choice.h"

#include <math.h>
#include <stdio.h>

/* ---- The object's constants ------------------------------------------------ */

int dualnorm_check_dual_head_norm_rope_constants(bool normalizes, double rms_norm_epsilon,
                                                 const mlx_dualnorm_rope_parameters* rope,
                                                 mlx_dualnorm_error* error) {
  const char* operation = DUALNORM_DUAL_HEAD_NORM_ROPE_OPERATION;
  int status = normalizes ? dualnorm_check_rms_norm_epsilon(rms_norm_epsilon, operation, error)
                          : MLX_DUALNORM_OK;
  if (status != MLX_DUALNORM_OK) {
    return status;
  }
  /* rope's own checks on dims, made here once rather than on every call. */
  if (rope->dims <= 0 || rope->dims % 2 != 0) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "dims must be positive and even, got %d", rope->dims);
  }
  /* MLX's rule, one of base or freqs: a table means no base. */
  if (rope->with_freqs && rope->base != 0.0f) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "only one of base or freqs can have a value: base must be 0 "
                              "with frequencies, got %g",
                              (double)rope->base);
  }
  /* A base gives frequencies base^(-2i/dims): only a finite positive one
   * gives finite ones, so anything else is refused as input_scale is. */
  if (!rope->with_freqs && !(isfinite(rope->base) && rope->base > 0.0f)) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "base must be finite and positive (as a float32), got %g",
                              (double)rope->base);
  }
  if (rope->input_scale.has_value && !isfinite(rope->input_scale.value)) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "input_scale must be finite (as a float32), got %g",
                              (double)rope->input_scale.value);
  }
  return MLX_DUALNORM_OK;
}

/* ---- The inputs of a call ------------------------------------------------- */

static bool is_integer_dtype(mlx_dtype dtype) {
  return dtype >= MLX_UINT8 && dtype <= MLX_INT64; /* mlx_dtype's integer run; not bool */
}

/* rope's checks of the offset that do not depend on a side: MLX 0.32.4
 * takes an integer array of at most one dimension. */
static int inspect_rope_offset(const mlx_array rope_offset, rope_offset_input* offset,
                               mlx_dualnorm_error* error) {
  const char* operation = DUALNORM_DUAL_HEAD_NORM_ROPE_OPERATION;
  if (rope_offset.ctx == NULL) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "offset is an empty array handle");
  }
  size_t offset_rank = mlx_array_ndim(rope_offset);
  if (offset_rank > 1) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "offset must have at most 1 dimension but has %zu", offset_rank);
  }
  mlx_dtype offset_dtype = mlx_array_dtype(rope_offset);
  if (!is_integer_dtype(offset_dtype)) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "offset must be an integer but has dtype %s",
                              dualnorm_dtype_name(offset_dtype));
  }
  offset->rank = offset_rank;
  offset->size = mlx_array_size(rope_offset);
  return MLX_DUALNORM_OK;
}

/* What the transpose and rope need of one side, rms_norm's checks done:
 * rank 4, dims within the last dimension, an offset with one element or
 * one per batch entry (rope's rule). */
static int check_rope_side(const head_norm_input* side, const char* input_name,
                           const mlx_dualnorm_rope_parameters* rope, size_t offset_size,
                           mlx_dualnorm_error* error) {
  const char* operation = DUALNORM_DUAL_HEAD_NORM_ROPE_OPERATION;
  if (side->rank != ATTENTION_INPUT_RANK) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "%s must have 4 dimensions (batch, sequence, heads, head dim) "
                              "but have %zu",
                              input_name, side->rank);
  }
  if (rope->dims > side->width) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "dims (%d) must not exceed the last dimension of %s (%d)",
                              rope->dims, input_name, side->width);
  }
  size_t batch = (size_t)mlx_array_shape(side->array)[0];
  if (offset_size != 1 && offset_size != batch) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "offset must be a scalar or have one element per batch entry "
                              "of %s (%zu) but has %zu elements",
                              input_name, batch, offset_size);
  }
  return MLX_DUALNORM_OK;
}

/* rope's checks of the frequency table, and MLX's rule that a RoPE has a
 * base or a table, not both: an object with frequencies takes a table of
 * shape (dims / 2,), of any dtype (mlx_fast_rope_dynamic converts it to
 * float32); one with a base takes an empty handle. */
static int check_rope_freqs(const mlx_dualnorm_rope_parameters* rope, const mlx_array freqs,
                            mlx_dualnorm_error* error) {
  const char* operation = DUALNORM_DUAL_HEAD_NORM_ROPE_OPERATION;
  if (!rope->with_freqs) {
    return freqs.ctx == NULL
               ? MLX_DUALNORM_OK
               : dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                                    "only one of base or freqs can have a value: this "
                                    "object has a base, so it takes no freqs");
  }
  if (freqs.ctx == NULL) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "freqs are required: this object was made without a base");
  }
  size_t rank = mlx_array_ndim(freqs);
  int half_dims = rope->dims / 2;
  if (rank != 1 || mlx_array_shape(freqs)[0] != half_dims) {
    char shape[64] = "()";
    if (rank == 1) {
      snprintf(shape, sizeof shape, "(%d)", mlx_array_shape(freqs)[0]);
    } else if (rank > 1) {
      snprintf(shape, sizeof shape, "of %zu dimensions", rank);
    }
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "freqs must be one dimensional with size %d but got shape %s",
                              half_dims, shape);
  }
  return MLX_DUALNORM_OK;
}

/* Reads and checks every input once, in the composed path's order. */
static int inspect_inputs(const mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
                          const mlx_dualnorm_rope_inputs* inputs, dual_head_norm_rope_facts* facts,
                          mlx_dualnorm_error* error) {
  const char* operation = DUALNORM_DUAL_HEAD_NORM_ROPE_OPERATION;
  dual_head_norm_call* sides = &facts->sides;
  if (!dual_head_norm_rope->normalizes &&
      (inputs->query_scale_weight.ctx != NULL || inputs->key_scale_weight.ctx != NULL)) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "this object was made without norms: it takes no query_weight "
                              "or key_weight");
  }
  int status = dualnorm_inspect_head_norm_input(&sides->queries, operation, "queries",
                                                inputs->queries, "query_weight",
                                                inputs->query_scale_weight, true, error);
  if (status == MLX_DUALNORM_OK) {
    status = dualnorm_inspect_head_norm_input(&sides->keys, operation, "keys", inputs->keys,
                                              "key_weight", inputs->key_scale_weight, true,
                                              error);
  }
  if (status == MLX_DUALNORM_OK) {
    status = inspect_rope_offset(inputs->rope_offset, &facts->offset, error);
  }
  if (status == MLX_DUALNORM_OK) {
    status = check_rope_side(&sides->queries, "queries", &dual_head_norm_rope->rope,
                             facts->offset.size, error);
  }
  if (status == MLX_DUALNORM_OK) {
    status = check_rope_side(&sides->keys, "keys", &dual_head_norm_rope->rope, facts->offset.size,
                             error);
  }
  if (status == MLX_DUALNORM_OK) {
    status = check_rope_freqs(&dual_head_norm_rope->rope, inputs->freqs, error);
  }
  if (status == MLX_DUALNORM_OK) {
    status = dualnorm_check_float64_placement(sides, operation, error);
  }
  return status;
}

bool dualnorm_takes_compiled_graph(const mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
                                   const dual_head_norm_call* sides) {
  const head_norm_input* queries = &sides->queries;
  const head_norm_input* keys = &sides->keys;
  if (dual_head_norm_rope->mode == MLX_DUALNORM_MODE_COMPOSED || queries->size == 0 ||
      keys->size == 0) {
    return false;
  }
  return queries->size + keys->size <= COMPILED_GRAPH_MAX_ELEMENTS;
}

/* Whether MLX's RoPE reads the offset of this side in bounds: a scalar, or
 * one value per batch entry (dual_head_norm_rope.c's file comment says
 * why an offset of shape (1,) with several batch entries is neither). */
static bool offset_fits_side(const head_norm_input* side, const rope_offset_input* offset) {
  return offset->rank == 0 || offset->size == (size_t)mlx_array_shape(side->array)[0];
}

/* Whether a side's normalized rows (a head, or all heads of a token where
 * the side's norm spans them) fit the kernel's widest row. */
static bool normalized_rows_fit(const mlx_dualnorm_fused_kernel* kernel,
                                const head_norm_input* side) {
  return (long long)side->width * side->norm_heads <= (long long)kernel->max_width;
}

/* Whether the fused kernel computes exactly what the composed calls would:
 * the inputs fit the kernel (mode_choice.h) and its widest row, an offset
 * MLX reads in bounds, a float32 table if any (others take the graph,
 * where mlx_fast_rope_dynamic converts them), the CUDA GPU by default. */
static int fused_kernel_takes(const mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
                              dual_head_norm_rope_facts* facts, const mlx_array freqs,
                              const char* operation, mlx_dualnorm_error* error) {
  const mlx_dualnorm_fused_kernel* kernel = &dual_head_norm_rope->fused_backend->kernel;
  dual_head_norm_call* sides = &facts->sides;
  facts->fused = dualnorm_fused_kernel_fits(kernel, sides) &&
                 normalized_rows_fit(kernel, &sides->queries) &&
                 normalized_rows_fit(kernel, &sides->keys) &&
                 offset_fits_side(&sides->queries, &facts->offset) &&
                 offset_fits_side(&sides->keys, &facts->offset) &&
                 (freqs.ctx == NULL || mlx_array_dtype(freqs) == MLX_FLOAT32);
  return facts->fused ? dualnorm_default_device_is_gpu(sides, operation, &facts->fused, error)
                      : MLX_DUALNORM_OK;
}

/* A buffer (B, Hk, capacity, width) beside keys of `key_shape` (B, L, Hk,
 * D), with rows [w, w + L) inside its capacity. */
static int check_cache_buffer(const mlx_array buffer, const char* name, int width,
                              const int* key_shape, int write_offset,
                              mlx_dualnorm_error* error) {
  const char* operation = DUALNORM_DUAL_HEAD_NORM_ROPE_CACHE_OPERATION;
  const int* buffer_shape = mlx_array_shape(buffer);
  if (buffer_shape[0] != key_shape[0] || buffer_shape[1] != key_shape[2] ||
      buffer_shape[3] != width) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "%s (%d, %d, %d, %d) must be (batch %d, heads %d, capacity, "
                              "width %d)",
                              name, buffer_shape[0], buffer_shape[1], buffer_shape[2],
                              buffer_shape[3], key_shape[0], key_shape[2], width);
  }
  long long end = (long long)write_offset + key_shape[1];
  if (write_offset < 0 || end > buffer_shape[2]) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "rows [%d, %lld) are outside the %d rows of %s", write_offset,
                              end, buffer_shape[2], name);
  }
  return MLX_DUALNORM_OK;
}

/* What the writes need, checked once per call (after the norm + RoPE's
 * checks): values (B, L, Hk, Dv) beside the keys; buffers (B, Hk, C, D) and
 * (B, Hk, Cv, Dv); rows [w, w + L) inside both. Failures are invalid
 * arguments; nothing is built. */
static int check_cache_write(const head_norm_input* keys, const mlx_dualnorm_cache_write* write,
                             mlx_dualnorm_error* error) {
  const char* operation = DUALNORM_DUAL_HEAD_NORM_ROPE_CACHE_OPERATION;
  const mlx_array checked[] = {write->values, write->key_cache, write->value_cache};
  static const char* const names[] = {"values", "key_cache", "value_cache"};
  for (size_t index = 0; index < sizeof checked / sizeof checked[0]; ++index) {
    if (checked[index].ctx == NULL) {
      return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                                "%s is an empty array handle", names[index]);
    }
    size_t rank = mlx_array_ndim(checked[index]);
    if (rank != ATTENTION_INPUT_RANK) {
      return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                                "%s must have 4 dimensions but has %zu", names[index], rank);
    }
  }
  const int* key_shape = mlx_array_shape(keys->array); /* (B, L, Hk, D), rank 4 checked */
  const int* value_shape = mlx_array_shape(write->values);
  if (value_shape[0] != key_shape[0] || value_shape[1] != key_shape[1] ||
      value_shape[2] != key_shape[2]) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "values (%d, %d, %d, %d) must have the batch, length and heads "
                              "of keys (%d, %d, %d, %d)",
                              value_shape[0], value_shape[1], value_shape[2], value_shape[3],
                              key_shape[0], key_shape[1], key_shape[2], key_shape[3]);
  }
  int status = check_cache_buffer(write->key_cache, "key_cache", key_shape[3], key_shape,
                                  write->write_offset, error);
  return status != MLX_DUALNORM_OK
             ? status
             : check_cache_buffer(write->value_cache, "value_cache", value_shape[3], key_shape,
                                  write->write_offset, error);
}

bool dualnorm_one_launch_writes_cache(const mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
                                      const dual_head_norm_call* sides,
                                      const mlx_dualnorm_cache_write* write) {
  mlx_dtype dtype = mlx_array_dtype(sides->queries.array);
  return dual_head_norm_rope->fused_backend->writes_cache &&
         mlx_array_dtype(write->values) == dtype && mlx_array_dtype(write->key_cache) == dtype &&
         mlx_array_dtype(write->value_cache) == dtype;
}

/* ---- A call's start and route ---------------------------------------------- */

/* Where FUSED mode's kernel takes the call (`facts->fused`), else nothing
 * to choose: the graphs decide compiled or plain at run time. */
static int choose_route(const mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
                        const dualnorm_weight_set_graphs* graphs, dual_head_norm_rope_facts* facts,
                        const mlx_array freqs, const char* operation, mlx_dualnorm_error* error) {
  if (!dualnorm_register_applying_thread(graphs->compile_ids) ||
      dualnorm_erase_queued_compile_ids() != 0) {
    return dualnorm_fail_in_mlx(error, operation);
  }
  return dual_head_norm_rope->mode == MLX_DUALNORM_MODE_FUSED
             ? fused_kernel_takes(dual_head_norm_rope, facts, freqs, operation, error)
             : MLX_DUALNORM_OK;
}

int dualnorm_check_dual_head_norm_rope_call(
    const mlx_vector_array* res, const mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
    const mlx_dualnorm_rope_inputs* inputs, const mlx_dualnorm_cache_write* cache_write,
    const char* operation, dual_head_norm_rope_facts* facts, mlx_dualnorm_error* error) {
  if (res == NULL || dual_head_norm_rope == NULL) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "the result vector or the dual head norm rope is NULL");
  }
  int status = inspect_inputs(dual_head_norm_rope, inputs, facts, error);
  if (status == MLX_DUALNORM_OK && cache_write != NULL) {
    status = check_cache_write(&facts->sides.keys, cache_write, error);
  }
  if (status != MLX_DUALNORM_OK) {
    if (error != NULL) {
      error->operation = operation; /* the norm + RoPE's checks, as this call's */
    }
    return status;
  }
  const dualnorm_weight_set_graphs* graphs =
      cache_write != NULL ? &dual_head_norm_rope->cache_graphs : &dual_head_norm_rope->graphs;
  return choose_route(dual_head_norm_rope, graphs, facts, inputs->freqs, operation, error);
}
