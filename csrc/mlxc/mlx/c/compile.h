/* Graph compilation (upstream mlx-c v0.6.0 names and signatures).
 *
 * Compiling only wraps: MLX traces the closure at the first CALL of the
 * compiled closure, and again whenever its cache misses (a new dtype or
 * ndim of an input, a new thread, a new default stream; any shape change
 * unless shapeless). Compiled closures own a cache entry that is erased when
 * the last copy of the compiled closure is freed.
 */
#ifndef MLX_COMPILE_H
#define MLX_COMPILE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "mlx/c/closure.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Sets `*res` to the compiled form of `fun`. With `shapeless`, one trace
 * serves every shape of the same ranks and dtypes. */
int mlx_compile(mlx_closure* res, const mlx_closure fun, bool shapeless);

/* Like mlx_compile, with the cache id and the constants chosen by the
 * caller. Two compiled closures with one id share one cache entry. */
int mlx_detail_compile(
    mlx_closure* res,
    const mlx_closure fun,
    uintptr_t fun_id,
    bool shapeless,
    const uint64_t* constants,
    size_t num_constants);

/* Drops the CALLING THREAD's cache entry for `fun_id`. MLX's compile
 * caches are per thread: entries other threads traced stay until those
 * threads erase them or exit. */
int mlx_detail_compile_erase(uintptr_t fun_id);

/* Drops every entry of the calling thread's compile cache. */
int mlx_detail_compile_clear_cache(void);

int mlx_disable_compile(void);
int mlx_enable_compile(void);

#ifdef __cplusplus
}
#endif

#endif
