/* The dual head norm + RoPE object, and running one graph or one fused
 * launch with the object held open (internal; dual_head_norm_rope_object.c).
 * Its life cycle (new, close, free) is dual_head_norm_rope.c's.
 *
 * A file that includes this header defines _POSIX_C_SOURCE first (the
 * object holds POSIX locks, which a strict -std=c11 hides).
 */
#ifndef MLX_DUALNORM_PRIVATE_DUAL_HEAD_NORM_ROPE_OBJECT_H
#define MLX_DUALNORM_PRIVATE_DUAL_HEAD_NORM_ROPE_OBJECT_H

#include <pthread.h>
#include <stdbool.h>

#include "private/dual_head_norm_rope_common.h"
#include "private/head_norm_input.h"
#include "private/weight_set_graphs.h"

struct mlx_dualnorm_dual_head_norm_rope_ {
  /* Owned closures, one per weight set: the plain builders (composed
   * mode, prefill sizes, empty inputs) and their compiled forms (empty in
   * composed mode). All empty once closed. Used under lifetime_lock's read
   * side, released under its write side. */
  dualnorm_weight_set_graphs graphs;
  /* false for an object made without norms (then rms_norm_epsilon is NaN
   * and only the weightless graphs are ever run). */
  bool normalizes;
  float rms_norm_epsilon;
  mlx_dualnorm_rope_parameters rope;
  mlx_dualnorm_mode mode;
  /* In FUSED mode, the backend resolved at construction (never NULL). */
  const mlx_dualnorm_fused_rope_backend* fused_backend;
  /* The graphs of a call with a cache write (the norm + RoPE and the two
   * writes), per weight set, kept as `graphs` is. */
  dualnorm_weight_set_graphs cache_graphs;
  /* (The write row's int32 scalar is position_scalar.h's, the one holder
   * of positions, not the object's.) */
  /* Applies hold it shared, close exclusively: close waits for applies in
   * flight, and applies of one object on several threads run together. */
  pthread_rwlock_t lifetime_lock;
  bool closed; /* written under the exclusive lock */
};

/* One launch of the fused backend, the object held open for the duration:
 * no graph, so no trace; the constants are kernel arguments. With
 * `cache_write` (else NULL) the launch also writes the KV cache. `*res` as
 * the backend's apply sets it; failures labelled `operation`. */
int dualnorm_run_fused_launch(mlx_vector_array* res,
                              mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
                              const mlx_dualnorm_rope_inputs* inputs,
                              const mlx_dualnorm_cache_write* cache_write,
                              const char* operation, mlx_dualnorm_error* error);

/* Runs the closure of `graphs` (the object's norm + RoPE or cache graphs)
 * for `weight_set`, compiled or plain (dualnorm_takes_compiled_graph), on
 * `inputs` (borrowed), the object held open for the duration. */
int dualnorm_run_weight_set_graph(mlx_vector_array* res,
                                  mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
                                  const dualnorm_weight_set_graphs* graphs,
                                  const dual_head_norm_call* sides, int weight_set,
                                  const mlx_vector_array inputs, const char* operation,
                                  mlx_dualnorm_error* error);

#endif
