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
 * Without norms (mlx_dualnorm_dual_head_norm_rope_new_without_norms) the
 * builders skip rms_norm and the rest is unchanged: the prework of
 * attention that has no q/k norms (mlx-lm's Llama family: two transposes,
 * two rope, and with the cache write the two slice updates) as one call.
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
 * builder: on CPU each new shape would cost a trace, and at those sizes
 * MLX's fused CPU kernels are no faster than the composed ops. The bound
 * counts elements, not rows, because MLX's fused CPU kernels lose to the
 * composed ops per element, while the compiled graph saves a fixed number
 * of dispatches (RoPE's CPU op graph is most of them); the cache graphs
 * take the same bound. docs/performance.md ("The compiled graphs' bounds")
 * has the measurements it was chosen from. Empty inputs take the plain
 * builder too, on the CPU stream (nothing to compute, as dual_head_norm.c
 * does for rms_norm).
 *
 * Each object compiles under ids of its own (dualnorm_new_compile_ids) with
 * its constants as compile constants, and closing erases those ids from
 * every thread's cache (compile_erasure.h). Each input is read and checked
 * once per call (dual_head_norm_rope_checks.c), so bad input is an invalid argument
 * naming the operation, never an MLX failure inside a trace.
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
 * calls it takes is decided by the composite, from the facts read once per
 * call (the backend only launches); the others run the compiled graph,
 * same bits.
 * An offset of shape (1,) with more than one batch entry is one of those:
 * MLX 0.32.4's CUDA RoPE reads it with a stride of 1 per batch entry, past
 * its end, so only MLX's own kernel gives MLX's answer there.
 *
 * This file holds the object's life cycle and every public entry point of
 * the family, the KV-cache write's included: each fills one
 * mlx_dualnorm_dual_head_norm_rope_call, and
 * mlx_dualnorm_dual_head_norm_rope_apply_call routes it. The builders, the
 * checks, the runs and the KV-cache write's route are units of their own,
 * each called from above only (private/dual_head_norm_rope_common.h lists
 * them).
 */
/* pthread_rwlock_t is POSIX.1-2001, hidden by a strict -std=c11. */
#define _POSIX_C_SOURCE 200809L

#include "mlx_dualnorm/dual_head_norm_rope.h"
#include "mlx_dualnorm/dual_head_norm_rope_cache.h"

#include "private/call_errors.h"
#include "private/compile_erasure.h"
#include "private/dual_head_norm_rope_cache_route.h"
#include "private/dual_head_norm_rope_cache_graph.h"
#include "private/dual_head_norm_rope_checks.h"
#include "private/dual_head_norm_rope_graph.h"
#include "private/dual_head_norm_rope_object.h"
#include "private/mode_choice.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static const char CLOSE_DUAL_HEAD_NORM_ROPE_OPERATION[] = "dual_head_norm_rope_close";

/* The size of the first version of mlx_dualnorm_dual_head_norm_rope_call:
 * every field up to cache_write. A call struct at least this large is read. */
static const size_t FIRST_CALL_STRUCT_SIZE =
    offsetof(mlx_dualnorm_dual_head_norm_rope_call, cache_write) +
    sizeof(const mlx_dualnorm_cache_write*);

/* ---- The fused backend --------------------------------------------------- */

/* Registration, mode resolution and which calls the kernel takes are
 * mode_choice.h's, shared with the dual head norm. */
static dualnorm_fused_registration fused_dual_head_norm_rope_registration = {NULL};

void mlx_dualnorm_set_fused_rope_backend(const mlx_dualnorm_fused_rope_backend* backend) {
  dualnorm_register_fused_kernel(&fused_dual_head_norm_rope_registration,
                                 backend == NULL ? NULL : &backend->kernel);
}

bool mlx_dualnorm_fused_rope_mode_available(void) {
  return dualnorm_fused_kernel_available(&fused_dual_head_norm_rope_registration);
}

/* ---- The object ---------------------------------------------------------- */

/* Frees the closures and erases their traces from every thread's cache;
 * the caller holds lifetime_lock exclusively or is the only user. */
static int release_graphs(mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope) {
  int status = dualnorm_release_weight_set_graphs(&dual_head_norm_rope->graphs);
  status |= dualnorm_release_weight_set_graphs(&dual_head_norm_rope->cache_graphs);
  dual_head_norm_rope->closed = true;
  return status;
}

static uint64_t float_bits(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  return bits;
}

/* Builds the plain and (unless composed) compiled closure of every weight_set,
 * shape-specialized (see the file comment), with every constant the
 * builder reads as a compile constant. */
static int compile_graphs(mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope) {
  const mlx_dualnorm_rope_parameters* rope = &dual_head_norm_rope->rope;
  const uint64_t compile_constants[9] = {
      dual_head_norm_rope->normalizes,
      float_bits(dual_head_norm_rope->rms_norm_epsilon),
      (uint64_t)(uint32_t)rope->dims,
      rope->traditional,
      float_bits(rope->base),
      float_bits(rope->scale),
      rope->with_freqs,
      rope->input_scale.has_value,
      rope->input_scale.has_value ? float_bits(rope->input_scale.value) : 0,
  };
  size_t constant_count = sizeof compile_constants / sizeof compile_constants[0];
  /* Read by the closure makers only; each closure keeps its own copy. */
  const dual_head_norm_rope_constants constants = {
      .normalizes = dual_head_norm_rope->normalizes,
      .rms_norm_epsilon = dual_head_norm_rope->rms_norm_epsilon,
      .rope = dual_head_norm_rope->rope,
  };
  return dualnorm_compile_weight_set_graphs(&dual_head_norm_rope->graphs, dual_head_norm_rope->mode,
                                            dualnorm_new_dual_head_norm_rope_graph, &constants,
                                            compile_constants, constant_count) != 0 ||
         dualnorm_compile_weight_set_graphs(&dual_head_norm_rope->cache_graphs,
                                            dual_head_norm_rope->mode,
                                            dualnorm_new_dual_head_norm_rope_cache_graph,
                                            &constants, compile_constants, constant_count) != 0;
}

/* Both constructors: with norms of `rms_norm_epsilon` where `normalizes`,
 * else without norms (the epsilon then unread, NaN in the object). */
static int new_object(mlx_dualnorm_dual_head_norm_rope** res, bool normalizes,
                      double rms_norm_epsilon, mlx_dualnorm_rope_parameters rope,
                      mlx_dualnorm_mode mode, mlx_dualnorm_error* error) {
  const char* operation = DUALNORM_DUAL_HEAD_NORM_ROPE_OPERATION;
  dualnorm_begin_call();
  if (res == NULL) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "the result pointer is NULL");
  }
  mlx_dualnorm_mode resolved_mode = MLX_DUALNORM_MODE_COMPILED;
  const mlx_dualnorm_fused_kernel* fused_kernel = NULL;
  int status =
      dualnorm_check_dual_head_norm_rope_constants(normalizes, rms_norm_epsilon, &rope, error);
  if (status == MLX_DUALNORM_OK) {
    status = dualnorm_resolve_mode(mode, &fused_dual_head_norm_rope_registration, operation,
                                   &resolved_mode, &fused_kernel, error);
  }
  if (status != MLX_DUALNORM_OK) {
    return status;
  }
  mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope = calloc(1, sizeof *dual_head_norm_rope);
  if (dual_head_norm_rope == NULL ||
      pthread_rwlock_init(&dual_head_norm_rope->lifetime_lock, NULL) != 0) {
    free(dual_head_norm_rope);
    return dualnorm_fail_with(error, MLX_DUALNORM_MLX_FAILURE, operation, "out of host memory");
  }
  dual_head_norm_rope->normalizes = normalizes;
  dual_head_norm_rope->rms_norm_epsilon = normalizes ? (float)rms_norm_epsilon : NAN;
  dual_head_norm_rope->rope = rope;
  dual_head_norm_rope->mode = resolved_mode;
  /* The kernel is its table's first member (mode_choice.h). */
  dual_head_norm_rope->fused_backend = (const mlx_dualnorm_fused_rope_backend*)fused_kernel;
  if (compile_graphs(dual_head_norm_rope) != 0) {
    status = dualnorm_fail_in_mlx(error, operation);
    mlx_dualnorm_dual_head_norm_rope_free(dual_head_norm_rope); /* releases what was built */
    return status;
  }
  *res = dual_head_norm_rope;
  return MLX_DUALNORM_OK;
}

int mlx_dualnorm_dual_head_norm_rope_new(mlx_dualnorm_dual_head_norm_rope** res,
                                         double rms_norm_epsilon,
                                         mlx_dualnorm_rope_parameters rope,
                                         mlx_dualnorm_mode mode, mlx_dualnorm_error* error) {
  return new_object(res, true, rms_norm_epsilon, rope, mode, error);
}

int mlx_dualnorm_dual_head_norm_rope_new_without_norms(mlx_dualnorm_dual_head_norm_rope** res,
                                                       mlx_dualnorm_rope_parameters rope,
                                                       mlx_dualnorm_mode mode,
                                                       mlx_dualnorm_error* error) {
  return new_object(res, false, 0.0, rope, mode, error);
}

bool mlx_dualnorm_dual_head_norm_rope_normalizes(
    const mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope) {
  return dual_head_norm_rope != NULL && dual_head_norm_rope->normalizes;
}

mlx_dualnorm_mode mlx_dualnorm_dual_head_norm_rope_mode(
    const mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope) {
  return dual_head_norm_rope == NULL ? MLX_DUALNORM_MODE_AUTO : dual_head_norm_rope->mode;
}

float mlx_dualnorm_dual_head_norm_rope_epsilon(
    const mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope) {
  return dual_head_norm_rope == NULL ? NAN : dual_head_norm_rope->rms_norm_epsilon;
}

mlx_dualnorm_rope_parameters mlx_dualnorm_dual_head_norm_rope_parameters(
    const mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope) {
  return dual_head_norm_rope == NULL ? (mlx_dualnorm_rope_parameters){0}
                                     : dual_head_norm_rope->rope;
}

/* ---- Applying ------------------------------------------------------------ */

/* Runs the chosen closure of the call's weight set on an input vector
 * owned here, freed on every path. */
static int apply_graph(mlx_vector_array* res, mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
                       const dual_head_norm_call* sides, const mlx_dualnorm_rope_inputs* inputs,
                       mlx_dualnorm_error* error) {
  const char* operation = DUALNORM_DUAL_HEAD_NORM_ROPE_OPERATION;
  int weight_set = WEIGHT_SET_NONE;
  mlx_vector_array input_vector =
      dualnorm_dual_head_norm_rope_graph_inputs(sides, inputs, &weight_set);
  if (input_vector.ctx == NULL) {
    return dualnorm_fail_in_mlx(error, operation);
  }
  int status = dualnorm_run_weight_set_graph(res, dual_head_norm_rope, &dual_head_norm_rope->graphs,
                                             sides, weight_set, input_vector, operation, error);
  return dualnorm_free_vector_after(status, input_vector, operation, error);
}

int mlx_dualnorm_dual_head_norm_rope_apply_call(
    mlx_vector_array* res, mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
    const mlx_dualnorm_dual_head_norm_rope_call* call, mlx_dualnorm_error* error) {
  dualnorm_begin_call();
  if (call == NULL) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT,
                              DUALNORM_DUAL_HEAD_NORM_ROPE_OPERATION, "the call is NULL");
  }
  if (call->struct_size < FIRST_CALL_STRUCT_SIZE) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT,
                              DUALNORM_DUAL_HEAD_NORM_ROPE_OPERATION,
                              "the call's struct_size (%zu) is smaller than the first "
                              "version's (%zu)",
                              call->struct_size, FIRST_CALL_STRUCT_SIZE);
  }
  const mlx_dualnorm_rope_inputs* inputs = &call->inputs;
  const mlx_dualnorm_cache_write* cache_write = call->cache_write;
  const char* operation = cache_write != NULL ? DUALNORM_DUAL_HEAD_NORM_ROPE_CACHE_OPERATION
                                              : DUALNORM_DUAL_HEAD_NORM_ROPE_OPERATION;
  dual_head_norm_rope_facts facts = {0};
  int status = dualnorm_check_dual_head_norm_rope_call(res, dual_head_norm_rope, inputs,
                                                       cache_write, operation, &facts, error);
  if (status != MLX_DUALNORM_OK) {
    return status;
  }
  if (cache_write != NULL) {
    return dualnorm_apply_dual_head_norm_rope_with_cache(res, dual_head_norm_rope, &facts, inputs,
                                                         cache_write, error);
  }
  return facts.fused
             ? dualnorm_run_fused_launch(res, dual_head_norm_rope, inputs, NULL, operation, error)
             : apply_graph(res, dual_head_norm_rope, &facts.sides, inputs, error);
}

int mlx_dualnorm_dual_head_norm_rope_apply(mlx_vector_array* res,
                                           mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
                                           const mlx_array queries, const mlx_array keys,
                                           const mlx_array query_scale_weight,
                                           const mlx_array key_scale_weight,
                                           const mlx_array rope_offset, mlx_dualnorm_error* error) {
  return mlx_dualnorm_dual_head_norm_rope_apply_with_freqs(res, dual_head_norm_rope, queries, keys,
                                                           query_scale_weight, key_scale_weight,
                                                           rope_offset, mlx_array_new(), error);
}

int mlx_dualnorm_dual_head_norm_rope_apply_with_freqs(
    mlx_vector_array* res, mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
    const mlx_array queries, const mlx_array keys, const mlx_array query_scale_weight,
    const mlx_array key_scale_weight, const mlx_array rope_offset, const mlx_array freqs,
    mlx_dualnorm_error* error) {
  const mlx_dualnorm_dual_head_norm_rope_call call = {
      .struct_size = sizeof call,
      .inputs = {queries, keys, query_scale_weight, key_scale_weight, rope_offset, freqs},
      .cache_write = NULL,
  };
  return mlx_dualnorm_dual_head_norm_rope_apply_call(res, dual_head_norm_rope, &call, error);
}

int mlx_dualnorm_dual_head_norm_rope_apply_with_cache(
    mlx_vector_array* res, mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
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
  return mlx_dualnorm_dual_head_norm_rope_apply_call(res, dual_head_norm_rope, &call, error);
}

int mlx_dualnorm_dual_head_norm_rope_close(mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
                                           mlx_dualnorm_error* error) {
  const char* operation = CLOSE_DUAL_HEAD_NORM_ROPE_OPERATION;
  dualnorm_begin_call();
  if (dual_head_norm_rope == NULL) {
    return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                              "the dual head norm rope is NULL");
  }
  pthread_rwlock_wrlock(&dual_head_norm_rope->lifetime_lock);
  int status = dual_head_norm_rope->closed ? 0 : release_graphs(dual_head_norm_rope);
  pthread_rwlock_unlock(&dual_head_norm_rope->lifetime_lock);
  return status == 0 ? MLX_DUALNORM_OK : dualnorm_fail_in_mlx(error, operation);
}

void mlx_dualnorm_dual_head_norm_rope_free(mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope) {
  if (dual_head_norm_rope == NULL) {
    return;
  }
  mlx_dualnorm_dual_head_norm_rope_close(dual_head_norm_rope, NULL);
  pthread_rwlock_destroy(&dual_head_norm_rope->lifetime_lock);
  free(dual_head_norm_rope);
}
