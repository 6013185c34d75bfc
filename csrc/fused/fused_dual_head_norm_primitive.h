/* The MLX primitive that launches the fused dual RMS norm (CUDA builds
 * only: it needs the headers of MLX's CUDA backend). Private to fused/. */
#ifndef MLX_DUALNORM_FUSED_DUAL_HEAD_NORM_PRIMITIVE_H
#define MLX_DUALNORM_FUSED_DUAL_HEAD_NORM_PRIMITIVE_H

#include <memory>
#include <string>
#include <vector>

#include "mlx/array.h"

#include "fused/dual_head_norm_kernel.cuh"

namespace mlx_dualnorm_fused {

/* Highest input rank the kernel indexes (its row layout holds that many
 * strides); higher ranks take the compiled graph. */
inline constexpr int kMaxRank = MLX_DUALNORM_MAX_RANK;

/* Hands the kernel's cubin to the primitive, which loads it (once, at the
 * first evaluation, where MLX has the device context current). */
void set_kernel_cubin(std::string cubin);

/* The lazy normalized queries and keys of one fused launch. `queries` and
 * `keys` share a float dtype; a weight, if given, has that dtype too. */
std::vector<mlx::core::array> fused_dual_head_norm(
    const mlx::core::array& queries,
    const mlx::core::array& keys,
    const mlx::core::array* query_weight,
    const mlx::core::array* key_weight,
    float rms_norm_epsilon);

} // namespace mlx_dualnorm_fused

#endif
