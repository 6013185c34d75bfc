/* mlx_closure over std::function, calling back into C; behaves as
 * upstream's closure.cpp. */
#include <memory>

#include "mlx/c/closure.h"
#include "mlx/c/private/mlx.h"

using namespace bundled_mlx_c;

namespace {

/* A vector handle freed when it goes out of scope, on every path. */
struct OwnedVectorHandle {
  mlx_vector_array handle{nullptr};
  ~OwnedVectorHandle() { free_object(handle); }
};

/* Calls `call_c_function(&result, input)` with handles the closure owns:
 * a fresh input vector (the C function must not free it) and an empty
 * result handle the C function fills. As upstream, a non-zero status throws,
 * and so does a result the C function left empty. */
template <typename CallCFunction>
ArrayVector call_into_c(const ArrayVector& inputs, CallCFunction call_c_function) {
  OwnedVectorHandle input{new_handle<mlx_vector_array>(inputs)};
  OwnedVectorHandle result;
  const int status = call_c_function(&result.handle, input.handle);
  if (status != 0) {
    throw std::runtime_error(
        "[mlx_closure] the closure's C function returned " + std::to_string(status) +
        " (non-zero)");
  }
  return std::move(object_of(result.handle));
}

} // namespace

extern "C" mlx_closure mlx_closure_new(void) {
  return mlx_closure{nullptr};
}

extern "C" int mlx_closure_free(mlx_closure cls) {
  return free_handle(cls);
}

/* Upstream wraps a NULL `fun` and crashes when the closure is called; here
 * it is a reported error and an empty handle. */
extern "C" mlx_closure mlx_closure_new_func(
    int (*fun)(mlx_vector_array*, const mlx_vector_array)) {
  return value_or(mlx_closure{nullptr}, [&] {
    if (fun == nullptr) {
      throw std::invalid_argument("[mlx_closure_new_func] expected a non-NULL function");
    }
    return new_handle<mlx_closure>([fun](const ArrayVector& inputs) {
      return call_into_c(inputs, [fun](mlx_vector_array* result, mlx_vector_array input) {
        return fun(result, input);
      });
    });
  });
}

extern "C" mlx_closure mlx_closure_new_func_payload(
    int (*fun)(mlx_vector_array*, const mlx_vector_array, void*),
    void* payload,
    void (*dtor)(void*)) {
  return value_or(mlx_closure{nullptr}, [&] {
    if (fun == nullptr) {
      throw std::invalid_argument("[mlx_closure_new_func_payload] expected a non-NULL function");
    }
    /* Every copy of the std::function (MLX's compiled wrappers keep some)
     * shares this owner; `dtor`, when given, runs when the last copy is
     * destroyed. */
    std::shared_ptr<void> shared_payload = dtor != nullptr
        ? std::shared_ptr<void>(payload, dtor)
        : std::shared_ptr<void>(payload, [](void*) {});
    return new_handle<mlx_closure>([fun, shared_payload](const ArrayVector& inputs) {
      return call_into_c(inputs,
          [fun, &shared_payload](mlx_vector_array* result, mlx_vector_array input) {
            return fun(result, input, shared_payload.get());
          });
    });
  });
}

extern "C" int mlx_closure_apply(
    mlx_vector_array* res,
    mlx_closure cls,
    const mlx_vector_array input) {
  return status_of([&] { store(res, object_of(cls)(object_of(input))); });
}
