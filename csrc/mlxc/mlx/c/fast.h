/* Fused MLX operations (upstream mlx-c v0.6.0 names and signatures). */
#ifndef MLX_FAST_H
#define MLX_FAST_H

#include "mlx/c/array.h"
#include "mlx/c/stream.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Sets `*res` to the (lazy) RMS normalization of `x` over its last axis,
 * times `weight`; an empty `weight` handle means no weight. `eps` becomes
 * part of the graph node. */
int mlx_fast_rms_norm(
    mlx_array* res,
    const mlx_array x,
    const mlx_array weight,
    float eps,
    const mlx_stream s);

#ifdef __cplusplus
}
#endif

#endif
