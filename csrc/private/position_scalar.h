/* The one holder of a position's int32 scalar (internal;
 * position_scalar.c): a RoPE offset given as an int and a KV-cache write
 * row become graph inputs as int32 scalars, what mx.fast.rope makes of an
 * int. Every layer of a decode step passes the same position, so the last
 * position's scalar is kept, process-wide, and reused while the position
 * stays the same: one array, one data allocation per step, shared by the
 * offset and the row when they are the same number (mlx-lm's KVCache).
 *
 * The bridge (csrc/interop) takes the scalars of int offsets here too,
 * through the cffi module (build_ffi.py declares this header to it), so
 * no other copy of a position's scalar is held anywhere.
 */
#ifndef MLX_DUALNORM_PRIVATE_POSITION_SCALAR_H
#define MLX_DUALNORM_PRIVATE_POSITION_SCALAR_H

#include "mlx/c/array.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Sets `*res` (mlx_array_set: a new handle the caller owns and frees when
 * `*res` is empty, else the caller's handle reassigned) to the int32
 * scalar of `position`: the one held while the position is the last one
 * asked for, else a new one, held from then on. The caller's handle keeps
 * its array alive whatever is asked next, and graphs holding an older
 * scalar keep theirs. Thread-safe. 0 on success; non-zero with the reason
 * sent to mlx_error. */
int dualnorm_position_scalar(mlx_array* res, int position);

#ifdef __cplusplus
}
#endif

#endif
