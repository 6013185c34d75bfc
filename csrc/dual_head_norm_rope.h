/* The compiled q/k head RMS normalization followed by rotary position
 * encoding: the whole q/k prework of a full-attention layer (mlx-lm's
 * Qwen3 family) in one call.
 *
 * One call returns, for queries (B, L, Hq, D) and keys (B, L, Hk, D),
 *
 *   rope(rms_norm(queries, query_scale_weight, eps).transpose(0, 2, 1, 3))
 *   rope(rms_norm(keys, key_scale_weight, eps).transpose(0, 2, 1, 3))
 *
 * with `rope` being mlx_fast_rope_dynamic(x, dims, traditional, base,
 * scale, offset, freqs) (frequencies from a base or a table; the first
 * `dims` features optionally scaled first, see
 * mlx_dualnorm_rope_parameters), as one replay of a compiled MLX graph whose primitives
 * and order are those of the six composed calls, so the bits are theirs.
 *
 * Plain C over the public mlx-c API, like dual_head_norm.h; the status,
 * mode and error types are dual_head_norm_common.h's. The fused CUDA mode is a plug-in
 * (fused/), as for the dual head norm: one kernel launch normalizes,
 * rotates and transposes every row of both inputs, with the bits of the
 * six composed calls.
 */
#ifndef MLX_DUALNORM_DUAL_HEAD_NORM_ROPE_H
#define MLX_DUALNORM_DUAL_HEAD_NORM_ROPE_H

#include <stdbool.h>

#include "dual_head_norm_common.h"
#include "mlx/c/mlx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The RoPE of both outputs, as mlx_fast_rope_dynamic takes it. `dims` must
 * be positive and even, and at most the inputs' last dimension (checked per
 * call).
 *
 * Frequencies: with `with_freqs` false, `base` gives them, as
 * mlx_fast_rope_dynamic's base. With `with_freqs` true there is no base
 * (`base` must be 0) and every apply takes the frequency table as an INPUT
 * (mlx_dualnorm_dual_head_norm_rope_apply_with_freqs), as
 * mlx_fast_rope_dynamic's `freqs`: an array of shape (dims / 2,), of any
 * dtype MLX converts to float32. The object holds no array, so a table that
 * changes between calls is followed, and the compiled graph is replayed,
 * not retraced, for a table of the same shape and dtype.
 *
 * `input_scale`, when it has a value, multiplies the first `dims` features
 * of each normalized, transposed side before the rotation, as Python's
 * `x.at[..., :dims].multiply(input_scale)` (mlx-lm's YaRN and su-scaled
 * RoPE): the value, rounded to float32, becomes a scalar of the input's
 * dtype, so for bfloat16 inputs both the factor and the product are
 * bfloat16. Finite (checked at construction).
 *
 * Zero-initialized fields past `scale` mean what the struct meant before
 * they were added: frequencies from `base`, no input scale. */
typedef struct mlx_dualnorm_rope_parameters_ {
  int dims;
  bool traditional;
  float base;
  float scale;
  bool with_freqs;
  mlx_optional_float input_scale;
} mlx_dualnorm_rope_parameters;

/* The fused CUDA mode of the norm + RoPE, as the composite sees it (the
 * shared part and its contract: mlx_dualnorm_fused_kernel). The composite
 * also sends it only an offset MLX reads per batch entry or as a scalar. */
typedef struct mlx_dualnorm_fused_rope_backend_ {
  /* First member: the composite registers a pointer to it. */
  mlx_dualnorm_fused_kernel kernel;
  /* Sets `*res` (allocated when empty, owned by the caller) to the lazy
   * rotated queries and keys, in that order, from one launch. Inputs are
   * borrowed; an empty weight handle means no weight. 0 on success;
   * non-zero with the reason sent to mlx_error. */
  int (*apply)(mlx_vector_array* res, const mlx_array queries, const mlx_array keys,
               const mlx_array query_scale_weight, const mlx_array key_scale_weight,
               const mlx_array rope_offset, float rms_norm_epsilon,
               mlx_dualnorm_rope_parameters rope);
  /* As `apply`, with the frequency table of a `rope.with_freqs` object
   * (borrowed; float32, shape (dims / 2,): the composite sends it no other
   * table). `apply` is this with an empty `freqs` handle; both honor every
   * field of `rope`. */
  int (*apply_with_freqs)(mlx_vector_array* res, const mlx_array queries,
                          const mlx_array keys, const mlx_array query_scale_weight,
                          const mlx_array key_scale_weight, const mlx_array rope_offset,
                          const mlx_array freqs, float rms_norm_epsilon,
                          mlx_dualnorm_rope_parameters rope);
  /* As `apply_with_freqs`, and in the same launch the KV-cache write of
   * mlx_dualnorm_dual_head_norm_rope_apply_with_cache
   * (dual_head_norm_rope_cache.h): `*res` holds the rotated queries, the
   * key buffer written and the value buffer written, in that order, each
   * buffer taking its input's memory where nothing else holds it, else a
   * copy. The composite sends it only calls whose values and buffers have
   * the queries' dtype, with rows [write_offset, write_offset + L) inside
   * both buffers. With `fetch`, `*res` also holds rows [0, write_offset +
   * L) of both buffers written (the key rows, then the value rows), as
   * views of them. NULL: the composite writes with MLX's slice updates
   * after `apply_with_freqs`. */
  int (*apply_with_cache)(mlx_vector_array* res, const mlx_array queries, const mlx_array keys,
                          const mlx_array values, const mlx_array query_scale_weight,
                          const mlx_array key_scale_weight, const mlx_array rope_offset,
                          const mlx_array freqs, const mlx_array key_cache,
                          const mlx_array value_cache, int write_offset,
                          float rms_norm_epsilon, mlx_dualnorm_rope_parameters rope, bool fetch);
} mlx_dualnorm_fused_rope_backend;

/* Registers the fused CUDA mode of the norm + RoPE process-wide (NULL
 * unregisters it). The table must outlive every object created while it
 * is registered. Without one, AUTO resolves to COMPILED. */
void mlx_dualnorm_set_fused_rope_backend(const mlx_dualnorm_fused_rope_backend* backend);

/* True when mode FUSED can be asked for: a backend is registered and MLX
 * has a CUDA GPU. */
bool mlx_dualnorm_fused_rope_mode_available(void);

/* Opaque: the compiled graphs (one per weight layout) and the constants
 * they bake in; its life cycle is dual_head_norm_common.h's. */
typedef struct mlx_dualnorm_dual_head_norm_rope_ mlx_dualnorm_dual_head_norm_rope;

/* Builds the graphs with `rms_norm_epsilon` and `rope` baked in, for `mode`
 * (AUTO resolves to FUSED where a fused backend is registered, MLX has a
 * CUDA GPU and the kernel compiles, else to COMPILED; FUSED where it
 * cannot run is an invalid argument). In FUSED mode, calls the kernel does
 * not take run the compiled graph, with the same bits. The
 * epsilon must be finite, >= 0 and within float32's range (checked before
 * rounding to float32, the type MLX uses); rope.dims positive and even;
 * rope.base 0 when rope.with_freqs; rope.input_scale finite when given.
 * `*res` receives a new object the caller owns (free it with
 * mlx_dualnorm_dual_head_norm_rope_free). */
int mlx_dualnorm_dual_head_norm_rope_new(mlx_dualnorm_dual_head_norm_rope** res,
                                         double rms_norm_epsilon,
                                         mlx_dualnorm_rope_parameters rope,
                                         mlx_dualnorm_mode mode, mlx_dualnorm_error* error);

/* The mode construction resolved (never AUTO); AUTO for NULL. */
mlx_dualnorm_mode mlx_dualnorm_dual_head_norm_rope_mode(
    const mlx_dualnorm_dual_head_norm_rope* norm_rope);

/* The epsilon the graphs bake in, as the float32 MLX uses; NaN for NULL. */
float mlx_dualnorm_dual_head_norm_rope_epsilon(const mlx_dualnorm_dual_head_norm_rope* norm_rope);

/* The RoPE parameters the graphs bake in; all zero for NULL. */
mlx_dualnorm_rope_parameters mlx_dualnorm_dual_head_norm_rope_parameters(
    const mlx_dualnorm_dual_head_norm_rope* norm_rope);

/* Normalizes, transposes to (B, H, L, D) and rotates queries and keys, both
 * of rank 4, with the weights given (an empty weight handle means no weight
 * for that side) and `rope_offset`. A weight of D elements normalizes each
 * head, as above; a weight of H * D elements (H > 1 heads) normalizes each
 * token's heads together, as mlx-lm's OLMo-2 normalizes its whole q/k
 * projection before splitting it into heads: rms_norm(x.reshape(B, L,
 * H * D), w, eps).reshape(B, L, H, D), then the transpose and RoPE. The
 * RoPE offset is an integer array as mlx_fast_rope_dynamic
 * takes it (a scalar, or one value per batch entry; mlx-lm's decode passes
 * an int32 scalar). Outputs: two lazy arrays, the rotated queries first,
 * the rotated keys second (ownership: the common life cycle). */
int mlx_dualnorm_dual_head_norm_rope_apply(
    mlx_vector_array* res, mlx_dualnorm_dual_head_norm_rope* norm_rope,
    const mlx_array queries, const mlx_array keys,
    const mlx_array query_scale_weight, const mlx_array key_scale_weight,
    const mlx_array rope_offset, mlx_dualnorm_error* error);

/* As mlx_dualnorm_dual_head_norm_rope_apply, with `freqs`, the frequency
 * table of a `rope.with_freqs` object (BORROWED, like every input): an
 * array of shape (dims / 2,), converted to float32 as mlx_fast_rope_dynamic
 * does. An object with a base takes an empty `freqs` handle only (MLX's
 * rule: one of base or freqs), and one with frequencies a table only. Same
 * outputs, order and ownership as _apply, which is this function with an
 * empty `freqs` handle. */
int mlx_dualnorm_dual_head_norm_rope_apply_with_freqs(
    mlx_vector_array* res, mlx_dualnorm_dual_head_norm_rope* norm_rope,
    const mlx_array queries, const mlx_array keys,
    const mlx_array query_scale_weight, const mlx_array key_scale_weight,
    const mlx_array rope_offset, const mlx_array freqs /* may be null */,
    mlx_dualnorm_error* error);

/* Releases the compiled graphs (the common life cycle's _close). */
int mlx_dualnorm_dual_head_norm_rope_close(mlx_dualnorm_dual_head_norm_rope* norm_rope,
                                           mlx_dualnorm_error* error);

/* Closes (if still open) and frees (the common life cycle's _free). */
void mlx_dualnorm_dual_head_norm_rope_free(mlx_dualnorm_dual_head_norm_rope* norm_rope);

#ifdef __cplusplus
}
#endif

#endif
