/* mlx_vector_array over std::vector<mlx::core::array>, behaving as
 * upstream's vector.cpp. */
#include "mlx/c/vector.h"
#include "mlx/c/private/mlx.h"

using namespace bundled_mlx_c;

namespace {

/* The arrays behind `n` handles. Upstream reads `data` unchecked; a NULL
 * `data` with n > 0 is a reported error here. */
ArrayVector arrays_of(const mlx_array* data, size_t n) {
  if (n > 0 && data == nullptr) {
    throw std::invalid_argument("expected a non-NULL mlx_array* for a non-zero count");
  }
  ArrayVector arrays;
  arrays.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    arrays.push_back(object_of(data[i]));
  }
  return arrays;
}

} // namespace

/* As upstream, a NEW vector is a non-empty handle holding no arrays. */
extern "C" mlx_vector_array mlx_vector_array_new(void) {
  return value_or(mlx_vector_array{nullptr}, [] { return new_handle<mlx_vector_array>(ArrayVector{}); });
}

extern "C" int mlx_vector_array_free(mlx_vector_array vec) {
  return free_handle(vec);
}

extern "C" mlx_vector_array mlx_vector_array_new_data(const mlx_array* data, size_t n) {
  return value_or(mlx_vector_array{nullptr},
      [&] { return new_handle<mlx_vector_array>(arrays_of(data, n)); });
}

extern "C" int mlx_vector_array_set_data(
    mlx_vector_array* vec,
    const mlx_array* data,
    size_t n) {
  return status_of([&] { store(vec, arrays_of(data, n)); });
}

extern "C" int mlx_vector_array_append_value(mlx_vector_array vec, const mlx_array val) {
  return status_of([&] { object_of(vec).push_back(object_of(val)); });
}

extern "C" size_t mlx_vector_array_size(mlx_vector_array vec) {
  return value_or<size_t>(0, [&] { return object_of(vec).size(); });
}

/* An index past the end is the std::out_of_range of std::vector::at,
 * reported with its message, as upstream. */
extern "C" int mlx_vector_array_get(mlx_array* res, const mlx_vector_array vec, size_t idx) {
  return status_of([&] { store(res, object_of(vec).at(idx)); });
}
