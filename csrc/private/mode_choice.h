/* Which mode an object runs in, and which calls its fused kernel takes
 * (internal). Both composites keep their registered fused backend, resolve
 * the requested mode and decide a call's route the same way; only the
 * launch and the operation's own conditions differ. */
#ifndef MLX_DUALNORM_PRIVATE_MODE_CHOICE_H
#define MLX_DUALNORM_PRIVATE_MODE_CHOICE_H

#include <stdbool.h>

#include "mlx_dualnorm/dual_head_norm_common.h"
#include "private/head_norm_input.h"

/* One composite's registered fused backend, process-wide (static storage,
 * zero-initialized: nothing registered). It holds the table's `kernel`
 * member, its first, so the composite converts the pointer back to its own
 * table type (C11 6.7.2.1: a pointer to a struct's first member and to the
 * struct convert to each other). BORROWED: the table outlives every object
 * created while it is registered (the setter's contract). */
typedef struct dualnorm_fused_registration {
  const mlx_dualnorm_fused_kernel* _Atomic kernel;
} dualnorm_fused_registration;

/* Registers `kernel` (NULL unregisters). */
void dualnorm_register_fused_kernel(dualnorm_fused_registration* registration,
                                    const mlx_dualnorm_fused_kernel* kernel);

/* True when a kernel is registered and reports itself available. */
bool dualnorm_fused_kernel_available(dualnorm_fused_registration* registration);

/* Resolves `requested` into `*resolved` (never AUTO) with the registered
 * kernel; `*fused_kernel` is that kernel in FUSED mode, else NULL. AUTO
 * takes FUSED where the kernel is available and its preparation (compiling
 * it) succeeds, else COMPILED; a failed preparation's message is
 * forgotten. FUSED fails as an invalid argument of `operation` where the
 * fused mode is not available, and with MLX's message where its kernel
 * does not compile. */
int dualnorm_resolve_mode(mlx_dualnorm_mode requested, dualnorm_fused_registration* registration,
                          const char* operation, mlx_dualnorm_mode* resolved,
                          const mlx_dualnorm_fused_kernel** fused_kernel,
                          mlx_dualnorm_error* error);

/* Whether `kernel` computes exactly what the composed calls would, as far
 * as the inputs both composites share tell: one fused dtype for every
 * input and weight, rows on both sides, ranks and widths within the
 * kernel's limits, rows that fit its 32-bit row index. The caller adds its
 * own conditions, then asks whether the default device is the GPU
 * (dualnorm_default_device_is_gpu), last, since that asks MLX. */
bool dualnorm_fused_kernel_fits(const mlx_dualnorm_fused_kernel* kernel,
                                const dual_head_norm_call* call);

#endif
