/* What the host side of both fused primitives shares (CUDA builds only:
 * it needs the headers of MLX's CUDA backend): the kernels' row layout as
 * MLX's RMSNorm launches it, and the loading of a cubin's kernels into
 * MLX's CUDA context. Private to fused/. */
#ifndef MLX_DUALNORM_FUSED_KERNEL_HOST_H
#define MLX_DUALNORM_FUSED_KERNEL_HOST_H

#include <mutex>
#include <string>

#include <cuda.h>

#include "mlx/array.h"
#include "mlx/device.h"

#include "fused/dual_rms_norm_kernel.cuh"

namespace mlx_dualnorm_fused {

/* The kernels' argument layout (RowLayout, DualRmsNormParams), from its one
 * definition. */
MLX_DUALNORM_KERNEL_PARAMS

/* The layout of the rows of `input` (normalized along its last axis) and
 * MLX's block size for them; `weight` may be null. */
RowLayout row_layout(const mlx::core::array& input, const mlx::core::array* weight);

/* The float32, float16 and bfloat16 kernels of one cubin, named PREFIX_float32
 * and so on, loaded once, at the first evaluation, where MLX has the device
 * context current. Driver entry points come from the libcuda MLX loaded;
 * the module is the process's from then on. */
class KernelModule {
 public:
  /* `operation` prefixes every error, as "[operation] ..."; both strings
   * are static. */
  KernelModule(const char* operation, const char* kernel_prefix)
      : operation_(operation), kernel_prefix_(kernel_prefix) {}

  void set_cubin(std::string cubin) {
    cubin_ = std::move(cubin);
  }

  /* The kernel for `dtype` (float32, float16 or bfloat16). */
  CUfunction kernel_for(mlx::core::Dtype dtype, mlx::core::Device device);

 private:
  void load();

  const char* operation_;
  const char* kernel_prefix_;
  std::string cubin_;
  std::once_flag loaded_;
  std::string load_failure_;
  CUfunction float32_kernel_ = nullptr;
  CUfunction float16_kernel_ = nullptr;
  CUfunction bfloat16_kernel_ = nullptr;
};

} // namespace mlx_dualnorm_fused

#endif
