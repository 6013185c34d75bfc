/* Private C++ side of the bundled mlx-c subset: how handles map to MLX
 * objects. Upstream keeps the same knowledge in mlx/c/private/ and does not
 * install it, so nothing outside csrc/mlxc may include this header: code
 * that did would not build against the real mlx-c.
 *
 * Every handle is `{ void* ctx; }` with ctx a heap C++ object the handle
 * owns (HandleTraits says which). These helpers are the only place that
 * casts ctx, and they behave as upstream's per-type helpers do:
 *   - object_of()  borrows the object; an empty handle throws
 *                  "expected a non-empty <handle type>";
 *   - new_handle() wraps a value in a new handle;
 *   - store()      sets an out-parameter: overwrites the object of a
 *                  non-empty handle, allocates one for an empty handle;
 *   - free_object() deletes the object (an empty handle is a no-op);
 *   - free_handle() is every mlx_*_free: free_object(), then 0.
 * The C functions run each C++ call through status_of() or value_or(),
 * which report what MLX threw through mlx_error (error.h) and return 1 or a
 * fallback (0, NULL, an empty handle), as upstream's try/catch does.
 *
 * Where upstream's behaviour is undefined (it dereferences or indexes
 * unchecked), the subset reports an error instead: a NULL out-parameter, a
 * NULL data/shape/function/constants/axes pointer with a non-zero count, a
 * negative extent, a dtype outside mlx_dtype, reading the data of an array
 * that is not evaluated. A mutex guards the error handler slot.
 */
#ifndef BUNDLED_MLX_C_PRIVATE_H
#define BUNDLED_MLX_C_PRIVATE_H

#include <exception>
#include <functional>
#include <source_location>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "mlx/array.h"
#include "mlx/device.h"
#include "mlx/stream.h"

#include "mlx/c/array.h"
#include "mlx/c/closure.h"
#include "mlx/c/device.h"
#include "mlx/c/error.h"
#include "mlx/c/stream.h"
#include "mlx/c/vector.h"

namespace bundled_mlx_c {

namespace mx = mlx::core;

using ArrayVector = std::vector<mx::array>;

/* MLX's dtype of an mlx_dtype (array.cpp); an unknown value throws. */
mx::Dtype to_cpp_dtype(mlx_dtype dtype);

/* The C++ object behind an mlx_closure. */
using ArrayFunction = std::function<ArrayVector(const ArrayVector&)>;

/* Which C++ object each handle type owns, and the handle's C name (used in
 * the empty-handle message, as upstream words it). */
template <typename Handle>
struct HandleTraits;

// clang-format off
template <> struct HandleTraits<mlx_array>        { using Object = mx::array;     static constexpr const char* name = "mlx_array"; };
template <> struct HandleTraits<mlx_vector_array> { using Object = ArrayVector;   static constexpr const char* name = "mlx_vector_array"; };
template <> struct HandleTraits<mlx_closure>      { using Object = ArrayFunction; static constexpr const char* name = "mlx_closure"; };
template <> struct HandleTraits<mlx_device>       { using Object = mx::Device;    static constexpr const char* name = "mlx_device"; };
template <> struct HandleTraits<mlx_stream>       { using Object = mx::Stream;    static constexpr const char* name = "mlx_stream"; };
// clang-format on

template <typename Handle>
using ObjectOf = typename HandleTraits<Handle>::Object;

template <typename Handle>
ObjectOf<Handle>& object_of(Handle handle) {
  if (handle.ctx == nullptr) {
    throw std::runtime_error(
        std::string("expected a non-empty ") + HandleTraits<Handle>::name);
  }
  return *static_cast<ObjectOf<Handle>*>(handle.ctx);
}

template <typename Handle>
Handle new_handle(ObjectOf<Handle> value) {
  return Handle{new ObjectOf<Handle>(std::move(value))};
}

/* Upstream dereferences a NULL out-parameter; here it is a reported error. */
template <typename Handle>
void store(Handle* out, ObjectOf<Handle> value) {
  if (out == nullptr) {
    throw std::invalid_argument(
        std::string("expected a non-NULL ") + HandleTraits<Handle>::name + "*");
  }
  if (out->ctx != nullptr) {
    *static_cast<ObjectOf<Handle>*>(out->ctx) = std::move(value);
  } else {
    out->ctx = new ObjectOf<Handle>(std::move(value));
  }
}

template <typename Handle>
void free_object(Handle handle) {
  delete static_cast<ObjectOf<Handle>*>(handle.ctx);
}

/* Upstream's _free functions cannot fail: they always return 0. */
template <typename Handle>
int free_handle(Handle handle) {
  free_object(handle);
  return 0;
}

/* Reports `error` through mlx_error at `where`: the C function's own file
 * and line, as upstream's per-function catch names them. */
inline void report(const std::exception& error, const std::source_location& where) {
  _mlx_error(where.file_name(), static_cast<int>(where.line()), "%s", error.what());
}

/* For a C function returning a status: runs `body`, returns 0; returns 1
 * when it throws, with what it threw reported. */
template <typename Body>
int status_of(Body body, std::source_location where = std::source_location::current()) {
  try {
    body();
    return 0;
  } catch (const std::exception& error) {
    report(error, where);
    return 1;
  }
}

/* For a C function returning a value: what `body` returns, or `fallback`
 * when it throws, with what it threw reported. */
template <typename Value, typename Body>
Value value_or(
    Value fallback,
    Body body,
    std::source_location where = std::source_location::current()) {
  try {
    return body();
  } catch (const std::exception& error) {
    report(error, where);
    return fallback;
  }
}

} // namespace bundled_mlx_c

#endif
