/* mlx_compile and friends over mlx::core::compile. */
#include "mlx/compile.h"
#include "mlx/compile_impl.h"

#include "mlx/c/compile.h"
#include "mlx/c/private/mlx.h"

using namespace mlx_c_private;

extern "C" int mlx_compile(mlx_closure* res, const mlx_closure fun, bool shapeless) {
  return guarded([&] {
    const char* c_function = "mlx_compile";
    assign(res, ArrayFunction(mx::compile(held<ArrayFunction>(fun, c_function), shapeless)),
        c_function);
  });
}

extern "C" int mlx_detail_compile(
    mlx_closure* res,
    const mlx_closure fun,
    uintptr_t fun_id,
    bool shapeless,
    const uint64_t* constants,
    size_t num_constants) {
  return guarded([&] {
    const char* c_function = "mlx_detail_compile";
    if (num_constants > 0 && constants == nullptr) {
      throw std::invalid_argument("[mlx_detail_compile] NULL constants");
    }
    std::vector<uint64_t> constant_values(constants, constants + num_constants);
    assign(res,
        ArrayFunction(mx::detail::compile(held<ArrayFunction>(fun, c_function),
            fun_id, shapeless, std::move(constant_values))),
        c_function);
  });
}

extern "C" int mlx_detail_compile_erase(uintptr_t fun_id) {
  return guarded([&] { mx::detail::compile_erase(mx::detail::compile_cache(), fun_id); });
}

extern "C" int mlx_detail_compile_clear_cache(void) {
  return guarded([] { mx::detail::compile_clear_cache(mx::detail::compile_cache()); });
}

extern "C" int mlx_disable_compile(void) {
  return guarded([] { mx::disable_compile(); });
}

extern "C" int mlx_enable_compile(void) {
  return guarded([] { mx::enable_compile(); });
}
