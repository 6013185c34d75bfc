/* mlx_array over mlx::core::array, behaving as upstream's array.cpp. */
#include <complex>

#include "mlx/c/array.h"
#include "mlx/c/private/mlx.h"
#include "mlx/types/half_types.h"

using namespace bundled_mlx_c;

/* MLX's Dtype::Val and mlx_dtype list the same types in the same order.
 * Upstream indexes a table with the value (undefined past the end); here an
 * unknown value is a reported error. */
mx::Dtype bundled_mlx_c::to_cpp_dtype(mlx_dtype dtype) {
  switch (dtype) {
    case MLX_BOOL: return mx::bool_;
    case MLX_UINT8: return mx::uint8;
    case MLX_UINT16: return mx::uint16;
    case MLX_UINT32: return mx::uint32;
    case MLX_UINT64: return mx::uint64;
    case MLX_INT8: return mx::int8;
    case MLX_INT16: return mx::int16;
    case MLX_INT32: return mx::int32;
    case MLX_INT64: return mx::int64;
    case MLX_FLOAT16: return mx::float16;
    case MLX_FLOAT32: return mx::float32;
    case MLX_FLOAT64: return mx::float64;
    case MLX_BFLOAT16: return mx::bfloat16;
    case MLX_COMPLEX64: return mx::complex64;
  }
  throw std::invalid_argument("unknown mlx_dtype " + std::to_string(static_cast<int>(dtype)));
}

namespace {

mlx_dtype to_c_dtype(mx::Dtype dtype) {
  return static_cast<mlx_dtype>(static_cast<int>(dtype.val()));
}

template <typename Element>
mx::array copied_array(const void* data, const mx::Shape& shape, mx::Dtype dtype) {
  return mx::array(static_cast<const Element*>(data), shape, dtype);
}

/* A new array holding a copy of `data`. Upstream reads `data` and `shape`
 * unchecked; NULLs and negative extents are reported errors here. */
mx::array copied_array_of_dtype(const void* data, const int* shape, int dim, mlx_dtype dtype) {
  if (dim < 0 || (dim > 0 && shape == nullptr)) {
    throw std::invalid_argument("[mlx_array_new_data] invalid shape");
  }
  const mx::Shape cpp_shape(shape, shape + dim);
  size_t count = 1;
  for (int extent : cpp_shape) {
    if (extent < 0) {
      throw std::invalid_argument("[mlx_array_new_data] negative extent");
    }
    count *= static_cast<size_t>(extent);
  }
  if (count > 0 && data == nullptr) {
    throw std::invalid_argument("[mlx_array_new_data] NULL data");
  }
  const mx::Dtype cpp_dtype = to_cpp_dtype(dtype);
  switch (dtype) {
    case MLX_BOOL: return copied_array<bool>(data, cpp_shape, cpp_dtype);
    case MLX_UINT8: return copied_array<uint8_t>(data, cpp_shape, cpp_dtype);
    case MLX_UINT16: return copied_array<uint16_t>(data, cpp_shape, cpp_dtype);
    case MLX_UINT32: return copied_array<uint32_t>(data, cpp_shape, cpp_dtype);
    case MLX_UINT64: return copied_array<uint64_t>(data, cpp_shape, cpp_dtype);
    case MLX_INT8: return copied_array<int8_t>(data, cpp_shape, cpp_dtype);
    case MLX_INT16: return copied_array<int16_t>(data, cpp_shape, cpp_dtype);
    case MLX_INT32: return copied_array<int32_t>(data, cpp_shape, cpp_dtype);
    case MLX_INT64: return copied_array<int64_t>(data, cpp_shape, cpp_dtype);
    case MLX_FLOAT16: return copied_array<mx::float16_t>(data, cpp_shape, cpp_dtype);
    case MLX_FLOAT32: return copied_array<float>(data, cpp_shape, cpp_dtype);
    case MLX_FLOAT64: return copied_array<double>(data, cpp_shape, cpp_dtype);
    case MLX_BFLOAT16: return copied_array<mx::bfloat16_t>(data, cpp_shape, cpp_dtype);
    case MLX_COMPLEX64: return copied_array<mx::complex64_t>(data, cpp_shape, cpp_dtype);
  }
  throw std::invalid_argument("unknown mlx_dtype " + std::to_string(static_cast<int>(dtype)));
}

/* The data of an evaluated array, REINTERPRETED as Element whatever its
 * dtype (as upstream: the caller picks the accessor that fits). Upstream
 * crashes on an array that is not evaluated; here that is a reported error. */
template <typename Element>
const Element* evaluated_data(const mlx_array arr, const char* c_function) {
  return value_or<const Element*>(nullptr, [&] {
    const mx::array& array = object_of(arr);
    if (!array.is_available()) {
      throw std::invalid_argument(
          std::string("[") + c_function + "] the array is not evaluated");
    }
    return array.data<Element>();
  });
}

/* One property of a non-empty array; `fallback` with a reported error for
 * an empty handle (upstream returns 0, nullptr or MLX_BOOL likewise). */
template <typename Value, typename Read>
Value array_property(const mlx_array arr, Value fallback, Read read) {
  return value_or(fallback, [&] { return read(object_of(arr)); });
}

} // namespace

extern "C" size_t mlx_dtype_size(mlx_dtype dtype) {
  return value_or<size_t>(0, [&] { return to_cpp_dtype(dtype).size(); });
}

extern "C" mlx_array mlx_array_new(void) {
  return mlx_array{nullptr};
}

extern "C" int mlx_array_free(mlx_array arr) {
  return free_handle(arr);
}

extern "C" mlx_array mlx_array_new_data(
    const void* data,
    const int* shape,
    int dim,
    mlx_dtype dtype) {
  return value_or(mlx_array{nullptr},
      [&] { return new_handle<mlx_array>(copied_array_of_dtype(data, shape, dim, dtype)); });
}

extern "C" int mlx_array_set(mlx_array* arr, const mlx_array src) {
  return status_of([&] { store(arr, object_of(src)); });
}

extern "C" size_t mlx_array_itemsize(const mlx_array arr) {
  return array_property<size_t>(arr, 0, [](const mx::array& a) { return a.itemsize(); });
}

extern "C" size_t mlx_array_size(const mlx_array arr) {
  return array_property<size_t>(arr, 0, [](const mx::array& a) { return a.size(); });
}

extern "C" size_t mlx_array_nbytes(const mlx_array arr) {
  return array_property<size_t>(arr, 0, [](const mx::array& a) { return a.nbytes(); });
}

extern "C" size_t mlx_array_ndim(const mlx_array arr) {
  return array_property<size_t>(arr, 0, [](const mx::array& a) { return a.ndim(); });
}

extern "C" const int* mlx_array_shape(const mlx_array arr) {
  return array_property<const int*>(
      arr, nullptr, [](const mx::array& a) { return a.shape().data(); });
}

/* A negative `dim` counts from the end, as in MLX. */
extern "C" int mlx_array_dim(const mlx_array arr, int dim) {
  return array_property<int>(arr, 0, [dim](const mx::array& a) { return a.shape(dim); });
}

extern "C" mlx_dtype mlx_array_dtype(const mlx_array arr) {
  return array_property<mlx_dtype>(
      arr, MLX_BOOL, [](const mx::array& a) { return to_c_dtype(a.dtype()); });
}

extern "C" int mlx_array_eval(mlx_array arr) {
  return status_of([&] { object_of(arr).eval(); });
}

#define DEFINE_DATA_ACCESSOR(NAME, ELEMENT)                               \
  extern "C" const ELEMENT* mlx_array_data_##NAME(const mlx_array arr) { \
    return evaluated_data<ELEMENT>(arr, "mlx_array_data_" #NAME);        \
  }

DEFINE_DATA_ACCESSOR(bool, bool)
DEFINE_DATA_ACCESSOR(uint8, uint8_t)
DEFINE_DATA_ACCESSOR(uint16, uint16_t)
DEFINE_DATA_ACCESSOR(uint32, uint32_t)
DEFINE_DATA_ACCESSOR(uint64, uint64_t)
DEFINE_DATA_ACCESSOR(int8, int8_t)
DEFINE_DATA_ACCESSOR(int16, int16_t)
DEFINE_DATA_ACCESSOR(int32, int32_t)
DEFINE_DATA_ACCESSOR(int64, int64_t)
DEFINE_DATA_ACCESSOR(float32, float)
DEFINE_DATA_ACCESSOR(float64, double)
