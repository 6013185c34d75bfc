/* Private C++ side of the mlx-c subset: how handles map to MLX objects.
 *
 * Every handle is `{ void* ctx; }` with ctx a heap C++ object that the
 * handle owns (see each public header for which). These helpers are the only
 * place that casts ctx, so ownership rules live in one file:
 *   - held()    borrows the object behind a handle, failing on an empty one;
 *   - assign()  stores a value into an out-parameter handle, allocating when
 *               it is empty and overwriting (not leaking) when it is not;
 *   - release() deletes the object and leaves the handle empty.
 * guarded()/guarded_new() are the C boundary: no exception crosses it.
 */
#ifndef MLX_C_PRIVATE_MLX_H
#define MLX_C_PRIVATE_MLX_H

#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "mlx/array.h"
#include "mlx/device.h"
#include "mlx/stream.h"

#include "mlx/c/error.h"

namespace mlx_c_private {

namespace mx = mlx::core;

/* The C++ object behind an mlx_closure. */
using ArrayFunction =
    std::function<std::vector<mx::array>(const std::vector<mx::array>&)>;

/* Hands `e.what()` to the installed error handler. */
void report_exception(const std::exception& e);

template <typename Object, typename Handle>
Object& held(const Handle& handle, const char* c_function) {
  if (handle.ctx == nullptr) {
    throw std::invalid_argument(
        std::string("[") + c_function + "] received an empty handle");
  }
  return *static_cast<Object*>(handle.ctx);
}

template <typename Object, typename Handle>
void assign(Handle* handle, Object value, const char* c_function) {
  if (handle == nullptr) {
    throw std::invalid_argument(
        std::string("[") + c_function + "] received a NULL result pointer");
  }
  if (handle->ctx != nullptr) {
    *static_cast<Object*>(handle->ctx) = std::move(value);
  } else {
    handle->ctx = new Object(std::move(value));
  }
}

template <typename Object, typename Handle>
void release(Handle& handle) {
  delete static_cast<Object*>(handle.ctx);
  handle.ctx = nullptr;
}

/* Runs `body`; 0 on success, 1 with the message reported on any throw. */
template <typename Body>
int guarded(Body&& body) {
  try {
    body();
    return 0;
  } catch (const std::exception& e) {
    report_exception(e);
  } catch (...) {
    report_exception(std::runtime_error("unknown C++ exception"));
  }
  return 1;
}

/* Runs `body` returning a heap Object; an empty Handle on any throw. */
template <typename Handle, typename Object, typename Body>
Handle guarded_new(Body&& body) {
  try {
    return Handle{new Object(body())};
  } catch (const std::exception& e) {
    report_exception(e);
  } catch (...) {
    report_exception(std::runtime_error("unknown C++ exception"));
  }
  return Handle{nullptr};
}

} // namespace mlx_c_private

#endif
