/* mlx_fast_rms_norm over mlx::core::fast::rms_norm. */
#include <optional>

#include "mlx/fast.h"

#include "mlx/c/fast.h"
#include "mlx/c/private/mlx.h"

using namespace mlx_c_private;

extern "C" int mlx_fast_rms_norm(
    mlx_array* res,
    const mlx_array x,
    const mlx_array weight,
    float eps,
    const mlx_stream s) {
  return guarded([&] {
    const char* c_function = "mlx_fast_rms_norm";
    std::optional<mx::array> optional_weight;
    if (weight.ctx != nullptr) {
      optional_weight = *static_cast<const mx::array*>(weight.ctx);
    }
    assign(res,
        mx::fast::rms_norm(held<mx::array>(x, c_function), optional_weight, eps,
            held<mx::Stream>(s, c_function)),
        c_function);
  });
}
