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
 * mlx_dualnorm_rope_parameters), as one replay of a compiled MLX graph
 * whose primitives and order are those of the six composed calls, so the
 * bits are theirs.
 *
 * Plain C over the public mlx-c API, like dual_head_norm.h; the status,
 * mode and error types are dual_head_norm_common.h's. Every apply of this
 * family is a thin wrapper of mlx_dualnorm_dual_head_norm_rope_apply_call,
 * whose call struct names the inputs. The fused CUDA mode is a plug-in
 * (fused/), as for the dual head norm: one kernel launch normalizes,
 * rotates and transposes every row of both inputs, with the bits of the
 * six composed calls.
 */
#ifndef MLX_DUALNORM_DUAL_HEAD_NORM_ROPE_H
#define MLX_DUALNORM_DUAL_HEAD_NORM_ROPE_H

#include <stdbool.h>
#include <stddef.h>

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

/* The arrays of one norm + RoPE call, as every apply of this family and
 * the fused backend take them. All BORROWED: the call never frees them and
 * only its lazy outputs keep references. An empty handle (ctx NULL) in a
 * weight means no weight for that side; in `freqs`, no table (an object
 * with a base; one made with_freqs takes the table here). */
typedef struct mlx_dualnorm_rope_inputs_ {
  mlx_array queries;            /* (B, L, Hq, D) */
  mlx_array keys;               /* (B, L, Hk, D) */
  mlx_array query_scale_weight; /* (D,) or (Hq * D,); may be empty */
  mlx_array key_scale_weight;   /* (D,) or (Hk * D,); may be empty */
  mlx_array rope_offset;        /* integer: a scalar or one per batch entry */
  mlx_array freqs;              /* (dims / 2,); empty for an object with a base */
} mlx_dualnorm_rope_inputs;

/* The KV-cache write of a call (dual_head_norm_rope_cache.h says what it
 * checks, writes and returns). The arrays are BORROWED, as in
 * mlx_dualnorm_rope_inputs; the buffers are never modified. */
typedef struct mlx_dualnorm_cache_write_ {
  mlx_array values;      /* (B, L, Hk, Dv) */
  mlx_array key_cache;   /* (B, Hk, C, D) */
  mlx_array value_cache; /* (B, Hk, Cv, Dv) */
  int write_offset;      /* the first row written, on axis 2 of both buffers */
  bool fetch;            /* also return rows [0, write_offset + L) of both */
} mlx_dualnorm_cache_write;

/* How many arrays a call puts in `*res`, in this order: */
enum {
  /* the rotated queries (B, Hq, L, D), the rotated keys (B, Hk, L, D); */
  MLX_DUALNORM_ROPE_OUTPUT_COUNT = 2,
  /* with a cache write: the rotated queries, the key buffer written, the
   * value buffer written; */
  MLX_DUALNORM_CACHE_WRITE_OUTPUT_COUNT = 3,
  /* with a cache write that fetches: those three, then the key rows and
   * the value rows fetched. */
  MLX_DUALNORM_CACHE_FETCH_OUTPUT_COUNT = 5,
};

/* One call of mlx_dualnorm_dual_head_norm_rope_apply_call. Versioned by
 * size: set `struct_size` to sizeof(mlx_dualnorm_dual_head_norm_rope_call)
 * as compiled by the caller. Fields added later go after the last one and
 * read as absent when the caller's struct_size stops before them; a
 * struct_size smaller than this first version's is refused, and a larger
 * one (a caller built against a later header) is accepted, the fields this
 * library does not know ignored. mlx_dualnorm_rope_inputs and
 * mlx_dualnorm_cache_write never change: what a later release adds, it
 * adds here, at the end. */
typedef struct mlx_dualnorm_dual_head_norm_rope_call_ {
  size_t struct_size;
  mlx_dualnorm_rope_inputs inputs;
  /* BORROWED; NULL: no KV-cache write (the norm + RoPE alone). */
  const mlx_dualnorm_cache_write* cache_write;
} mlx_dualnorm_dual_head_norm_rope_call;

/* The fused CUDA mode of the norm + RoPE, as the composite sees it (the
 * shared part and its contract: mlx_dualnorm_fused_kernel). The interface
 * between this library and its own fused plug-in, not a stable ABI: a
 * table must come from the same release as the library it registers with
 * (mlx_dualnorm_fused_rope_backend_table, fused_dual_head_norm.h). The
 * composite also sends it only an offset MLX reads per batch entry or as a
 * scalar, and a frequency table only in float32 (shape (dims / 2,)). */
typedef struct mlx_dualnorm_fused_rope_backend_ {
  /* First member: the composite registers a pointer to it. */
  mlx_dualnorm_fused_kernel kernel;
  /* Sets `*res` (allocated when empty, owned by the caller) to the lazy
   * outputs of one launch, in the order the enum above gives: without
   * `cache_write` (NULL) the rotated queries and keys; with it the same
   * launch also writes the KV cache, each buffer written taking its input's
   * memory where nothing else holds it, else a copy, and with `fetch` its
   * fetched rows are views of the buffers written. Every field of `rope`
   * is honored. With `normalizes` false there are no norms: both sides
   * are rotated as they are (no weights; `rms_norm_epsilon` unused).
   * `inputs` and `cache_write` are borrowed, as their types say. 0 on success; non-zero with the reason sent to mlx_error. */
  int (*apply)(mlx_vector_array* res, const mlx_dualnorm_rope_inputs* inputs,
               const mlx_dualnorm_cache_write* cache_write, bool normalizes,
               float rms_norm_epsilon, mlx_dualnorm_rope_parameters rope);
  /* Whether `apply` takes a `cache_write`. The composite sends one only
   * where the values and both buffers have the queries' dtype and rows
   * [write_offset, write_offset + L) lie inside both buffers; else, and
   * where this is false, it writes with MLX's slice updates after a launch
   * without one. */
  bool writes_cache;
} mlx_dualnorm_fused_rope_backend;

/* Registers the fused CUDA mode of the norm + RoPE process-wide (NULL
 * unregisters it). The table must outlive every object created while it
 * is registered. Without one, AUTO resolves to COMPILED. */
void mlx_dualnorm_set_fused_rope_backend(const mlx_dualnorm_fused_rope_backend* backend);

/* True when mode FUSED can be asked for: a backend is registered and MLX
 * has a CUDA GPU. */
bool mlx_dualnorm_fused_rope_mode_available(void);

/* Opaque: the compiled graphs (one per weight set) and the constants
 * they bake in; its life cycle is dual_head_norm_common.h's. */
typedef struct mlx_dualnorm_dual_head_norm_rope_ mlx_dualnorm_dual_head_norm_rope;

/* Builds the graphs with `rms_norm_epsilon` and `rope` baked in, for `mode`
 * (AUTO resolves to FUSED where a fused backend is registered, MLX has a
 * CUDA GPU and the kernel compiles, else to COMPILED; FUSED where it
 * cannot run is an invalid argument). In FUSED mode, calls the kernel does
 * not take run the compiled graph, with the same bits. The
 * epsilon must be finite, >= 0 and within float32's range (checked before
 * rounding to float32, the type MLX uses); rope.dims positive and even;
 * rope.base finite and > 0, or 0 when rope.with_freqs; rope.input_scale
 * finite when given.
 * `*res` receives a new object the caller owns (free it with
 * mlx_dualnorm_dual_head_norm_rope_free). */
int mlx_dualnorm_dual_head_norm_rope_new(mlx_dualnorm_dual_head_norm_rope** res,
                                         double rms_norm_epsilon,
                                         mlx_dualnorm_rope_parameters rope,
                                         mlx_dualnorm_mode mode, mlx_dualnorm_error* error);

/* An object of this family WITHOUT the norms: every call rotates and
 * transposes queries and keys as they are,
 *
 *   rope(queries.transpose(0, 2, 1, 3)), rope(keys.transpose(0, 2, 1, 3))
 *
 * (and, with a cache write, writes the rotated keys and the values as
 * dual_head_norm_rope_cache.h says): the q/k prework of attention that has
 * no q/k norms (mlx-lm's Llama, Mistral, Qwen2 and their kin), with the
 * bits of those composed calls. Everything else is as for an object made
 * by mlx_dualnorm_dual_head_norm_rope_new: `rope`, `mode` and their
 * checks, the routes (compiled graph, fused launch), the cache write, the
 * life cycle. Its calls take no scale weight (a weight handle that is not
 * empty is an invalid argument), and its epsilon reads NaN. */
int mlx_dualnorm_dual_head_norm_rope_new_without_norms(
    mlx_dualnorm_dual_head_norm_rope** res, mlx_dualnorm_rope_parameters rope,
    mlx_dualnorm_mode mode, mlx_dualnorm_error* error);

/* Whether the object normalizes before rotating: false for one made by
 * mlx_dualnorm_dual_head_norm_rope_new_without_norms, and for NULL. */
bool mlx_dualnorm_dual_head_norm_rope_normalizes(
    const mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope);

/* The mode construction resolved (never AUTO); AUTO for NULL. */
mlx_dualnorm_mode mlx_dualnorm_dual_head_norm_rope_mode(
    const mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope);

/* The epsilon the graphs bake in, as the float32 MLX uses; NaN for NULL
 * and for an object without norms. */
float mlx_dualnorm_dual_head_norm_rope_epsilon(
    const mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope);

/* The RoPE parameters the graphs bake in; all zero for NULL. */
mlx_dualnorm_rope_parameters mlx_dualnorm_dual_head_norm_rope_parameters(
    const mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope);

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
int mlx_dualnorm_dual_head_norm_rope_apply(mlx_vector_array* res,
                                           mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
                                           const mlx_array queries, const mlx_array keys,
                                           const mlx_array query_scale_weight,
                                           const mlx_array key_scale_weight,
                                           const mlx_array rope_offset, mlx_dualnorm_error* error);

/* As mlx_dualnorm_dual_head_norm_rope_apply, with `freqs`, the frequency
 * table of a `rope.with_freqs` object (BORROWED, like every input): an
 * array of shape (dims / 2,), converted to float32 as mlx_fast_rope_dynamic
 * does. An object with a base takes an empty `freqs` handle only (MLX's
 * rule: one of base or freqs), and one with frequencies a table only. Same
 * outputs, order and ownership as _apply, which is this function with an
 * empty `freqs` handle. */
int mlx_dualnorm_dual_head_norm_rope_apply_with_freqs(
    mlx_vector_array* res, mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
    const mlx_array queries, const mlx_array keys, const mlx_array query_scale_weight,
    const mlx_array key_scale_weight, const mlx_array rope_offset,
    const mlx_array freqs /* may be null */, mlx_dualnorm_error* error);

/* The one entry of this family that every other fills: the norm + RoPE of
 * `call->inputs` (as mlx_dualnorm_dual_head_norm_rope_apply_with_freqs
 * describes), with the KV-cache write of `call->cache_write` where it is
 * not NULL (as mlx_dualnorm_dual_head_norm_rope_apply_with_cache
 * describes). `call` is BORROWED and read before the function returns. A
 * NULL `call`, or one whose struct_size is smaller than this first
 * version's, is MLX_DUALNORM_INVALID_ARGUMENT of "dual_head_norm_rope";
 * every other failure is labelled as the function this call stands for
 * would label it. On success `*res` (allocated when empty, owned by the
 * caller) holds MLX_DUALNORM_ROPE_OUTPUT_COUNT arrays, or with a cache
 * write MLX_DUALNORM_CACHE_WRITE_OUTPUT_COUNT, or with a write that
 * fetches MLX_DUALNORM_CACHE_FETCH_OUTPUT_COUNT, in the enum's order; on
 * failure it is left as it was. Thread-safe. */
int mlx_dualnorm_dual_head_norm_rope_apply_call(
    mlx_vector_array* res, mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
    const mlx_dualnorm_dual_head_norm_rope_call* call, mlx_dualnorm_error* error);

/* Releases the compiled graphs (the common life cycle's _close). */
int mlx_dualnorm_dual_head_norm_rope_close(mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
                                           mlx_dualnorm_error* error);

/* Closes (if still open) and frees (the common life cycle's _free). */
void mlx_dualnorm_dual_head_norm_rope_free(mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope);

#ifdef __cplusplus
}
#endif

#endif
