/* MLX array operations (upstream mlx-c v0.6.0 names and signatures). The
 * subset carries the ones the package builds graphs with. */
#ifndef MLX_OPS_H
#define MLX_OPS_H

#include <stddef.h>

#include "mlx/c/array.h"
#include "mlx/c/stream.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Sets `*res` to a (lazy) view of `a` with its axes permuted: result axis i
 * is axis axes[i] of `a`. `axes_num` must be `a`'s rank; negative axes
 * count from the end, as in MLX. */
int mlx_transpose_axes(
    mlx_array* res,
    const mlx_array a,
    const int* axes,
    size_t axes_num,
    const mlx_stream s);

#ifdef __cplusplus
}
#endif

#endif
