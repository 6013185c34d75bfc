/* The fused dual head norm: ONE kernel launch on MLX's CUDA backend that
 * normalizes the rows of both queries and keys, with the bits of MLX's own
 * RMSNorm kernel (see dual_head_norm_kernel.cuh for the contract).
 *
 * A plug-in of the composite (dual_head_norm.h): this file exports the
 * table of functions the composite calls, and a program that links the
 * fused mode registers it with
 *     mlx_dualnorm_set_fused_backend(mlx_dualnorm_fused_backend_table());
 * Implemented in C++ over MLX (NVRTC compiles the kernel once; an MLX
 * primitive of this package's own, FusedDualRmsNorm, launches it on MLX's
 * command encoder); failures reach mlx-c's error handler. Not part of
 * upstream mlx-c.
 */
#ifndef MLX_DUALNORM_FUSED_DUAL_HEAD_NORM_H
#define MLX_DUALNORM_FUSED_DUAL_HEAD_NORM_H

#include "mlx_dualnorm/dual_head_norm.h"
#include "mlx_dualnorm/dual_head_norm_rope.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The fused mode's functions, static for the process. In a build without
 * MLX's CUDA headers the table reports the mode unavailable. */
const mlx_dualnorm_fused_backend* mlx_dualnorm_fused_backend_table(void);

/* The fused mode of the dual head norm + RoPE (dual_head_norm_rope.h), one
 * kernel launch for the rows of both inputs; registered with
 *     mlx_dualnorm_set_fused_rope_backend(mlx_dualnorm_fused_rope_backend_table());
 * Unavailable, like the other table, in a build without MLX's CUDA headers. */
const mlx_dualnorm_fused_rope_backend* mlx_dualnorm_fused_rope_backend_table(void);

/* Whether both fused kernels take their outputs from MLX's stream-ordered
 * device pool, as MLX's own kernels do; false where they fall back to
 * MLX's public allocator (unified memory: correct, slower to allocate),
 * and in a build without MLX's CUDA headers. Needs no GPU. */
bool mlx_dualnorm_fused_outputs_in_device_pool(void);

#ifdef __cplusplus
}
#endif

#endif
