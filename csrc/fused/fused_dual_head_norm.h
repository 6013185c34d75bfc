/* The fused dual head norm: ONE kernel launch on MLX's CUDA backend that
 * normalizes the rows of both queries and keys, with the bits of MLX's own
 * RMSNorm kernel (see dual_rms_norm_kernel.cuh for the contract).
 *
 * C API in the mlx-c style (handles in, status out, messages through the
 * mlx-c error handler), implemented in C++: NVRTC compiles the kernel once,
 * and an MLX primitive of this package's own (FusedDualRmsNorm) launches it
 * on MLX's command encoder. Not part of upstream mlx-c.
 */
#ifndef MLX_DUALNORM_FUSED_DUAL_HEAD_NORM_H
#define MLX_DUALNORM_FUSED_DUAL_HEAD_NORM_H

#include <stdbool.h>

#include "mlx/c/mlx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* True when the running MLX has a CUDA GPU (false on CPU-only builds). */
bool mlx_dualnorm_fused_backend_available(void);

/* Compiles the kernel with NVRTC, once per process; later calls return the
 * first outcome. 0 on success; 1 with the reason reported otherwise. */
int mlx_dualnorm_fused_prepare(void);

/* True when the fused kernel computes exactly what rms_norm would for these
 * inputs on the default device: the default device is the CUDA GPU, queries
 * and keys (and weights, if any) share one dtype among float32, float16 and
 * bfloat16, both inputs have rows, at most 8 dimensions, and fewer than
 * 2^31 rows together. Other inputs take the compiled graph, with the same
 * bits. Inputs must already satisfy rms_norm's
 * argument checks. */
bool mlx_dualnorm_fused_supports(
    const mlx_array queries,
    const mlx_array keys,
    const mlx_array query_scale_weight,
    const mlx_array key_scale_weight);

/* Sets `*res` (allocated when empty, owned by the caller) to the lazy
 * normalized queries and keys, in that order, from one kernel launch.
 * Inputs are borrowed; empty weight handles mean no weight. Requires a
 * successful mlx_dualnorm_fused_prepare and supported inputs. */
int mlx_dualnorm_fused_apply(
    mlx_vector_array* res,
    const mlx_array queries,
    const mlx_array keys,
    const mlx_array query_scale_weight,
    const mlx_array key_scale_weight,
    float rms_norm_epsilon);

#ifdef __cplusplus
}
#endif

#endif
