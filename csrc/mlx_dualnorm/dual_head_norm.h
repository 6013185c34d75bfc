/* The compiled dual-output query/key head RMS normalization.
 *
 * One call returns (rms_norm(queries, query_scale_weight, eps),
 * rms_norm(keys, key_scale_weight, eps)): the q/k head prework of
 * Qwen3-Next / Qwen3.5 layers, built as one compiled MLX graph
 * whose primitives and order are those of two mlx_fast_rms_norm calls, so
 * the bits are the composed path's.
 *
 * Plain C over the public mlx-c API: it compiles with a C compiler against
 * this package's mlx-c subset or upstream mlx-c, and links with
 * `-lmlxc -lmlx`. The fused CUDA mode is a plug-in (fused/), linked in and
 * registered only where it is built.
 *
 * The status, mode and error types, and the process-wide set-up, are
 * dual_head_norm_common.h's, shared with dual_head_norm_rope.h.
 */
#ifndef MLX_DUALNORM_DUAL_HEAD_NORM_H
#define MLX_DUALNORM_DUAL_HEAD_NORM_H

#include <stdbool.h>

#include "dual_head_norm_common.h"
#include "mlx/c/mlx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The fused CUDA mode of the dual head norm, as the composite sees it
 * (the shared part and its contract: mlx_dualnorm_fused_kernel). */
typedef struct mlx_dualnorm_fused_backend_ {
  /* First member: the composite registers a pointer to it. */
  mlx_dualnorm_fused_kernel kernel;
  /* Sets `*res` (allocated when empty, owned by the caller) to the lazy
   * normalized queries and keys, in that order, from one launch. Inputs
   * are borrowed; an empty weight handle means no weight. 0 on success;
   * non-zero with the reason sent to mlx_error. */
  int (*apply)(mlx_vector_array* res,
               const mlx_array queries,
               const mlx_array keys,
               const mlx_array query_scale_weight,
               const mlx_array key_scale_weight,
               float rms_norm_epsilon);
} mlx_dualnorm_fused_backend;

/* Opaque: the compiled graphs (one per weight set) and the epsilon they
 * bake in; its life cycle is dual_head_norm_common.h's. */
typedef struct mlx_dualnorm_compiled_dual_head_norm_
    mlx_dualnorm_compiled_dual_head_norm;

/* Registers the fused CUDA mode process-wide (NULL unregisters it). The
 * table must outlive every object created while it is registered. A build
 * without fused/ never calls this: AUTO then resolves to COMPILED. */
void mlx_dualnorm_set_fused_backend(const mlx_dualnorm_fused_backend* backend);

/* True when mode FUSED can be asked for: a backend is registered and MLX
 * has a CUDA GPU. */
bool mlx_dualnorm_fused_mode_available(void);

/* Compiles the dual head-norm graphs with `rms_norm_epsilon`
 * baked in, for `mode`. The epsilon must be finite, >= 0 and within
 * float32's range (it is checked before rounding to float32, the type MLX
 * uses). `*res` receives a new object the caller owns (free it with
 * mlx_dualnorm_compiled_dual_head_norm_free). */
int mlx_dualnorm_compiled_dual_head_norm_new(
    mlx_dualnorm_compiled_dual_head_norm** res,
    double rms_norm_epsilon,
    mlx_dualnorm_mode mode,
    mlx_dualnorm_error* error);

/* The mode construction resolved (never AUTO). */
mlx_dualnorm_mode mlx_dualnorm_compiled_dual_head_norm_mode(
    const mlx_dualnorm_compiled_dual_head_norm* dual_head_norm);

/* The epsilon the graphs bake in, as the float32 MLX uses. */
float mlx_dualnorm_compiled_dual_head_norm_epsilon(
    const mlx_dualnorm_compiled_dual_head_norm* dual_head_norm);

/* Applies the graph for the weights given (an empty weight handle means no
 * weight for that side). Outputs: two lazy arrays, the normalized queries
 * first, the normalized keys second (ownership: the common life cycle). */
int mlx_dualnorm_compiled_dual_head_norm_apply(
    mlx_vector_array* res,
    mlx_dualnorm_compiled_dual_head_norm* dual_head_norm,
    const mlx_array queries,
    const mlx_array keys,
    const mlx_array query_scale_weight,
    const mlx_array key_scale_weight,
    mlx_dualnorm_error* error);

/* Releases the compiled graphs (the common life cycle's _close). */
int mlx_dualnorm_compiled_dual_head_norm_close(
    mlx_dualnorm_compiled_dual_head_norm* dual_head_norm,
    mlx_dualnorm_error* error);

/* Closes (if still open) and frees (the common life cycle's _free). */
void mlx_dualnorm_compiled_dual_head_norm_free(
    mlx_dualnorm_compiled_dual_head_norm* dual_head_norm);

#ifdef __cplusplus
}
#endif

#endif
