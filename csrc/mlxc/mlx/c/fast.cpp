/* mlx_fast_rms_norm and mlx_fast_rope_dynamic over mlx::core::fast,
 * behaving as upstream's fast.cpp. */
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
  return status_of([&] {
    std::optional<mx::array> optional_weight;
    if (weight.ctx != nullptr) {
      optional_weight = object_of(weight);
    }
    store(res, mx::fast::rms_norm(object_of(x), optional_weight, eps, object_of(s)));
  });
}

extern "C" int mlx_fast_rope_dynamic(
    mlx_array* res,
    const mlx_array x,
    int dims,
    bool traditional,
    mlx_optional_float base,
    float scale,
    const mlx_array offset,
    const mlx_array freqs /* may be null */,
    const mlx_stream s) {
  return status_of([&] {
    std::optional<float> optional_base;
    if (base.has_value) {
      optional_base = base.value;
    }
    std::optional<mx::array> optional_freqs;
    if (freqs.ctx != nullptr) {
      optional_freqs = object_of(freqs);
    }
    store(res,
        mx::fast::rope(object_of(x), dims, traditional, optional_base, scale,
            object_of(offset), optional_freqs, object_of(s)));
  });
}
