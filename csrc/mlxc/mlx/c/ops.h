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

/* Sets `*res` to a (lazy) array of `a`'s elements in row-major order with
 * the `shape_num` extents of `shape` (one may be -1: inferred), as
 * mlx::core::reshape; a view of `a`'s memory where MLX can make one. */
int mlx_reshape(
    mlx_array* res,
    const mlx_array a,
    const int* shape,
    size_t shape_num,
    const mlx_stream s);

/* Sets `*res` to `a` converted to `dtype` (lazy; `a` itself when it already
 * has that dtype), as mlx::core::astype. */
int mlx_astype(
    mlx_array* res,
    const mlx_array a,
    mlx_dtype dtype,
    const mlx_stream s);

/* Sets `*res` to a (lazy) copy of `src` whose slice [start, stop) with
 * `strides` is multiplied elementwise by `update` (broadcast to the slice's
 * shape): MLX's SliceUpdate with the Prod reduction, what Python's
 * `x.at[...].multiply(v)` builds for a slice index. The three lists have
 * `src`'s rank entries each. */
int mlx_slice_update_prod(
    mlx_array* res,
    const mlx_array src,
    const mlx_array update,
    const int* start,
    size_t start_num,
    const int* stop,
    size_t stop_num,
    const int* strides,
    size_t strides_num,
    const mlx_stream s);

/* Sets `*res` to the (lazy) slice [start, stop) of `a` with `strides`, one
 * of each per axis of `a`: MLX's Slice, what `a[..., :b, :]` makes in
 * Python (a view of `a`'s memory once evaluated). */
int mlx_slice(mlx_array* res, const mlx_array a, const int* start, size_t start_num,
    const int* stop, size_t stop_num, const int* strides, size_t strides_num,
    const mlx_stream s);

/* Sets `*res` to `src` with `update` (cast to `src`'s dtype) written over
 * the slice [start, stop) with `strides` (one of each per axis of `src`):
 * MLX's SliceUpdate, what `src[..., a:b, :] = update` makes in Python. */
int mlx_slice_update(mlx_array* res, const mlx_array src, const mlx_array update,
    const int* start, size_t start_num, const int* stop, size_t stop_num, const int* strides,
    size_t strides_num, const mlx_stream s);

/* Sets `*res` to `src` with the block of `update` written at `start` along
 * `axes` (the other axes from 0): `start` is an integer array with one
 * element per axis, read when the graph runs, so one graph serves every
 * position. `update` is cast to `src`'s dtype, as in MLX. The position is
 * not bounds-checked by MLX: the caller keeps the block inside `src`. */
int mlx_slice_update_dynamic(mlx_array* res, const mlx_array src, const mlx_array update,
    const mlx_array start, const int* axes, size_t axes_num, const mlx_stream s);

#ifdef __cplusplus
}
#endif

#endif
