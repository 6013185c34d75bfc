/* mlx_transpose_axes over mlx::core::transpose, and mlx_slice_update and
 * mlx_slice_update_dynamic over mlx::core::slice_update (the constant and
 * the array-start overloads), behaving as upstream's ops.cpp. */
#include <vector>

#include "mlx/ops.h"

#include "mlx/c/ops.h"
#include "mlx/c/private/mlx.h"

using namespace bundled_mlx_c;

/* Upstream reads `axes` unchecked; NULL with a non-zero count is a reported
 * error here. */
extern "C" int mlx_transpose_axes(
    mlx_array* res,
    const mlx_array a,
    const int* axes,
    size_t axes_num,
    const mlx_stream s) {
  return status_of([&] {
    if (axes == nullptr && axes_num > 0) {
      throw std::invalid_argument("[mlx_transpose_axes] NULL axes with a non-zero count");
    }
    std::vector<int> permutation(axes, axes + axes_num);
    store(res, mx::transpose(object_of(a), std::move(permutation), object_of(s)));
  });
}

/* Upstream reads `axes` unchecked; NULL with a non-zero count is a reported
 * error here, as for mlx_transpose_axes. */
extern "C" int mlx_slice_update_dynamic(
    mlx_array* res,
    const mlx_array src,
    const mlx_array update,
    const mlx_array start,
    const int* axes,
    size_t axes_num,
    const mlx_stream s) {
  return status_of([&] {
    if (axes == nullptr && axes_num > 0) {
      throw std::invalid_argument("[mlx_slice_update_dynamic] NULL axes with a non-zero count");
    }
    std::vector<int> update_axes(axes, axes + axes_num);
    store(res,
          mx::slice_update(object_of(src), object_of(update), object_of(start),
                           std::move(update_axes), object_of(s)));
  });
}

/* Upstream reads the index arrays unchecked; a NULL one with a non-zero
 * count is a reported error here. */
extern "C" int mlx_slice_update(
    mlx_array* res,
    const mlx_array src,
    const mlx_array update,
    const int* start,
    size_t start_num,
    const int* stop,
    size_t stop_num,
    const int* strides,
    size_t strides_num,
    const mlx_stream s) {
  return status_of([&] {
    if ((start == nullptr && start_num > 0) || (stop == nullptr && stop_num > 0) ||
        (strides == nullptr && strides_num > 0)) {
      throw std::invalid_argument("[mlx_slice_update] NULL indices with a non-zero count");
    }
    store(res,
          mx::slice_update(object_of(src), object_of(update), mx::Shape(start, start + start_num),
                           mx::Shape(stop, stop + stop_num),
                           mx::Shape(strides, strides + strides_num), object_of(s)));
  });
}
