/* The dual head norm + RoPE object held open for one run
 * (private/dual_head_norm_rope_object.h): a graph replayed or traced, or
 * one fused launch, under the read side of the object's lifetime lock, so
 * close waits for the runs in flight and a run never starts on a closed
 * object.
 */
#define _POSIX_C_SOURCE 200809L

#include "private/dual_head_norm_rope_object.h"

#include "private/call_errors.h"
#include "private/dual_head_norm_rope_checks.h"

/* Holds `dual_head_norm_rope` open for one apply: takes the read side of its
 * lifetime lock, so close waits until release_after_apply. Returns
 * MLX_DUALNORM_OK with the lock held, or MLX_DUALNORM_CLOSED (labelled
 * `operation`) with nothing held where the object is closed. */
static int hold_open(mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope, const char* operation,
                     mlx_dualnorm_error* error) {
  pthread_rwlock_rdlock(&dual_head_norm_rope->lifetime_lock);
  if (!dual_head_norm_rope->closed) {
    return MLX_DUALNORM_OK;
  }
  pthread_rwlock_unlock(&dual_head_norm_rope->lifetime_lock);
  return dualnorm_fail_with(error, MLX_DUALNORM_CLOSED, operation,
                            "the dual head norm rope is closed");
}

/* Lets go of hold_open's lock, then reports the apply's status (non-zero:
 * the reason MLX gave, labelled `operation`). */
static int release_after_apply(mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
                               int apply_status, const char* operation, mlx_dualnorm_error* error) {
  pthread_rwlock_unlock(&dual_head_norm_rope->lifetime_lock);
  return apply_status != 0 ? dualnorm_fail_in_mlx(error, operation) : MLX_DUALNORM_OK;
}

int dualnorm_run_fused_launch(mlx_vector_array* res,
                              mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
                              const mlx_dualnorm_rope_inputs* inputs,
                              const mlx_dualnorm_cache_write* cache_write, const char* operation,
                              mlx_dualnorm_error* error) {
  int status = hold_open(dual_head_norm_rope, operation, error);
  if (status != MLX_DUALNORM_OK) {
    return status;
  }
  int apply_status = dual_head_norm_rope->fused_backend->apply(
      res, inputs, cache_write, dual_head_norm_rope->normalizes,
      dual_head_norm_rope->rms_norm_epsilon, dual_head_norm_rope->rope);
  return release_after_apply(dual_head_norm_rope, apply_status, operation, error);
}

int dualnorm_run_weight_set_graph(mlx_vector_array* res,
                                  mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
                                  const dualnorm_weight_set_graphs* graphs,
                                  const dual_head_norm_call* sides, int weight_set,
                                  const mlx_vector_array inputs, const char* operation,
                                  mlx_dualnorm_error* error) {
  bool compiled = dualnorm_takes_compiled_graph(dual_head_norm_rope, sides);
  int status = hold_open(dual_head_norm_rope, operation, error);
  if (status != MLX_DUALNORM_OK) {
    return status;
  }
  int apply_status = mlx_closure_apply(
      res, compiled ? graphs->compiled[weight_set] : graphs->plain[weight_set], inputs);
  return release_after_apply(dual_head_norm_rope, apply_status, operation, error);
}
