/* mlx_array over mlx::core::array. */
#include <complex>

#include "mlx/c/array.h"
#include "mlx/c/private/mlx.h"
#include "mlx/types/half_types.h"

namespace {

using namespace mlx_c_private;

/* MLX's Dtype::Val and mlx_dtype list the same types in the same order. */
mx::Dtype to_cpp_dtype(mlx_dtype dtype) {
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
  throw std::invalid_argument("[mlx_dtype] unknown dtype value");
}

mlx_dtype to_c_dtype(mx::Dtype dtype) {
  return static_cast<mlx_dtype>(static_cast<int>(dtype.val()));
}

template <typename Element>
mx::array copied_array(const void* data, mx::Shape shape, mx::Dtype dtype) {
  return mx::array(static_cast<const Element*>(data), std::move(shape), dtype);
}

/* Borrowed pointer to an evaluated array's data of the requested dtype. */
template <typename Element>
const Element* evaluated_data(const mlx_array arr, mx::Dtype dtype, const char* c_function) {
  try {
    const mx::array& array = held<mx::array>(arr, c_function);
    if (array.dtype() != dtype) {
      throw std::invalid_argument(
          std::string("[") + c_function + "] the array's dtype does not match");
    }
    if (!array.is_available()) {
      throw std::invalid_argument(
          std::string("[") + c_function + "] the array is not evaluated");
    }
    return array.data<Element>();
  } catch (const std::exception& e) {
    report_exception(e);
  }
  return nullptr;
}

/* Reads a property of a held array; `fallback` (with an error) when empty. */
template <typename Value, typename Read>
Value array_property(const mlx_array arr, const char* c_function, Value fallback, Read read) {
  try {
    return read(held<mx::array>(arr, c_function));
  } catch (const std::exception& e) {
    report_exception(e);
  }
  return fallback;
}

} // namespace

extern "C" size_t mlx_dtype_size(mlx_dtype dtype) {
  try {
    return to_cpp_dtype(dtype).size();
  } catch (const std::exception& e) {
    report_exception(e);
  }
  return 0;
}

extern "C" mlx_array mlx_array_new(void) {
  return mlx_array{nullptr};
}

extern "C" int mlx_array_free(mlx_array arr) {
  return guarded([&] { release<mx::array>(arr); });
}

extern "C" mlx_array mlx_array_new_data(
    const void* data,
    const int* shape,
    int dim,
    mlx_dtype dtype) {
  return guarded_new<mlx_array, mx::array>([&] {
    if (dim < 0 || (dim > 0 && shape == nullptr)) {
      throw std::invalid_argument("[mlx_array_new_data] invalid shape");
    }
    mx::Shape cpp_shape(shape, shape + dim);
    mx::Dtype cpp_dtype = to_cpp_dtype(dtype);
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
    throw std::invalid_argument("[mlx_array_new_data] unknown dtype value");
  });
}

extern "C" int mlx_array_set(mlx_array* arr, const mlx_array src) {
  return guarded([&] {
    assign(arr, held<mx::array>(src, "mlx_array_set"), "mlx_array_set");
  });
}

extern "C" size_t mlx_array_itemsize(const mlx_array arr) {
  return array_property<size_t>(arr, "mlx_array_itemsize", 0,
      [](const mx::array& a) { return a.itemsize(); });
}

extern "C" size_t mlx_array_size(const mlx_array arr) {
  return array_property<size_t>(arr, "mlx_array_size", 0,
      [](const mx::array& a) { return a.size(); });
}

extern "C" size_t mlx_array_nbytes(const mlx_array arr) {
  return array_property<size_t>(arr, "mlx_array_nbytes", 0,
      [](const mx::array& a) { return a.nbytes(); });
}

extern "C" size_t mlx_array_ndim(const mlx_array arr) {
  return array_property<size_t>(arr, "mlx_array_ndim", 0,
      [](const mx::array& a) { return a.ndim(); });
}

extern "C" const int* mlx_array_shape(const mlx_array arr) {
  return array_property<const int*>(arr, "mlx_array_shape", nullptr,
      [](const mx::array& a) { return a.shape().data(); });
}

extern "C" int mlx_array_dim(const mlx_array arr, int dim) {
  return array_property<int>(arr, "mlx_array_dim", 0,
      [dim](const mx::array& a) { return a.shape(dim); });
}

extern "C" mlx_dtype mlx_array_dtype(const mlx_array arr) {
  return array_property<mlx_dtype>(arr, "mlx_array_dtype", MLX_BOOL,
      [](const mx::array& a) { return to_c_dtype(a.dtype()); });
}

extern "C" int mlx_array_eval(mlx_array arr) {
  return guarded([&] { held<mx::array>(arr, "mlx_array_eval").eval(); });
}

#define MLX_C_DATA_ACCESSOR(NAME, ELEMENT, DTYPE)                         \
  extern "C" const ELEMENT* mlx_array_data_##NAME(const mlx_array arr) {  \
    return evaluated_data<ELEMENT>(arr, DTYPE, "mlx_array_data_" #NAME);  \
  }

MLX_C_DATA_ACCESSOR(bool, bool, mx::bool_)
MLX_C_DATA_ACCESSOR(uint8, uint8_t, mx::uint8)
MLX_C_DATA_ACCESSOR(uint16, uint16_t, mx::uint16)
MLX_C_DATA_ACCESSOR(uint32, uint32_t, mx::uint32)
MLX_C_DATA_ACCESSOR(uint64, uint64_t, mx::uint64)
MLX_C_DATA_ACCESSOR(int8, int8_t, mx::int8)
MLX_C_DATA_ACCESSOR(int16, int16_t, mx::int16)
MLX_C_DATA_ACCESSOR(int32, int32_t, mx::int32)
MLX_C_DATA_ACCESSOR(int64, int64_t, mx::int64)
MLX_C_DATA_ACCESSOR(float32, float, mx::float32)
MLX_C_DATA_ACCESSOR(float64, double, mx::float64)
