/* The MLX primitive that launches the fused dual RMS norm + RoPE (CUDA
 * builds only: it needs the headers of MLX's CUDA backend). Private to
 * fused/; this header itself needs no CUDA header. */
#ifndef MLX_DUALNORM_FUSED_DUAL_HEAD_NORM_ROPE_PRIMITIVE_H
#define MLX_DUALNORM_FUSED_DUAL_HEAD_NORM_ROPE_PRIMITIVE_H

#include <string>
#include <vector>

#include "mlx/array.h"

namespace mlx_dualnorm_fused {

/* Widest row the kernel takes, in elements: a row is staged in shared
 * memory (width * element size bytes, within the 48 KiB every launch may
 * use without opting in). */
inline constexpr int kMaxRopeRowWidth = 8192;

/* The rank of queries, keys, values and buffers: (batch, sequence, heads,
 * head dim), or (batch, heads, capacity, head dim) for a buffer. */
inline constexpr int kRopeInputRank = 4;

/* Hands the kernels' cubin (the norm + RoPE's entry points and those with
 * the KV-cache write) to the primitive, which loads it (once, at the first
 * evaluation, where MLX has the device context current). */
void set_rope_kernel_cubin(std::string cubin);

/* The RoPE of both sides, as fast::rope takes it: with a base, or, when
 * `with_freqs`, with the frequency table given to fused_dual_head_norm_rope
 * (`base` unused). With `has_input_scale`, the first `dims` features of
 * each normalized side are multiplied by `input_scale` (converted to the
 * inputs' dtype) before the rotation, as x.at[..., :dims].multiply(s). */
struct RopeConstants {
  int dims;
  bool traditional;
  float base;
  float scale;
  bool with_freqs = false;
  bool has_input_scale = false;
  float input_scale = 1.0f;
  /* false: no norms, each side rotated as it is (no weights, the epsilon
   * unread): the q/k prework of attention without q/k norms. */
  bool normalizes = true;
};

/* The KV-cache write of a fused launch: `values` (B, L, Hk, Dv) and the
 * cache's key buffer (B, Hk, C, D) and value buffer (B, Hk, Cv, Dv), all
 * borrowed, and the first row of axis 2 written, `first_row`, with rows
 * [first_row, first_row + L) inside both buffers (the caller checks). */
struct CacheWrite {
  const mlx::core::array& values;
  const mlx::core::array& key_cache;
  const mlx::core::array& value_cache;
  int first_row;
  /* Also output rows [0, first_row + L) of both written buffers, as views
   * of them. */
  bool fetch = false;
};

/* The lazy outputs of one fused launch over queries (B, L, Hq, D) and keys
 * (B, L', Hk, D'), which share a float dtype with the weights, if given.
 * A weight of D elements normalizes each head; one of H * D (H > 1)
 * normalizes each token's H heads together, as one row of H * D (OLMo-2's
 * q/k norms), before they are rotated per head.
 * `offset` is an integer scalar, or one value per batch entry of both
 * sides. `freqs`, required when `rope.with_freqs` (else ignored), is the
 * float32 (dims / 2,) table, read with its stride as MLX's CUDA RoPE reads
 * it.
 *
 * Without `cache`: the rotated queries (B, Hq, L, D) and keys
 * (B, Hk, L, D). With it: the rotated queries, then the key and value
 * buffers with the rotated keys and the transposed values written at rows
 * [first_row, first_row + L), as mlx-lm's KVCache.update_and_fetch writes
 * them, and with `cache->fetch` then rows [0, first_row + L) of both
 * (views sharing the written buffers' memory, strided as MLX's Slice
 * makes them: what update_and_fetch returns); the values and buffers have
 * the queries' dtype too. Each buffer
 * output takes its input's memory when nothing else holds that input at
 * evaluation (as MLX's SliceUpdate donates), else a copy: the input is
 * never visibly modified. */
std::vector<mlx::core::array> fused_dual_head_norm_rope(
    const mlx::core::array& queries,
    const mlx::core::array& keys,
    const mlx::core::array* query_weight,
    const mlx::core::array* key_weight,
    const mlx::core::array& offset,
    float rms_norm_epsilon,
    const RopeConstants& rope,
    const mlx::core::array* freqs = nullptr,
    const CacheWrite* cache = nullptr);

} // namespace mlx_dualnorm_fused

#endif
