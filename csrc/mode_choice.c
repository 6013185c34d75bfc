/* Which mode an object runs in, and which calls its fused kernel takes
 * (see private/mode_choice.h). */
#include "private/mode_choice.h"

#include "private/call_errors.h"

#include <limits.h>
#include <stdatomic.h>
#include <stddef.h>

void dualnorm_register_fused_kernel(dualnorm_fused_registration* registration,
                                    const mlx_dualnorm_fused_kernel* kernel) {
  atomic_store(&registration->kernel, kernel);
}

bool dualnorm_fused_kernel_available(dualnorm_fused_registration* registration) {
  const mlx_dualnorm_fused_kernel* kernel = atomic_load(&registration->kernel);
  return kernel != NULL && kernel->available();
}

int dualnorm_resolve_mode(mlx_dualnorm_mode requested, dualnorm_fused_registration* registration,
                          const char* operation, mlx_dualnorm_mode* resolved,
                          const mlx_dualnorm_fused_kernel** fused_kernel,
                          mlx_dualnorm_error* error) {
  /* Read once: a registration changing meanwhile cannot split the choice. */
  const mlx_dualnorm_fused_kernel* kernel = atomic_load(&registration->kernel);
  bool fused_available = kernel != NULL && kernel->available();
  *fused_kernel = NULL;
  switch (requested) {
    case MLX_DUALNORM_MODE_COMPOSED:
    case MLX_DUALNORM_MODE_COMPILED:
      *resolved = requested;
      return MLX_DUALNORM_OK;
    case MLX_DUALNORM_MODE_AUTO:
      /* A kernel that fails to compile leaves AUTO on the compiled graph. */
      *resolved = fused_available && kernel->prepare() == 0 ? MLX_DUALNORM_MODE_FUSED
                                                            : MLX_DUALNORM_MODE_COMPILED;
      dualnorm_begin_call(); /* forget a failed preparation's message */
      *fused_kernel = *resolved == MLX_DUALNORM_MODE_FUSED ? kernel : NULL;
      return MLX_DUALNORM_OK;
    case MLX_DUALNORM_MODE_FUSED:
      if (!fused_available) {
        return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation,
                                  "mode 'fused' needs a build with the fused mode and MLX's "
                                  "CUDA backend with a GPU; use mode 'auto' or 'compiled'");
      }
      if (kernel->prepare() != 0) {
        return dualnorm_fail_in_mlx(error, operation);
      }
      *resolved = MLX_DUALNORM_MODE_FUSED;
      *fused_kernel = kernel;
      return MLX_DUALNORM_OK;
  }
  return dualnorm_fail_with(error, MLX_DUALNORM_INVALID_ARGUMENT, operation, "unknown mode %d",
                            (int)requested);
}

bool dualnorm_fused_kernel_fits(const mlx_dualnorm_fused_kernel* kernel,
                                const dual_head_norm_call* call) {
  const head_norm_input* queries = &call->queries;
  const head_norm_input* keys = &call->keys;
  mlx_dtype dtype = queries->dtype;
  return dualnorm_is_fused_dtype(dtype) && queries->weight_dtype == dtype &&
         keys->dtype == dtype && keys->weight_dtype == dtype && queries->size > 0 &&
         keys->size > 0 && queries->rank <= (size_t)kernel->max_rank &&
         keys->rank <= (size_t)kernel->max_rank && queries->width <= kernel->max_width &&
         keys->width <= kernel->max_width && queries->rows + keys->rows <= (size_t)INT_MAX;
}
