/* mlx_fast_rms_norm over mlx::core::fast::rms_norm, behaving as
 * upstream's fast.cpp. */
#include <optional>

#include "mlx/fast.h"

#include "mlx/c/fast.h"
#include "mlx/c/private/mlx.h"

using namespace bundled_mlx_c;

extern "C" int mlx_fast_rms_norm(
    mlx_array* res,
    const mlx_array x,
    const mlx_array weight,
    float eps,
    const mlx_stream s) {
  try {
    std::optional<mx::array> optional_weight;
    if (weight.ctx != nullptr) {
      optional_weight = object_of(weight);
    }
    store(res, mx::fast::rms_norm(object_of(x), optional_weight, eps, object_of(s)));
    return 0;
  } catch (const std::exception& error) {
    mlx_error("%s", error.what());
    return 1;
  }
}
