/* mlx_vector_array over std::vector<mlx::core::array>. */
#include "mlx/c/vector.h"
#include "mlx/c/private/mlx.h"

namespace {

using namespace mlx_c_private;
using ArrayVector = std::vector<mx::array>;

ArrayVector arrays_of(const mlx_array* data, size_t n, const char* c_function) {
  if (n > 0 && data == nullptr) {
    throw std::invalid_argument(std::string("[") + c_function + "] NULL data");
  }
  ArrayVector arrays;
  arrays.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    arrays.push_back(held<mx::array>(data[i], c_function));
  }
  return arrays;
}

} // namespace

extern "C" mlx_vector_array mlx_vector_array_new(void) {
  return guarded_new<mlx_vector_array, ArrayVector>([] { return ArrayVector{}; });
}

extern "C" int mlx_vector_array_free(mlx_vector_array vec) {
  return guarded([&] { release<ArrayVector>(vec); });
}

extern "C" mlx_vector_array mlx_vector_array_new_data(const mlx_array* data, size_t n) {
  return guarded_new<mlx_vector_array, ArrayVector>(
      [&] { return arrays_of(data, n, "mlx_vector_array_new_data"); });
}

extern "C" int mlx_vector_array_set_data(
    mlx_vector_array* vec,
    const mlx_array* data,
    size_t n) {
  return guarded([&] {
    assign(vec, arrays_of(data, n, "mlx_vector_array_set_data"),
        "mlx_vector_array_set_data");
  });
}

extern "C" int mlx_vector_array_append_value(mlx_vector_array vec, const mlx_array val) {
  return guarded([&] {
    const char* c_function = "mlx_vector_array_append_value";
    held<ArrayVector>(vec, c_function).push_back(held<mx::array>(val, c_function));
  });
}

extern "C" size_t mlx_vector_array_size(mlx_vector_array vec) {
  return vec.ctx == nullptr ? 0 : static_cast<ArrayVector*>(vec.ctx)->size();
}

extern "C" int mlx_vector_array_get(mlx_array* res, const mlx_vector_array vec, size_t idx) {
  return guarded([&] {
    const char* c_function = "mlx_vector_array_get";
    const ArrayVector& arrays = held<ArrayVector>(vec, c_function);
    if (idx >= arrays.size()) {
      throw std::out_of_range(
          std::string("[") + c_function + "] index " + std::to_string(idx) +
          " is out of range for a vector of " + std::to_string(arrays.size()));
    }
    assign(res, arrays[idx], c_function);
  });
}
