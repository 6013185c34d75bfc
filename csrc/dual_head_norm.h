/* The compiled dual-output query/key head RMS normalization.
 *
 * One call returns (rms_norm(queries, query_scale_weight, eps),
 * rms_norm(keys, key_scale_weight, eps)): the gated-delta prework of
 * Qwen3-Next / Qwen3.5 linear-attention layers, built as one shapeless
 * compiled MLX graph whose primitives and order are those of two
 * mlx_fast_rms_norm calls, so the bits are the composed path's.
 *
 * Plain C over the mlx-c API. Every fallible call returns a status
 * (mlx_dualnorm_status) and, on failure, leaves the operation and a
 * description in the calling thread's error record.
 */
#ifndef MLX_DUALNORM_DUAL_HEAD_NORM_H
#define MLX_DUALNORM_DUAL_HEAD_NORM_H

#include "mlx/c/mlx.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum mlx_dualnorm_status_ {
  MLX_DUALNORM_OK = 0,
  /* MLX itself failed; the description is MLX's first message. */
  MLX_DUALNORM_MLX_FAILURE = 1,
  /* An input the composed path would reject, or one the shapeless replay
   * would silently misread (a weight whose length is not the width). */
  MLX_DUALNORM_INVALID_ARGUMENT = 2,
  /* The dual head norm was closed. */
  MLX_DUALNORM_CLOSED = 3,
} mlx_dualnorm_status;

/* How the dual head norm runs. AUTO resolves, at construction, to FUSED
 * where MLX has a CUDA GPU and the kernel compiles, else to COMPILED. */
typedef enum mlx_dualnorm_mode_ {
  MLX_DUALNORM_MODE_AUTO = 0,
  /* The two rms_norm calls, built on every call (the reference path). */
  MLX_DUALNORM_MODE_COMPOSED = 1,
  /* One replay of the shapeless compiled dual-output graph. */
  MLX_DUALNORM_MODE_COMPILED = 2,
  /* One CUDA kernel launch for both inputs (fused/); inputs it does not
   * support take the compiled graph, with the same bits. */
  MLX_DUALNORM_MODE_FUSED = 3,
} mlx_dualnorm_mode;

/* Opaque: the compiled graphs (one per weight layout) and the epsilon they
 * bake in. Created by _new, its graphs released by _close, its memory by
 * _free; the struct outlives _close so late callers get MLX_DUALNORM_CLOSED
 * instead of a dangling pointer. */
typedef struct mlx_dualnorm_compiled_dual_head_norm_
    mlx_dualnorm_compiled_dual_head_norm;

/* Routes every mlx-c error message into the calling thread's error record.
 * Idempotent; call once before anything else (the Python package does so at
 * import). */
void mlx_dualnorm_install_error_handler(void);

/* Compiles the shapeless dual head-norm graphs with `rms_norm_epsilon`
 * baked in, for `mode` (MLX_DUALNORM_MODE_FUSED fails with an invalid
 * argument where MLX has no CUDA GPU). `*res` receives a new object the
 * caller owns (free it with mlx_dualnorm_compiled_dual_head_norm_free). */
int mlx_dualnorm_compiled_dual_head_norm_new(
    mlx_dualnorm_compiled_dual_head_norm** res,
    float rms_norm_epsilon,
    mlx_dualnorm_mode mode);

/* The mode construction resolved (never AUTO). */
mlx_dualnorm_mode mlx_dualnorm_compiled_dual_head_norm_mode(
    const mlx_dualnorm_compiled_dual_head_norm* dual_head_norm);

float mlx_dualnorm_compiled_dual_head_norm_epsilon(
    const mlx_dualnorm_compiled_dual_head_norm* dual_head_norm);

/* Applies the graph for the weights given (an empty weight handle means no
 * weight for that side). Inputs are BORROWED: never freed here, and only
 * referenced by the lazy outputs. On success `*res` (allocated when empty,
 * owned by the caller) holds exactly two lazy arrays: the normalized
 * queries first, the normalized keys second. Thread-safe. */
int mlx_dualnorm_apply_compiled_dual_head_norm(
    mlx_vector_array* res,
    mlx_dualnorm_compiled_dual_head_norm* dual_head_norm,
    const mlx_array queries,
    const mlx_array keys,
    const mlx_array query_scale_weight,
    const mlx_array key_scale_weight);

/* Releases the compiled graphs and their compile-cache entries; later
 * applies fail with MLX_DUALNORM_CLOSED. Waits for applies in flight.
 * Closing twice is a no-op. */
int mlx_dualnorm_compiled_dual_head_norm_close(
    mlx_dualnorm_compiled_dual_head_norm* dual_head_norm);

/* Closes (if still open) and frees. NULL is a no-op. The caller must ensure
 * no other thread still uses the pointer. */
void mlx_dualnorm_compiled_dual_head_norm_free(
    mlx_dualnorm_compiled_dual_head_norm* dual_head_norm);

/* The calling thread's record of its last failure: valid until its next
 * call into this API. */
mlx_dualnorm_status mlx_dualnorm_last_error_status(void);
const char* mlx_dualnorm_last_error_operation(void);
const char* mlx_dualnorm_last_error_description(void);

/* Forgets the calling thread's last failure. Entry points of this API do it
 * themselves; callers of raw mlx-c functions do it before a call whose
 * message they want, since the record keeps the FIRST message it receives
 * (the root cause, when a failure inside a graph builder propagates out
 * through the closure and the compiled graph). */
void mlx_dualnorm_clear_last_error(void);

#ifdef __cplusplus
}
#endif

#endif
