/* mlx_transpose_axes, mlx_reshape, mlx_astype and the slice updates (mlx_slice_update,
 * mlx_slice_update_prod, mlx_slice_update_dynamic) over mlx::core,
 * behaving as upstream's ops.cpp. */
#include <string>
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

/* Upstream reads `shape` unchecked; NULL with a non-zero count is a
 * reported error here, as for mlx_transpose_axes. */
extern "C" int mlx_reshape(
    mlx_array* res,
    const mlx_array a,
    const int* shape,
    size_t shape_num,
    const mlx_stream s) {
  return status_of([&] {
    if (shape == nullptr && shape_num > 0) {
      throw std::invalid_argument("[mlx_reshape] NULL shape with a non-zero count");
    }
    store(res, mx::reshape(object_of(a), mx::Shape(shape, shape + shape_num), object_of(s)));
  });
}

extern "C" int mlx_astype(
    mlx_array* res,
    const mlx_array a,
    mlx_dtype dtype,
    const mlx_stream s) {
  return status_of([&] { store(res, mx::astype(object_of(a), to_cpp_dtype(dtype), object_of(s))); });
}

namespace {

/* The start, stop and strides lists of a slice update as MLX shapes.
 * Upstream reads them unchecked; NULL with a non-zero count is a reported
 * error here, naming `operation`. */
struct SliceBounds {
  mx::Shape start, stop, strides;
  SliceBounds(const char* operation, const int* start_list, size_t start_num,
              const int* stop_list, size_t stop_num, const int* strides_list,
              size_t strides_num) {
    if ((start_list == nullptr && start_num > 0) || (stop_list == nullptr && stop_num > 0) ||
        (strides_list == nullptr && strides_num > 0)) {
      throw std::invalid_argument(std::string("[") + operation +
                                  "] NULL list with a non-zero count");
    }
    start = mx::Shape(start_list, start_list + start_num);
    stop = mx::Shape(stop_list, stop_list + stop_num);
    strides = mx::Shape(strides_list, strides_list + strides_num);
  }
};

} // namespace

extern "C" int mlx_slice_update_prod(mlx_array* res, const mlx_array src,
    const mlx_array update, const int* start, size_t start_num, const int* stop,
    size_t stop_num, const int* strides, size_t strides_num, const mlx_stream s) {
  return status_of([&] {
    SliceBounds bounds("mlx_slice_update_prod", start, start_num, stop, stop_num, strides,
                       strides_num);
    store(res, mx::slice_update_prod(object_of(src), object_of(update), bounds.start,
                                     bounds.stop, bounds.strides, object_of(s)));
  });
}

extern "C" int mlx_slice(mlx_array* res, const mlx_array a, const int* start, size_t start_num,
    const int* stop, size_t stop_num, const int* strides, size_t strides_num,
    const mlx_stream s) {
  return status_of([&] {
    SliceBounds bounds("mlx_slice", start, start_num, stop, stop_num, strides, strides_num);
    store(res, mx::slice(object_of(a), bounds.start, bounds.stop, bounds.strides, object_of(s)));
  });
}

extern "C" int mlx_slice_update(mlx_array* res, const mlx_array src, const mlx_array update,
    const int* start, size_t start_num, const int* stop, size_t stop_num, const int* strides,
    size_t strides_num, const mlx_stream s) {
  return status_of([&] {
    SliceBounds bounds("mlx_slice_update", start, start_num, stop, stop_num, strides,
                       strides_num);
    store(res, mx::slice_update(object_of(src), object_of(update), bounds.start, bounds.stop,
                                bounds.strides, object_of(s)));
  });
}

/* Upstream reads `axes` unchecked; NULL with a non-zero count is a reported
 * error here, as for mlx_transpose_axes. */
extern "C" int mlx_slice_update_dynamic(mlx_array* res, const mlx_array src,
    const mlx_array update, const mlx_array start, const int* axes, size_t axes_num,
    const mlx_stream s) {
  return status_of([&] {
    if (axes == nullptr && axes_num > 0) {
      throw std::invalid_argument("[mlx_slice_update_dynamic] NULL axes with a non-zero count");
    }
    std::vector<int> update_axes(axes, axes + axes_num);
    store(res, mx::slice_update(object_of(src), object_of(update), object_of(start),
                                std::move(update_axes), object_of(s)));
  });
}
