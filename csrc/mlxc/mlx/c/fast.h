/* Fused MLX operations (upstream mlx-c v0.6.0 names and signatures). */
#ifndef MLX_FAST_H
#define MLX_FAST_H

#include "mlx/c/array.h"
#include "mlx/c/optional.h"
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

/* Sets `*res` to the (lazy) rotary positional encoding of `x` (at least 3
 * dimensions, (B, *, T, D)): the first `dims` features of each position
 * rotated, pairs taken consecutively when `traditional`, else half `dims`
 * apart; features past `dims` copied. Angles are `scale * (offset + t)`
 * times `base`'s inverse frequencies, or `freqs`' when `base` is absent
 * (exactly one of the two must be given; an empty `freqs` handle means
 * none). `offset` is an integer array: a scalar, or one value per batch
 * entry. */
int mlx_fast_rope_dynamic(mlx_array* res, const mlx_array x, int dims, bool traditional,
                          mlx_optional_float base, float scale, const mlx_array offset,
                          const mlx_array freqs /* may be null */, const mlx_stream s);

#ifdef __cplusplus
}
#endif

#endif
