/* mlx_compile and friends over mlx::core::compile. */
#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "mlx/compile.h"
#include "mlx/compile_impl.h"

#include "mlx/c/compile.h"
#include "mlx/c/private/mlx.h"

using namespace mlx_c_private;

namespace {

using CompileCacheWeakPtr = mx::detail::CompileCacheWeakPtr;

/* MLX keeps one compile cache per thread, and compile_erase drops an entry
 * from ONE cache. A closure from mlx_detail_compile traced on several
 * threads leaves an entry (its traced tape) in each of their caches, so
 * erasing only the erasing thread's would leak the others until those
 * threads exit. This registry remembers, per id, every cache a trace went
 * into; mlx_detail_compile_erase empties them all (MLX's compile_erase
 * takes that cache's own lock). Caches of exited threads are skipped. */
class TracingCaches {
 public:
  void remember(std::uintptr_t fun_id) {
    CompileCacheWeakPtr cache = mx::detail::compile_cache();
    std::lock_guard<std::mutex> lock(mutex_);
    auto& caches = caches_[fun_id];
    auto same_cache = [&cache](const CompileCacheWeakPtr& known) {
      return !known.owner_before(cache) && !cache.owner_before(known);
    };
    if (std::any_of(caches.begin(), caches.end(), same_cache)) {
      return;
    }
    caches.erase(std::remove_if(caches.begin(), caches.end(),
                                [](const CompileCacheWeakPtr& known) { return known.expired(); }),
                 caches.end());
    caches.push_back(std::move(cache));
  }

  std::vector<CompileCacheWeakPtr> take(std::uintptr_t fun_id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = caches_.find(fun_id);
    if (found == caches_.end()) {
      return {};
    }
    std::vector<CompileCacheWeakPtr> caches = std::move(found->second);
    caches_.erase(found);
    return caches;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<std::uintptr_t, std::vector<CompileCacheWeakPtr>> caches_;
};

/* Never destroyed: erases may run during other libraries' teardown. */
TracingCaches& tracing_caches() {
  static TracingCaches* registry = new TracingCaches();
  return *registry;
}

} // namespace

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
    // MLX calls the function it compiles only to trace, on the tracing
    // thread: that is when (and where) a cache entry appears. Replays pay
    // nothing for the bookkeeping.
    ArrayFunction traced_function =
        [function = held<ArrayFunction>(fun, c_function), fun_id](
            const std::vector<mx::array>& inputs) {
          tracing_caches().remember(fun_id);
          return function(inputs);
        };
    assign(res,
        ArrayFunction(mx::detail::compile(
            std::move(traced_function), fun_id, shapeless, std::move(constant_values))),
        c_function);
  });
}

extern "C" int mlx_detail_compile_erase(uintptr_t fun_id) {
  return guarded([&] {
    mx::detail::compile_erase(mx::detail::compile_cache(), fun_id);
    for (const CompileCacheWeakPtr& cache : tracing_caches().take(fun_id)) {
      mx::detail::compile_erase(cache, fun_id);
    }
  });
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
