/* The q/k prework of a full-attention layer as one compiled graph:
 * rms_norm, transpose to (B, H, L, D), then RoPE, for queries and keys.
 *
 * mlx-lm's Qwen3 attention builds six graph nodes per layer and token for
 * this (two rms_norm, two transposes, two rope); one replay of a compiled
 * dual-output graph produces both results. The builder calls
 * mlx_fast_rms_norm, mlx_transpose_axes and mlx_fast_rope_dynamic on each
 * side exactly as the composed calls do, on the same default stream, so
 * MLX emits the same kernels over the same inputs: the bits are the
 * composed path's. The RoPE offset is a graph INPUT (an integer array, as
 * mlx_fast_rope_dynamic takes it), so a decode step at a new position
 * replays the graph instead of tracing it again.
 *
 * Constants at trace time: each builder closure carries its own copy of
 * the constants (mlx_closure_new_func_payload), so a trace reads only its
 * own object's; a per-object read-write lock only keeps close from freeing
 * the closures under an apply in flight. docs/design.md ("Epsilon and
 * constants at trace time") says why, and how the dual head norm differs.
 *
 * Shape-specialized compile, not shapeless. On MLX's CPU backend
 * mx.fast.rope has no kernel: it returns its op graph (arange, slices,
 * concatenate, reshape), whose Slice primitives cannot infer output shapes,
 * so a shapeless compile of it fails on its first call (MLX 0.32.4:
 * "[Primitive::output_shapes] Slice cannot infer output shapes."). The
 * graphs are therefore compiled per input shape: MLX's compile cache keeps
 * one trace per (shapes, dtypes, stream), and a decode step, whose shapes
 * do not change, replays its trace. Calls with more than
 * COMPILED_GRAPH_MAX_ELEMENTS elements in all (prefill) take the plain
 * builder: on CPU each new shape would cost a trace (0.5-1 ms measured),
 * and at those sizes MLX's fused CPU kernels are no faster than the
 * composed ops (1.5 against 1.4 ms at (1, 64, 16+8, 128) bf16). The bound
 * counts elements, not rows, because MLX's fused CPU kernels lose to the
 * composed ops per element, while the compiled graph saves a fixed number
 * of dispatches (RoPE's CPU op graph is most of them). Measured, build and
 * eval, compiled against composed, bf16, 2-core CPU: 0.65-0.81x at
 * (1, 1, 96+8, 128) with 64 dims rotated (GLM-4.5's decode, 13312
 * elements), 0.86x at (1, 2, 48+4, 128), 0.78x at (1, 1, 64+8, 256); past
 * the bound 1.08x at (1, 2, 96+8, 128) (26624 elements). The cache graphs
 * (apply_with_cache, with fetch) take the same bound: 0.73x at GLM-4.5's
 * decode with a 256-row cache, 0.74x at (1, 1, 16+8, 128), 0.77x at
 * (1, 2, 48+4, 128), and 0.99x past it at (1, 2, 96+8, 128). Empty inputs take the plain
 * builder too, on the CPU stream (nothing to compute, as dual_head_norm.c
 * does for rms_norm).
 *
 * Each object compiles under ids of its own (dualnorm_new_compile_ids) with
 * its constants as compile constants, and closing erases those ids from
 * every thread's cache (compile_erasure.h). Each input is read and checked
 * once per call: rms_norm's preconditions (head_norm_input.h), the rank 4
 * the transpose needs, and rope's own checks as MLX 0.32.4 makes them
 * (offset of at most one dimension, with one element or one per batch
 * entry, of an integer dtype; dims at most the last dimension), so bad
 * input is an invalid argument naming the operation, never an MLX failure
 * inside a trace.
 *
 * Scaled RoPE (docs/design.md, "Frequency tables and the input scale"):
 * an object made with_freqs takes the table as one more graph input, after
 * the weights, passed to mlx_fast_rope_dynamic as its `freqs` (which
 * converts it to float32); the input scale, a compile constant, is the
 * AsType + SliceUpdate-Prod that Python's x.at[..., :dims].multiply(s)
 * builds, before the rope. The fused kernel takes float32 tables only.
 *
 * In FUSED mode, the calls the registered fused backend takes skip the
 * graph: one CUDA kernel launch, its constants kernel arguments. Which
 * calls it takes is decided here, from the facts read once per call (the
 * backend only launches); the others run the compiled graph, same bits.
 * An offset of shape (1,) with more than one batch entry is one of those:
 * MLX 0.32.4's CUDA RoPE reads it with a stride of 1 per batch entry, past
 * its end, so only MLX's own kernel gives MLX's answer there.
 */
/* pthread_rwlock_t is POSIX.1-2001, hidden by a strict -std=c11. */
#define _POSIX_C_SOURCE 200809L

#include "dual_head_norm_rope.h"
#include "dual_head_norm_rope_cache.h"

#include "private/call_errors.h"
#include "private/compile_erasure.h"
#include "private/head_norm_input.h"
#include "private/layout_graphs.h"
#include "private/mode_choice.h"

#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The labels of the errors, as MLX writes "[rope] ...": construction and
 * apply are the operation itself. */
static const char COMPILE_NORM_ROPE_OPERATION[] = "dual_head_norm_rope";
static const char APPLY_NORM_ROPE_OPERATION[] = "dual_head_norm_rope";
static const char APPLY_NORM_ROPE_CACHE_OPERATION[] = "dual_head_norm_rope_with_cache";
static const char CLOSE_NORM_ROPE_OPERATION[] = "dual_head_norm_rope_close";
static const char BUILD_NORM_ROPE_GRAPH_OPERATION[] = "dual_head_norm_rope_graph";

/* (B, L, H, D) -> (B, H, L, D), as mlx-lm's attention transposes. */
static const int HEAD_MAJOR_AXES[4] = {0, 2, 1, 3};
enum { ATTENTION_INPUT_RANK = 4 };

/* The compiled graphs' bound, with or without the cache write (see the
 * file comment): 128 rows of 128. */
enum { COMPILED_GRAPH_MAX_ELEMENTS = 16384 };

/* ---- The fused backend --------------------------------------------------- */

/* Registration, mode resolution and which calls the kernel takes are
 * mode_choice.h's, shared with the dual head norm. */
static dualnorm_fused_registration fused_rope_registration = {NULL};

void mlx_dualnorm_set_fused_rope_backend(const mlx_dualnorm_fused_rope_backend* backend) {
  dualnorm_register_fused_kernel(&fused_rope_registration,
                                 backend == NULL ? NULL : &backend->kernel);
}

bool mlx_dualnorm_fused_rope_mode_available(void) {
  return dualnorm_fused_kernel_available(&fused_rope_registration);
}

/* ---- Graph builder ------------------------------------------------------- */

/* What one closure's builder reads at trace time: a copy per closure,
 * owned by the closure (freed with its last copy). */
typedef struct graph_constants {
  float rms_norm_epsilon;
  mlx_dualnorm_rope_parameters rope;
  bool has_query_weight;
  bool has_key_weight;
} graph_constants;

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
 * (the norm as normalize_heads takes it),
 * the first `dims` features multiplied by the input scale first where the
 * constants have one; every step on the one stream
 * dualnorm_select_side_stream picks. `freqs` is the call's table (borrowed)
 * or, for an object with a base, an empty handle. */
static int normalize_and_rotate(mlx_array* rotated, const mlx_array input,
                                const mlx_array scale_weight, const mlx_array rope_offset,
                                const mlx_array freqs, const graph_constants* constants,
                                const mlx_device default_device) {
  const mlx_dualnorm_rope_parameters* rope = &constants->rope;
  const mlx_optional_float rope_base = {.value = rope->base, .has_value = !rope->with_freqs};
  mlx_stream stream = mlx_stream_new();
  mlx_array normalized = mlx_array_new();
  mlx_array head_major = mlx_array_new();
  mlx_array scaled = mlx_array_new();
  int status =
      dualnorm_select_side_stream(&stream, input, default_device) != 0 ||
      normalize_heads(&normalized, input, scale_weight, constants->rms_norm_epsilon,
                      stream) != 0 ||
      mlx_transpose_axes(&head_major, normalized, HEAD_MAJOR_AXES, ATTENTION_INPUT_RANK,
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

/* The inputs of a norm + RoPE graph of these constants' layout. */
static size_t norm_rope_input_count(const graph_constants* constants) {
  return 3 + (size_t)constants->has_query_weight + (size_t)constants->has_key_weight +
         (size_t)constants->rope.with_freqs;
}

/* Whether a builder got an output vector and `expected_inputs` inputs;
 * else the reason sent to mlx_error, false. */
static bool graph_inputs_expected(const mlx_vector_array* output_vector,
                                  const mlx_vector_array input_vector, size_t expected_inputs) {
  size_t received_inputs = mlx_vector_array_size(input_vector);
  if (output_vector == NULL || received_inputs != expected_inputs) {
    mlx_error("[%s] expected %zu inputs and an output vector, received %zu inputs",
              BUILD_NORM_ROPE_GRAPH_OPERATION, expected_inputs, received_inputs);
    return false;
  }
  return true;
}

/* Inputs: queries, keys, the RoPE offset, then the query weight and the key
 * weight where the layout has them, then the frequency table where the
 * RoPE takes one. Output order is the caller's ABI:
 * rotated queries first, keys second, published once at the end. Every
 * handle made here is freed on every path; the input vector belongs to the
 * closure. */
static int build_norm_rope_graph(mlx_vector_array* output_vector,
                                 const mlx_vector_array input_vector, void* payload) {
  const graph_constants* constants = payload;
  if (!graph_inputs_expected(output_vector, input_vector, norm_rope_input_count(constants))) {
    return 1;
  }
  mlx_array queries = mlx_array_new();
  mlx_array keys = mlx_array_new();
  mlx_array rope_offset = mlx_array_new();
  mlx_array query_scale_weight = mlx_array_new();
  mlx_array key_scale_weight = mlx_array_new();
  mlx_array freqs = mlx_array_new();
  mlx_array rotated[2] = {mlx_array_new(), mlx_array_new()};
  mlx_device default_device = mlx_device_new();
  size_t next_input = 3;
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
      mlx_vector_array_set_data(output_vector, rotated, 2) != 0;
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

/* ---- The object ---------------------------------------------------------- */

struct mlx_dualnorm_dual_head_norm_rope_ {
  /* Owned closures, one per weight layout: the plain builders (composed
   * mode, prefill sizes, empty inputs) and their compiled forms (empty in
   * composed mode). All empty once closed. Used under lifetime_lock's read
   * side, released under its write side. */
  dualnorm_layout_graphs graphs;
  float rms_norm_epsilon;
  mlx_dualnorm_rope_parameters rope;
  mlx_dualnorm_mode mode;
  /* In FUSED mode, the backend resolved at construction (never NULL). */
  const mlx_dualnorm_fused_rope_backend* fused_backend;
  /* The graphs of apply_with_cache (the norm + RoPE and the two cache
   * writes), per weight layout, kept as `graphs` is. */
  dualnorm_layout_graphs cache_graphs;
  /* apply_with_cache's last write position as an int32 scalar (owned; empty
   * until the first call), reused while the position stays the same: every
   * layer of a decode step writes at the same row. Guarded by
   * write_offset_lock; graphs holding an older scalar keep it alive. */
  pthread_mutex_t write_offset_lock;
  int write_offset_value;
  mlx_array write_offset_scalar;
  /* Applies hold it shared, close exclusively: close waits for applies in
   * flight, and applies of one object on several threads run together. */
  pthread_rwlock_t lifetime_lock;
  bool closed; /* written under the exclusive lock */
};

/* Frees the closures and erases their traces from every thread's cache;
 * the caller holds lifetime_lock exclusively or is the only user. */
static int release_graphs(mlx_dualnorm_dual_head_norm_rope* norm_rope) {
  int status = dualnorm_release_layout_graphs(&norm_rope->graphs);
  status |= dualnorm_release_layout_graphs(&norm_rope->cache_graphs);
  norm_rope->closed = true;
  return status;
}

/* A plain closure of `builder` for one layout, carrying its own copy of
 * the constants (an empty handle, with the reason sent to mlx_error, on
 * failure). */
static mlx_closure new_plain_graph_of(const void* owner, int layout,
                                      int (*builder)(mlx_vector_array*, const mlx_vector_array,
                                                     void*)) {
  const mlx_dualnorm_dual_head_norm_rope* norm_rope = owner;
  graph_constants* constants = malloc(sizeof *constants);
  if (constants == NULL) {
    mlx_error("[%s] out of host memory", COMPILE_NORM_ROPE_OPERATION);
    return mlx_closure_new();
  }
  *constants = (graph_constants){
      .rms_norm_epsilon = norm_rope->rms_norm_epsilon,
      .rope = norm_rope->rope,
      .has_query_weight = (layout & QUERY_WEIGHTED_LAYOUT) != 0,
      .has_key_weight = (layout & KEY_WEIGHTED_LAYOUT) != 0,
  };
  mlx_closure plain_graph = mlx_closure_new_func_payload(builder, constants, free);
  if (plain_graph.ctx == NULL) {
    free(constants); /* a closure that was never made took no ownership */
  }
  return plain_graph;
}

/* The plain norm + RoPE builder of one layout. */
static mlx_closure new_plain_graph(const void* owner, int layout) {
  return new_plain_graph_of(owner, layout, build_norm_rope_graph);
}

static mlx_closure new_plain_cache_graph(const void* owner, int layout);

static uint64_t float_bits(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  return bits;
}

/* Builds the plain and (unless composed) compiled closure of every layout,
 * shape-specialized (see the file comment), with every constant the
 * builder reads as a compile constant. */
static int compile_graphs(mlx_dualnorm_dual_head_norm_rope* norm_rope) {
  const mlx_dualnorm_rope_parameters* rope = &norm_rope->rope;
  const uint64_t compile_constants[8] = {
      float_bits(norm_rope->rms_norm_epsilon), (uint64_t)(uint32_t)rope->dims,
      rope->traditional, float_bits(rope->base), float_bits(rope->scale),
      rope->with_freqs, rope->input_scale.has_value,
      rope->input_scale.has_value ? float_bits(rope->input_scale.value) : 0,
  };
  size_t constant_count = sizeof compile_constants / sizeof compile_constants[0];
  return dualnorm_compile_layout_graphs(&norm_rope->graphs, norm_rope->mode, new_plain_graph,
                                        norm_rope, compile_constants, constant_count) != 0 ||
         dualnorm_compile_layout_graphs(&norm_rope->cache_graphs, norm_rope->mode,
                                        new_plain_cache_graph, norm_rope, compile_constants,
                                        constant_count) != 0;
}

/* The constructor's argument checks, before anything is allocated. */
static int check_constants(double rms_norm_epsilon, const mlx_dualnorm_rope_parameters* rope,
                           mlx_dualnorm_error* error) {
  const char* operation = COMPILE_NORM_ROPE_OPERATION;
  int status = dualnorm_check_rms_norm_epsilon(rms_norm_epsilon, operation, error);
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
  if (rope->input_scale.has_value && !isfinite(rope->input_scale.value)) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "input_scale must be finite (as a float32), got %g",
                              (double)rope->input_scale.value);
  }
  return MLX_DUALNORM_OK;
}

int mlx_dualnorm_dual_head_norm_rope_new(mlx_dualnorm_dual_head_norm_rope** res,
                                         double rms_norm_epsilon,
                                         mlx_dualnorm_rope_parameters rope,
                                         mlx_dualnorm_mode mode, mlx_dualnorm_error* error) {
  const char* operation = COMPILE_NORM_ROPE_OPERATION;
  dualnorm_begin_call();
  if (res == NULL) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "the result pointer is NULL");
  }
  mlx_dualnorm_mode resolved_mode = MLX_DUALNORM_MODE_COMPILED;
  const mlx_dualnorm_fused_kernel* fused_kernel = NULL;
  int status = check_constants(rms_norm_epsilon, &rope, error);
  if (status == MLX_DUALNORM_OK) {
    status = dualnorm_resolve_mode(mode, &fused_rope_registration, operation, &resolved_mode,
                                   &fused_kernel, error);
  }
  if (status != MLX_DUALNORM_OK) {
    return status;
  }
  mlx_dualnorm_dual_head_norm_rope* norm_rope = calloc(1, sizeof *norm_rope);
  if (norm_rope == NULL || pthread_rwlock_init(&norm_rope->lifetime_lock, NULL) != 0) {
    free(norm_rope);
    return dualnorm_fail_with(error, MLX_DUALNORM_MLX_FAILURE, operation, "out of host memory");
  }
  if (pthread_mutex_init(&norm_rope->write_offset_lock, NULL) != 0) {
    pthread_rwlock_destroy(&norm_rope->lifetime_lock);
    free(norm_rope);
    return dualnorm_fail_with(error, MLX_DUALNORM_MLX_FAILURE, operation, "out of host memory");
  }
  norm_rope->write_offset_scalar = mlx_array_new();
  norm_rope->rms_norm_epsilon = (float)rms_norm_epsilon;
  norm_rope->rope = rope;
  norm_rope->mode = resolved_mode;
  /* The kernel is its table's first member (mode_choice.h). */
  norm_rope->fused_backend = (const mlx_dualnorm_fused_rope_backend*)fused_kernel;
  if (compile_graphs(norm_rope) != 0) {
    status = dualnorm_fail_in_mlx(error, operation);
    mlx_dualnorm_dual_head_norm_rope_free(norm_rope); /* releases what was built */
    return status;
  }
  *res = norm_rope;
  return MLX_DUALNORM_OK;
}

mlx_dualnorm_mode mlx_dualnorm_dual_head_norm_rope_mode(
    const mlx_dualnorm_dual_head_norm_rope* norm_rope) {
  return norm_rope == NULL ? MLX_DUALNORM_MODE_AUTO : norm_rope->mode;
}

float mlx_dualnorm_dual_head_norm_rope_epsilon(const mlx_dualnorm_dual_head_norm_rope* norm_rope) {
  return norm_rope == NULL ? NAN : norm_rope->rms_norm_epsilon;
}

mlx_dualnorm_rope_parameters mlx_dualnorm_dual_head_norm_rope_parameters(
    const mlx_dualnorm_dual_head_norm_rope* norm_rope) {
  return norm_rope == NULL ? (mlx_dualnorm_rope_parameters){0} : norm_rope->rope;
}

/* ---- Applying ------------------------------------------------------------ */

static bool is_integer_dtype(mlx_dtype dtype) {
  return dtype >= MLX_UINT8 && dtype <= MLX_INT64; /* mlx_dtype's integer run; not bool */
}

/* What one call knows about the RoPE offset, read once. */
typedef struct rope_offset_input {
  size_t rank;
  size_t size;
} rope_offset_input;

/* rope's checks of the offset that do not depend on a side: MLX 0.32.4
 * takes an integer array of at most one dimension. */
static int inspect_rope_offset(const mlx_array rope_offset, rope_offset_input* offset,
                               mlx_dualnorm_error* error) {
  const char* operation = APPLY_NORM_ROPE_OPERATION;
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
  const char* operation = APPLY_NORM_ROPE_OPERATION;
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
  const char* operation = APPLY_NORM_ROPE_OPERATION;
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
static int inspect_inputs(const mlx_dualnorm_dual_head_norm_rope* norm_rope,
                          dual_head_norm_call* call, rope_offset_input* offset,
                          const mlx_array queries, const mlx_array keys,
                          const mlx_array query_scale_weight, const mlx_array key_scale_weight,
                          const mlx_array rope_offset, const mlx_array freqs,
                          mlx_dualnorm_error* error) {
  const char* operation = APPLY_NORM_ROPE_OPERATION;
  int status = dualnorm_inspect_head_norm_input(&call->queries, operation, "queries", queries,
                                                "query_weight", query_scale_weight, true,
                                                error);
  if (status == MLX_DUALNORM_OK) {
    status = dualnorm_inspect_head_norm_input(&call->keys, operation, "keys", keys,
                                              "key_weight", key_scale_weight, true, error);
  }
  if (status == MLX_DUALNORM_OK) {
    status = inspect_rope_offset(rope_offset, offset, error);
  }
  if (status == MLX_DUALNORM_OK) {
    status = check_rope_side(&call->queries, "queries", &norm_rope->rope, offset->size, error);
  }
  if (status == MLX_DUALNORM_OK) {
    status = check_rope_side(&call->keys, "keys", &norm_rope->rope, offset->size, error);
  }
  if (status == MLX_DUALNORM_OK) {
    status = check_rope_freqs(&norm_rope->rope, freqs, error);
  }
  if (status == MLX_DUALNORM_OK) {
    status = dualnorm_check_float64_placement(call, operation, error);
  }
  return status;
}

/* The compiled graph for decode-sized, non-empty calls, with or without the
 * cache write; the plain builder otherwise (see the file comment). */
static bool takes_compiled_graph(const mlx_dualnorm_dual_head_norm_rope* norm_rope,
                                 const dual_head_norm_call* call) {
  const head_norm_input* queries = &call->queries;
  const head_norm_input* keys = &call->keys;
  if (norm_rope->mode == MLX_DUALNORM_MODE_COMPOSED || queries->size == 0 || keys->size == 0) {
    return false;
  }
  return queries->size + keys->size <= COMPILED_GRAPH_MAX_ELEMENTS;
}

/* Whether MLX's RoPE reads the offset of this side in bounds: a scalar, or
 * one value per batch entry (see the file comment for shape (1,)). */
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
static int fused_kernel_takes(const mlx_dualnorm_dual_head_norm_rope* norm_rope,
                              dual_head_norm_call* call, const rope_offset_input* offset,
                              const mlx_array freqs, bool* takes, mlx_dualnorm_error* error) {
  const mlx_dualnorm_fused_kernel* kernel = &norm_rope->fused_backend->kernel;
  *takes = dualnorm_fused_kernel_fits(kernel, call) &&
           normalized_rows_fit(kernel, &call->queries) &&
           normalized_rows_fit(kernel, &call->keys) &&
           offset_fits_side(&call->queries, offset) && offset_fits_side(&call->keys, offset) &&
           (freqs.ctx == NULL || mlx_array_dtype(freqs) == MLX_FLOAT32);
  return *takes ? dualnorm_default_device_is_gpu(call, APPLY_NORM_ROPE_OPERATION, takes, error)
                : MLX_DUALNORM_OK;
}

/* The KV-cache write of apply_with_cache, borrowed from its caller. */
typedef struct {
  mlx_array values;
  mlx_array key_cache;
  mlx_array value_cache;
  int write_offset;
  /* Whether the outputs also hold the rows fetched for attention. */
  bool fetch;
} cache_write;

/* One launch of the fused backend, the object held open for the duration:
 * no graph, so no trace; the constants are kernel arguments. With `cache`
 * (else NULL), the launch also writes the KV cache (the backend's
 * apply_with_cache). */
static int apply_fused_kernel(mlx_vector_array* res, mlx_dualnorm_dual_head_norm_rope* norm_rope,
                              const dual_head_norm_call* call, const mlx_array rope_offset,
                              const mlx_array freqs, const cache_write* cache,
                              mlx_dualnorm_error* error) {
  const char* operation =
      cache != NULL ? APPLY_NORM_ROPE_CACHE_OPERATION : APPLY_NORM_ROPE_OPERATION;
  const mlx_dualnorm_fused_rope_backend* backend = norm_rope->fused_backend;
  pthread_rwlock_rdlock(&norm_rope->lifetime_lock);
  bool closed = norm_rope->closed;
  int apply_status = 0;
  if (!closed && cache == NULL) {
    apply_status = backend->apply_with_freqs(
        res, call->queries.array, call->keys.array, call->queries.weight, call->keys.weight,
        rope_offset, freqs, norm_rope->rms_norm_epsilon, norm_rope->rope);
  } else if (!closed) {
    apply_status = backend->apply_with_cache(
        res, call->queries.array, call->keys.array, cache->values, call->queries.weight,
        call->keys.weight, rope_offset, freqs, cache->key_cache, cache->value_cache,
        cache->write_offset, norm_rope->rms_norm_epsilon, norm_rope->rope, cache->fetch);
  }
  pthread_rwlock_unlock(&norm_rope->lifetime_lock);
  if (closed) {
    return dualnorm_fail_with(error, MLX_DUALNORM_CLOSED, operation,
                              "the dual head norm rope is closed");
  }
  return apply_status != 0 ? dualnorm_fail_in_mlx(error, operation) : MLX_DUALNORM_OK;
}

/* The norm + RoPE graph's input vector (owned by the caller): queries,
 * keys, the RoPE offset, the call's weights, then the table where the call
 * has one (the builder's input order); `*layout` the call's. An empty
 * handle, with the reason sent to mlx_error, on failure. */
static mlx_vector_array norm_rope_graph_inputs(const dual_head_norm_call* call,
                                               const mlx_array* rope_offset,
                                               const mlx_array freqs, int* layout) {
  mlx_vector_array inputs = dualnorm_graph_inputs(call, rope_offset, layout);
  if (inputs.ctx != NULL && freqs.ctx != NULL &&
      mlx_vector_array_append_value(inputs, freqs) != 0) {
    mlx_vector_array_free(inputs); /* already failing: its status adds nothing */
    return mlx_vector_array_new();
  }
  return inputs;
}

/* Runs the closure of `graphs` (the object's norm + RoPE or cache graphs)
 * for the call's layout, compiled or plain (takes_compiled_graph), on
 * `inputs` (borrowed), the object held open for the duration. */
static int run_layout_graph(mlx_vector_array* res, mlx_dualnorm_dual_head_norm_rope* norm_rope,
                            const dualnorm_layout_graphs* graphs,
                            const dual_head_norm_call* call, int layout,
                            const mlx_vector_array inputs, const char* operation,
                            mlx_dualnorm_error* error) {
  bool compiled = takes_compiled_graph(norm_rope, call);
  pthread_rwlock_rdlock(&norm_rope->lifetime_lock);
  bool closed = norm_rope->closed;
  int apply_status = 0;
  if (!closed) {
    apply_status = mlx_closure_apply(
        res, compiled ? graphs->compiled[layout] : graphs->plain[layout], inputs);
  }
  pthread_rwlock_unlock(&norm_rope->lifetime_lock);
  if (closed) {
    return dualnorm_fail_with(error, MLX_DUALNORM_CLOSED, operation,
                              "the dual head norm rope is closed");
  }
  return apply_status != 0 ? dualnorm_fail_in_mlx(error, operation) : MLX_DUALNORM_OK;
}

/* Runs the chosen closure of the call's weight layout. */
static int apply_graph(mlx_vector_array* res, mlx_dualnorm_dual_head_norm_rope* norm_rope,
                       const dual_head_norm_call* call, const mlx_array rope_offset,
                       const mlx_array freqs, mlx_dualnorm_error* error) {
  const char* operation = APPLY_NORM_ROPE_OPERATION;
  int layout = WEIGHTLESS_LAYOUT;
  /* Owned here, freed below on every path. */
  mlx_vector_array input_vector = norm_rope_graph_inputs(call, &rope_offset, freqs, &layout);
  if (input_vector.ctx == NULL) {
    return dualnorm_fail_in_mlx(error, operation);
  }
  int status = run_layout_graph(res, norm_rope, &norm_rope->graphs, call, layout, input_vector,
                                operation, error);
  if (mlx_vector_array_free(input_vector) != 0 && status == MLX_DUALNORM_OK) {
    status = dualnorm_fail_in_mlx(error, operation);
  }
  return status;
}

/* An apply's start: the pointers, then every norm + RoPE input read and
 * checked once (inspect_inputs), failures labelled `operation`. */
static int begin_apply(const mlx_vector_array* res,
                       const mlx_dualnorm_dual_head_norm_rope* norm_rope,
                       dual_head_norm_call* call, rope_offset_input* offset,
                       const mlx_array queries, const mlx_array keys,
                       const mlx_array query_scale_weight, const mlx_array key_scale_weight,
                       const mlx_array rope_offset, const mlx_array freqs,
                       const char* operation, mlx_dualnorm_error* error) {
  dualnorm_begin_call();
  if (res == NULL || norm_rope == NULL) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "the result vector or the dual head norm rope is NULL");
  }
  int status = inspect_inputs(norm_rope, call, offset, queries, keys, query_scale_weight,
                              key_scale_weight, rope_offset, freqs, error);
  if (status != MLX_DUALNORM_OK && error != NULL) {
    error->operation = operation;
  }
  return status;
}

/* An apply's route, its inputs checked: the thread noted as applying the
 * object's `graphs` (and its queued erasures done), then `*fused` set where
 * FUSED mode's kernel takes the call. */
static int choose_route(const mlx_dualnorm_dual_head_norm_rope* norm_rope,
                        const dualnorm_layout_graphs* graphs, dual_head_norm_call* call,
                        const rope_offset_input* offset, const mlx_array freqs, bool* fused,
                        const char* operation, mlx_dualnorm_error* error) {
  if (!dualnorm_register_applying_thread(graphs->compile_ids) ||
      dualnorm_erase_queued_compile_ids() != 0) {
    return dualnorm_fail_in_mlx(error, operation);
  }
  return norm_rope->mode == MLX_DUALNORM_MODE_FUSED
             ? fused_kernel_takes(norm_rope, call, offset, freqs, fused, error)
             : MLX_DUALNORM_OK;
}

int mlx_dualnorm_dual_head_norm_rope_apply(
    mlx_vector_array* res, mlx_dualnorm_dual_head_norm_rope* norm_rope,
    const mlx_array queries, const mlx_array keys, const mlx_array query_scale_weight,
    const mlx_array key_scale_weight, const mlx_array rope_offset, mlx_dualnorm_error* error) {
  return mlx_dualnorm_dual_head_norm_rope_apply_with_freqs(
      res, norm_rope, queries, keys, query_scale_weight, key_scale_weight, rope_offset,
      mlx_array_new(), error);
}

int mlx_dualnorm_dual_head_norm_rope_apply_with_freqs(
    mlx_vector_array* res, mlx_dualnorm_dual_head_norm_rope* norm_rope,
    const mlx_array queries, const mlx_array keys, const mlx_array query_scale_weight,
    const mlx_array key_scale_weight, const mlx_array rope_offset, const mlx_array freqs,
    mlx_dualnorm_error* error) {
  const char* operation = APPLY_NORM_ROPE_OPERATION;
  dual_head_norm_call call = {0};
  rope_offset_input offset = {0};
  bool fused = false;
  int status = begin_apply(res, norm_rope, &call, &offset, queries, keys, query_scale_weight,
                           key_scale_weight, rope_offset, freqs, operation, error);
  if (status == MLX_DUALNORM_OK) {
    status = choose_route(norm_rope, &norm_rope->graphs, &call, &offset, freqs, &fused,
                          operation, error);
  }
  if (status != MLX_DUALNORM_OK) {
    return status;
  }
  return fused ? apply_fused_kernel(res, norm_rope, &call, rope_offset, freqs, NULL, error)
               : apply_graph(res, norm_rope, &call, rope_offset, freqs, error);
}

int mlx_dualnorm_dual_head_norm_rope_close(mlx_dualnorm_dual_head_norm_rope* norm_rope,
                                           mlx_dualnorm_error* error) {
  dualnorm_begin_call();
  if (norm_rope == NULL) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, CLOSE_NORM_ROPE_OPERATION,
                              "the dual head norm rope is NULL");
  }
  pthread_rwlock_wrlock(&norm_rope->lifetime_lock);
  int status = norm_rope->closed ? 0 : release_graphs(norm_rope);
  pthread_rwlock_unlock(&norm_rope->lifetime_lock);
  return status == 0 ? MLX_DUALNORM_OK : dualnorm_fail_in_mlx(error, CLOSE_NORM_ROPE_OPERATION);
}

void mlx_dualnorm_dual_head_norm_rope_free(mlx_dualnorm_dual_head_norm_rope* norm_rope) {
  if (norm_rope == NULL) {
    return;
  }
  mlx_dualnorm_dual_head_norm_rope_close(norm_rope, NULL);
  mlx_array_free(norm_rope->write_offset_scalar);
  pthread_mutex_destroy(&norm_rope->write_offset_lock);
  pthread_rwlock_destroy(&norm_rope->lifetime_lock);
  free(norm_rope);
}

/* ---- The norm + RoPE with the KV-cache write ------------------------------
 *
 * mlx_dualnorm_dual_head_norm_rope_apply_with_cache (dual_head_norm_rope_cache.h):
 * the norm + RoPE above, then the two writes of mlx-lm's
 * KVCache.update_and_fetch (`keys[..., w:w+L, :] = rotated keys`, the same
 * for the transposed values) as MLX slice updates. mlx-lm's indexing makes
 * a SliceUpdate whose position is a constant; here the position is an
 * int32 scalar INPUT of the graph (MLX's DynamicSliceUpdate), so a decode
 * step at the next row replays one trace. Both copy the buffer (or take
 * its memory when MLX may donate it) and then the update's elements, cast
 * to the buffer's dtype: the same bits in every element. The graphs are
 * compiled per input shape as the norm + RoPE's, so a buffer that grew
 * traces once per capacity. */

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
  int status = mlx_transpose_axes(&head_major_values, values, HEAD_MAJOR_AXES,
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

/* The cache graph's inputs past the norm + RoPE's, in this order. */
enum { CACHE_GRAPH_EXTRA_INPUTS = 4 }; /* values, key_cache, value_cache, write_offset */

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
  mlx_array outputs[3] = {mlx_array_new(), mlx_array_new(), mlx_array_new()};
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
           mlx_vector_array_set_data(res, outputs, 3) != 0;
  for (size_t index = 0; index < CACHE_GRAPH_EXTRA_INPUTS; ++index) {
    status |= mlx_array_free(cache_inputs[index]);
  }
  for (size_t index = 0; index < 3; ++index) {
    status |= mlx_array_free(outputs[index]);
  }
  status |= mlx_array_free(rotated_keys);
  status |= mlx_stream_free(stream);
  status |= mlx_device_free(default_device);
  return status;
}

/* Inputs: the norm + RoPE graph's (queries, keys, the RoPE offset, the
 * weights of the layout), then values, key_cache, value_cache and the write
 * offset. Outputs: publish_cache_outputs's. The input vector belongs to the
 * closure; every handle made here is freed on every path. */
static int build_norm_rope_cache_graph(mlx_vector_array* output_vector,
                                       const mlx_vector_array input_vector, void* payload) {
  size_t norm_rope_inputs = norm_rope_input_count(payload);
  if (!graph_inputs_expected(output_vector, input_vector,
                             norm_rope_inputs + CACHE_GRAPH_EXTRA_INPUTS)) {
    return 1;
  }
  mlx_array norm_rope_input_arrays[6] = {mlx_array_new(), mlx_array_new(), mlx_array_new(),
                                         mlx_array_new(), mlx_array_new(), mlx_array_new()};
  mlx_vector_array norm_rope_inputs_vector = mlx_vector_array_new();
  mlx_vector_array rotated = mlx_vector_array_new();
  int status = 0;
  for (size_t index = 0; status == 0 && index < norm_rope_inputs; ++index) {
    status = mlx_vector_array_get(&norm_rope_input_arrays[index], input_vector, index) != 0;
  }
  status = status ||
           mlx_vector_array_set_data(&norm_rope_inputs_vector, norm_rope_input_arrays,
                                     norm_rope_inputs) != 0 ||
           build_norm_rope_graph(&rotated, norm_rope_inputs_vector, payload) != 0 ||
           publish_cache_outputs(output_vector, rotated, input_vector, norm_rope_inputs,
                                 NULL) != 0;
  for (size_t index = 0; index < 6; ++index) {
    status |= mlx_array_free(norm_rope_input_arrays[index]);
  }
  status |= mlx_vector_array_free(norm_rope_inputs_vector);
  status |= mlx_vector_array_free(rotated);
  return status;
}

/* The plain cache builder of one layout, as new_plain_graph. */
static mlx_closure new_plain_cache_graph(const void* owner, int layout) {
  return new_plain_graph_of(owner, layout, build_norm_rope_cache_graph);
}

/* What the writes need, checked once per call (after the norm + RoPE's
 * checks): values (B, L, Hk, Dv) beside the keys; buffers (B, Hk, C, D) and
 * (B, Hk, Cv, Dv); rows [w, w + L) inside both. Failures are invalid
 * arguments; nothing is built. */
static int check_cache_inputs(const head_norm_input* keys, const mlx_array values,
                              const mlx_array key_cache, const mlx_array value_cache,
                              int write_offset, mlx_dualnorm_error* error) {
  const char* operation = APPLY_NORM_ROPE_CACHE_OPERATION;
  const mlx_array checked[3] = {values, key_cache, value_cache};
  static const char* const names[3] = {"values", "key_cache", "value_cache"};
  for (int index = 0; index < 3; ++index) {
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
  const int* value_shape = mlx_array_shape(values);
  if (value_shape[0] != key_shape[0] || value_shape[1] != key_shape[1] ||
      value_shape[2] != key_shape[2]) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "values (%d, %d, %d, %d) must have the batch, length and heads "
                              "of keys (%d, %d, %d, %d)",
                              value_shape[0], value_shape[1], value_shape[2], value_shape[3],
                              key_shape[0], key_shape[1], key_shape[2], key_shape[3]);
  }
  const int widths[2] = {key_shape[3], value_shape[3]};
  const mlx_array buffers[2] = {key_cache, value_cache};
  int length = key_shape[1];
  for (int side = 0; side < 2; ++side) {
    const int* buffer_shape = mlx_array_shape(buffers[side]);
    if (buffer_shape[0] != key_shape[0] || buffer_shape[1] != key_shape[2] ||
        buffer_shape[3] != widths[side]) {
      return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                                "%s (%d, %d, %d, %d) must be (batch %d, heads %d, capacity, "
                                "width %d)",
                                names[1 + side], buffer_shape[0], buffer_shape[1],
                                buffer_shape[2], buffer_shape[3], key_shape[0], key_shape[2],
                                widths[side]);
    }
    if (write_offset < 0 || (long long)write_offset + length > buffer_shape[2]) {
      return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                                "rows [%d, %lld) are outside the %d rows of %s", write_offset,
                                (long long)write_offset + length, buffer_shape[2],
                                names[1 + side]);
    }
  }
  return MLX_DUALNORM_OK;
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

/* Whether the fused backend writes the cache in the norm + RoPE's launch:
 * it can, and the values and both buffers have the queries' dtype (a
 * write that casts takes MLX's slice updates, which cast as indexing
 * does). */
static bool one_launch_takes(const mlx_dualnorm_dual_head_norm_rope* norm_rope,
                             const dual_head_norm_call* call, const cache_write* write) {
  mlx_dtype dtype = mlx_array_dtype(call->queries.array);
  return norm_rope->fused_backend->apply_with_cache != NULL &&
         mlx_array_dtype(write->values) == dtype && mlx_array_dtype(write->key_cache) == dtype &&
         mlx_array_dtype(write->value_cache) == dtype;
}

/* FUSED mode, a call the kernel takes but one_launch_takes does not: one
 * launch for the norm + RoPE, then the writes at the constant row
 * (write_cache_rows). `inputs` is the cache graph's input vector
 * (borrowed). */
static int apply_fused_kernel_with_cache(mlx_vector_array* res,
                                         mlx_dualnorm_dual_head_norm_rope* norm_rope,
                                         const dual_head_norm_call* call,
                                         const mlx_array rope_offset, const mlx_array freqs,
                                         const mlx_vector_array inputs, int write_offset,
                                         mlx_dualnorm_error* error) {
  mlx_vector_array rotated = mlx_vector_array_new();
  int status = apply_fused_kernel(&rotated, norm_rope, call, rope_offset, freqs, NULL, error);
  if (status == MLX_DUALNORM_OK &&
      publish_cache_outputs(res, rotated, inputs,
                            mlx_vector_array_size(inputs) - CACHE_GRAPH_EXTRA_INPUTS,
                            &write_offset) != 0) {
    status = dualnorm_fail_in_mlx(error, APPLY_NORM_ROPE_CACHE_OPERATION);
  }
  if (mlx_vector_array_free(rotated) != 0 && status == MLX_DUALNORM_OK) {
    status = dualnorm_fail_in_mlx(error, APPLY_NORM_ROPE_CACHE_OPERATION);
  }
  return status;
}

/* Sets `*res` to the three outputs of `written` (borrowed: rotated
 * queries, both buffers written) followed by rows [0, end) of both
 * buffers, MLX slices on the default device's stream: what the class's
 * `buffer[..., :end, :]` fetches (the graphs cannot hold them: their
 * shape changes at every decode step). Every handle made here is freed
 * on every path; `*res` is set only once everything is built. */
static int publish_with_fetched_rows(mlx_vector_array* res, const mlx_vector_array written,
                                     int end) {
  mlx_array outputs[5] = {mlx_array_new(), mlx_array_new(), mlx_array_new(), mlx_array_new(),
                          mlx_array_new()};
  mlx_device default_device = mlx_device_new();
  mlx_stream stream = mlx_stream_new();
  int status = mlx_get_default_device(&default_device) != 0 ||
               mlx_get_default_stream(&stream, default_device) != 0;
  for (size_t index = 0; status == 0 && index < 3; ++index) {
    status = mlx_vector_array_get(&outputs[index], written, index) != 0;
  }
  for (int buffer = 1; status == 0 && buffer < 3; ++buffer) {
    const int* shape = mlx_array_shape(outputs[buffer]);
    const int start[ATTENTION_INPUT_RANK] = {0, 0, 0, 0};
    const int stop[ATTENTION_INPUT_RANK] = {shape[0], shape[1], end, shape[3]};
    const int strides[ATTENTION_INPUT_RANK] = {1, 1, 1, 1};
    status = mlx_slice(&outputs[buffer + 2], outputs[buffer], start, ATTENTION_INPUT_RANK, stop,
                       ATTENTION_INPUT_RANK, strides, ATTENTION_INPUT_RANK, stream) != 0;
  }
  status = status || mlx_vector_array_set_data(res, outputs, 5) != 0;
  for (size_t index = 0; index < 5; ++index) {
    status |= mlx_array_free(outputs[index]);
  }
  status |= mlx_stream_free(stream);
  status |= mlx_device_free(default_device);
  return status;
}

/* The cache graph's input vector (owned by the caller): the norm + RoPE
 * graph's, then values, the buffers and the write position. An empty
 * handle, with the reason sent to mlx_error, on failure. */
static mlx_vector_array cache_graph_inputs(mlx_dualnorm_dual_head_norm_rope* norm_rope,
                                           const dual_head_norm_call* call,
                                           const mlx_array* rope_offset, const mlx_array freqs,
                                           const mlx_array values, const mlx_array key_cache,
                                           const mlx_array value_cache, int write_offset,
                                           int* layout) {
  mlx_vector_array inputs = norm_rope_graph_inputs(call, rope_offset, freqs, layout);
  if (inputs.ctx == NULL) {
    return inputs;
  }
  if (mlx_vector_array_append_value(inputs, values) != 0 ||
      mlx_vector_array_append_value(inputs, key_cache) != 0 ||
      mlx_vector_array_append_value(inputs, value_cache) != 0 ||
      append_write_offset(inputs, norm_rope, write_offset) != 0) {
    mlx_vector_array_free(inputs);
    return mlx_vector_array_new();
  }
  return inputs;
}

int mlx_dualnorm_dual_head_norm_rope_apply_with_cache(
    mlx_vector_array* res, mlx_dualnorm_dual_head_norm_rope* norm_rope,
    const mlx_array queries, const mlx_array keys, const mlx_array values,
    const mlx_array query_scale_weight, const mlx_array key_scale_weight,
    const mlx_array rope_offset, const mlx_array freqs, const mlx_array key_cache,
    const mlx_array value_cache, int write_offset, bool fetch, mlx_dualnorm_error* error) {
  const char* operation = APPLY_NORM_ROPE_CACHE_OPERATION;
  /* What the checks read of the inputs, once, and the route they choose. */
  struct {
    dual_head_norm_call call;
    rope_offset_input offset;
    bool fused;
  } facts = {0};
  dual_head_norm_call* call = &facts.call;
  /* The norm + RoPE's checks, reported as this call's. */
  int status = begin_apply(res, norm_rope, call, &facts.offset, queries, keys,
                           query_scale_weight, key_scale_weight, rope_offset, freqs, operation,
                           error);
  if (status == MLX_DUALNORM_OK) {
    status = check_cache_inputs(&call->keys, values, key_cache, value_cache, write_offset,
                                error);
  }
  if (status == MLX_DUALNORM_OK) {
    status = choose_route(norm_rope, &norm_rope->cache_graphs, call, &facts.offset, freqs,
                          &facts.fused, operation, error);
  }
  if (status != MLX_DUALNORM_OK) {
    return status;
  }
  const cache_write write = {values, key_cache, value_cache, write_offset, fetch};
  if (facts.fused && one_launch_takes(norm_rope, call, &write)) {
    return apply_fused_kernel(res, norm_rope, call, rope_offset, freqs, &write, error);
  }
  int layout = WEIGHTLESS_LAYOUT;
  /* Owned here, freed below on every path: the graph's inputs, and with
   * `fetch` the three written outputs before the fetched rows join them. */
  mlx_vector_array inputs = cache_graph_inputs(norm_rope, call, &rope_offset, freqs, values,
                                               key_cache, value_cache, write_offset, &layout);
  mlx_vector_array written = fetch ? mlx_vector_array_new() : (mlx_vector_array){NULL};
  if (inputs.ctx == NULL || (fetch && written.ctx == NULL)) {
    status = dualnorm_fail_in_mlx(error, operation);
  } else {
    mlx_vector_array* outputs = fetch ? &written : res;
    status = facts.fused ? apply_fused_kernel_with_cache(outputs, norm_rope, call, rope_offset,
                                                         freqs, inputs, write_offset, error)
                         : run_layout_graph(outputs, norm_rope, &norm_rope->cache_graphs, call,
                                            layout, inputs, operation, error);
  }
  int end = write_offset + mlx_array_shape(keys)[1];
  if (status == MLX_DUALNORM_OK && fetch && publish_with_fetched_rows(res, written, end) != 0) {
    status = dualnorm_fail_in_mlx(error, operation);
  }
  int freed = (fetch ? mlx_vector_array_free(written) : 0) | mlx_vector_array_free(inputs);
  if (freed != 0 && status == MLX_DUALNORM_OK) {
    status = dualnorm_fail_in_mlx(error, operation);
  }
  return status;
}
