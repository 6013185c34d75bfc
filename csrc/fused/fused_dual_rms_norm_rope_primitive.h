/* The MLX primitive that launches the fused dual RMS norm + RoPE (CUDA
 * builds only: it needs the headers of MLX's CUDA backend). Private to
 * fused/; this header itself needs no CUDA header. */
#ifndef MLX_DUALNORM_FUSED_DUAL_RMS_NORM_ROPE_PRIMITIVE_H
#define MLX_DUALNORM_FUSED_DUAL_RMS_NORM_ROPE_PRIMITIVE_H

#include <string>
#include <vector>

#include "mlx/array.h"

namespace mlx_dualnorm_fused {

/* Widest row the kernel takes, in elements: a row is staged in shared
 * memory (width * element size bytes, within the 48 KiB every launch may
 * use without opting in). */
inline constexpr int kMaxRopeRowWidth = 8192;

/* Hands the kernel's cubin to the primitive, which loads it (once, at the
 * first evaluation, where MLX has the device context current). */
void set_rope_kernel_cubin(std::string cubin);

/* The RoPE of both sides, as fast::rope takes it (with a base). */
struct RopeConstants {
  int dims;
  bool traditional;
  float base;
  float scale;
};

/* The lazy rotated queries (B, Hq, L, D) and keys (B, Hk, L, D) of one
 * fused launch over queries (B, L, Hq, D) and keys (B, L', Hk, D'), which
 * share a float dtype with the weights, if given. `offset` is an integer
 * scalar, or one value per batch entry of both sides. */
std::vector<mlx::core::array> fused_dual_rms_norm_rope(
    const mlx::core::array& queries,
    const mlx::core::array& keys,
    const mlx::core::array* query_weight,
    const mlx::core::array* key_weight,
    const mlx::core::array& offset,
    float rms_norm_epsilon,
    const RopeConstants& rope);

} // namespace mlx_dualnorm_fused

#endif
