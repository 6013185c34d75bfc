/* Which mode an object runs in (internal): both composites resolve the
 * requested mode the same way, given what their fused backend can do. */
#ifndef MLX_DUALNORM_PRIVATE_MODE_CHOICE_H
#define MLX_DUALNORM_PRIVATE_MODE_CHOICE_H

#include <stdbool.h>

#include "dual_head_norm_common.h"

/* Resolves `requested` into `*resolved` (never AUTO). AUTO takes FUSED where
 * `fused_available` and `prepare_fused()` (compiling the kernel) succeeds,
 * else COMPILED; a failed preparation's message is forgotten. FUSED fails as
 * an invalid argument of `operation` where the fused mode is not available,
 * and with MLX's message where its kernel does not compile.
 * `prepare_fused` may be NULL when `fused_available` is false. */
int dualnorm_resolve_mode(mlx_dualnorm_mode requested, bool fused_available,
                          int (*prepare_fused)(void), const char* operation,
                          mlx_dualnorm_mode* resolved, mlx_dualnorm_error* error);

#endif
