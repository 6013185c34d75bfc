/* mlx_closure over std::function, calling back into C. */
#include <memory>

#include "mlx/c/closure.h"
#include "mlx/c/private/mlx.h"

namespace {

using namespace mlx_c_private;
using ArrayVector = std::vector<mx::array>;

/* Calls `call_c_function(&result, input)` with handles the closure owns:
 * the input vector is freed after the call, the result is moved out and
 * freed, on every path. */
template <typename CallCFunction>
ArrayVector call_into_c(const ArrayVector& inputs, CallCFunction call_c_function) {
  mlx_vector_array input{new ArrayVector(inputs)};
  mlx_vector_array result{nullptr};
  int status = 1;
  try {
    status = call_c_function(&result, input);
  } catch (...) {
    release<ArrayVector>(input);
    release<ArrayVector>(result);
    throw;
  }
  release<ArrayVector>(input);
  if (status != 0) {
    release<ArrayVector>(result);
    throw std::runtime_error(
        "[mlx_closure_apply] the closure's C function returned status " +
        std::to_string(status));
  }
  ArrayVector outputs;
  if (result.ctx != nullptr) {
    outputs = std::move(*static_cast<ArrayVector*>(result.ctx));
  }
  release<ArrayVector>(result);
  return outputs;
}

} // namespace

extern "C" mlx_closure mlx_closure_new(void) {
  return mlx_closure{nullptr};
}

extern "C" int mlx_closure_free(mlx_closure cls) {
  return guarded([&] { release<ArrayFunction>(cls); });
}

extern "C" mlx_closure mlx_closure_new_func(
    int (*fun)(mlx_vector_array*, const mlx_vector_array)) {
  return guarded_new<mlx_closure, ArrayFunction>([&] {
    if (fun == nullptr) {
      throw std::invalid_argument("[mlx_closure_new_func] NULL function");
    }
    return ArrayFunction([fun](const ArrayVector& inputs) {
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
  return guarded_new<mlx_closure, ArrayFunction>([&] {
    if (fun == nullptr) {
      throw std::invalid_argument("[mlx_closure_new_func_payload] NULL function");
    }
    /* Every copy of the std::function (MLX's compiled wrappers keep some)
     * shares this owner; the dtor runs when the last copy is destroyed. */
    std::shared_ptr<void> shared_payload(payload, [dtor](void* owned) {
      if (dtor != nullptr) {
        dtor(owned);
      }
    });
    return ArrayFunction([fun, shared_payload](const ArrayVector& inputs) {
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
  return guarded([&] {
    const char* c_function = "mlx_closure_apply";
    const ArrayFunction& function = held<ArrayFunction>(cls, c_function);
    assign(res, function(held<ArrayVector>(input, c_function)), c_function);
  });
}
