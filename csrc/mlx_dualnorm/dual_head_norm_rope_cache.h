/* The norm + RoPE of a full-attention layer together with its KV-cache
 * write: the q/k prework and the cache update of one decode step in one
 * call.
 *
 * For queries (B, L, Hq, D), keys (B, L, Hk, D), values (B, L, Hk, Dv) and
 * the cache's buffers key_cache (B, Hk, C, D) and value_cache
 * (B, Hk, Cv, Dv), one call returns
 *
 *   rope(rms_norm(queries, query_scale_weight, eps).transpose(0, 2, 1, 3))
 *   key_cache   with rows [w, w + L) of axis 2 set to
 *               rope(rms_norm(keys, key_scale_weight, eps).transpose(0, 2, 1, 3))
 *   value_cache with rows [w, w + L) of axis 2 set to values.transpose(0, 2, 1, 3)
 *
 * where w is `write_offset`: what mlx-lm's KVCache.update_and_fetch writes
 * (`keys[..., w:w+L, :] = ...`), every element of both buffers with the
 * same bits. The norm + RoPE are the object's (dual_head_norm_rope.h),
 * including its rule for weights of H * D elements (each token's heads
 * normalized together, before the transpose). In
 * the compiled graph the writes are MLX slice updates whose position is a
 * graph input, so a decode step at a new position replays one trace; in
 * FUSED mode one kernel launch does the norms, the RoPEs, the transposes
 * and both writes (MLX's slice updates follow the launch only for buffers
 * or values of another dtype than the queries, which the write casts).
 *
 * The buffers are inputs, never modified: the results are new lazy arrays.
 * A result takes the buffer's memory instead of a copy when, at
 * evaluation, the buffer has no other reference (the caller replaced its
 * own reference with the result, as `cache.keys = ...` does): MLX's
 * donation, or in FUSED mode the kernel's own check of the same facts; a
 * caller that still holds the buffer keeps seeing its old contents, and
 * the result is then a copy.
 */
#ifndef MLX_DUALNORM_DUAL_HEAD_NORM_ROPE_CACHE_H
#define MLX_DUALNORM_DUAL_HEAD_NORM_ROPE_CACHE_H

#include "dual_head_norm_common.h"
#include "dual_head_norm_rope.h"
#include "mlx/c/mlx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Normalizes, transposes and rotates queries and keys as
 * mlx_dualnorm_dual_head_norm_rope_apply_with_freqs does (same checks, same
 * routes; `freqs` an empty handle for an object with a base, the table for
 * one made with_freqs),
 * and writes the rotated keys and the transposed values into the buffers at
 * rows [write_offset, write_offset + L). Checked on every call: values of
 * rank 4 with the keys' batch, length and heads; buffers of rank 4 with
 * the batch and heads of the keys, the key buffer with their head width,
 * the value buffer with the values'; 0 <= write_offset and
 * write_offset + L within each buffer's axis 2. Bad input is
 * MLX_DUALNORM_INVALID_ARGUMENT, the buffers untouched.
 *
 * Inputs are BORROWED: never freed here, and only referenced by the lazy
 * outputs. On success `*res` (allocated when empty, owned by the caller,
 * who frees the vector) holds exactly three new lazy arrays, in this
 * order: the rotated queries (B, Hq, L, D), the key buffer written, the
 * value buffer written (each the shape and dtype of its input buffer; an
 * update of another dtype is cast to the buffer's, as MLX's slice update
 * does). With `fetch` it holds five: those three, then rows
 * [0, write_offset + L) of the key buffer written and of the value buffer
 * written (what KVCache.update_and_fetch returns for attention: views of
 * the written buffers in FUSED mode, MLX slices otherwise, the same
 * values). On failure `*res` is left as it was. Thread-safe.
 *
 * The same call as mlx_dualnorm_dual_head_norm_rope_apply_call
 * (dual_head_norm_rope.h) with the arrays as its mlx_dualnorm_rope_inputs
 * and the rest as its mlx_dualnorm_cache_write; kept for the callers of
 * this signature. */
int mlx_dualnorm_dual_head_norm_rope_apply_with_cache(
    mlx_vector_array* res, mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
    const mlx_array queries, const mlx_array keys, const mlx_array values,
    const mlx_array query_scale_weight, const mlx_array key_scale_weight,
    const mlx_array rope_offset, const mlx_array freqs, const mlx_array key_cache,
    const mlx_array value_cache, int write_offset, bool fetch, mlx_dualnorm_error* error);

#ifdef __cplusplus
}
#endif

#endif
