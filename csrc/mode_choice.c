/* Which mode an object runs in (see mode_choice.h). */
#include "private/mode_choice.h"

#include "private/call_errors.h"

int dualnorm_resolve_mode(mlx_dualnorm_mode requested, bool fused_available,
                          int (*prepare_fused)(void), const char* operation,
                          mlx_dualnorm_mode* resolved, mlx_dualnorm_error* error) {
  switch (requested) {
    case MLX_DUALNORM_MODE_COMPOSED:
    case MLX_DUALNORM_MODE_COMPILED:
      *resolved = requested;
      return MLX_DUALNORM_OK;
    case MLX_DUALNORM_MODE_AUTO:
      /* A kernel that fails to compile leaves AUTO on the compiled graph. */
      *resolved = fused_available && prepare_fused() == 0 ? MLX_DUALNORM_MODE_FUSED
                                                          : MLX_DUALNORM_MODE_COMPILED;
      dualnorm_begin_call(); /* forget a failed preparation's message */
      return MLX_DUALNORM_OK;
    case MLX_DUALNORM_MODE_FUSED:
      if (!fused_available) {
        return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                                  "mode 'fused' needs a build with the fused mode and MLX's "
                                  "CUDA backend with a GPU; use mode 'auto' or 'compiled'");
      }
      if (prepare_fused() != 0) {
        return dualnorm_fail_in_mlx(error, operation);
      }
      *resolved = MLX_DUALNORM_MODE_FUSED;
      return MLX_DUALNORM_OK;
  }
  return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation, "unknown mode %d",
                            (int)requested);
}
