/* mlx_compile and friends over mlx::core::compile, behaving as upstream's
 * compile.cpp (with MLX 0.32's per-thread compile-cache handle). */
#include "mlx/compile.h"
#include "mlx/compile_impl.h"

#include "mlx/c/compile.h"
#include "mlx/c/private/mlx.h"

using namespace bundled_mlx_c;

extern "C" int mlx_compile(mlx_closure* res, const mlx_closure fun, bool shapeless) {
  return status_of([&] { store(res, ArrayFunction(mx::compile(object_of(fun), shapeless))); });
}

/* Upstream reads `constants` unchecked; NULL with a non-zero count is a
 * reported error here. */
extern "C" int mlx_detail_compile(
    mlx_closure* res,
    const mlx_closure fun,
    uintptr_t fun_id,
    bool shapeless,
    const uint64_t* constants,
    size_t num_constants) {
  return status_of([&] {
    if (num_constants > 0 && constants == nullptr) {
      throw std::invalid_argument("[mlx_detail_compile] expected non-NULL constants");
    }
    store(res,
        ArrayFunction(mx::detail::compile(object_of(fun), fun_id, shapeless,
            std::vector<uint64_t>(constants, constants + num_constants))));
  });
}

extern "C" int mlx_detail_compile_erase(uintptr_t fun_id) {
  return status_of([&] { mx::detail::compile_erase(mx::detail::compile_cache(), fun_id); });
}

extern "C" int mlx_detail_compile_clear_cache(void) {
  return status_of([] { mx::detail::compile_clear_cache(mx::detail::compile_cache()); });
}

extern "C" int mlx_disable_compile(void) {
  return status_of([] { mx::disable_compile(); });
}

extern "C" int mlx_enable_compile(void) {
  return status_of([] { mx::enable_compile(); });
}
