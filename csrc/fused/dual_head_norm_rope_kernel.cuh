/* CUDA source of the fused dual RMS norm + RoPE, compiled at run time by
 * NVRTC like dual_head_norm_kernel.cuh, whose row normalization it reuses
 * as text (its program is kRowNormalizationSource followed by this file's
 * parameters and entry points).
 *
 * One launch, one block per input row: blocks [0, query_rows) take query
 * rows, the rest key rows, each side with MLX's RMSNorm block size for its
 * width. A block
 *   1. normalizes its row exactly as MLX 0.32.x's RMSNorm kernel does
 *      (normalize_row: the value rounded to T before the weight multiply,
 *      which is done in T), into shared memory;
 *   2. rotates it with the arithmetic of MLX 0.32.x's CUDA RoPE kernel
 *      (mlx/backend/cuda/rope.cu), all float32 with the compiler's default
 *      contraction, no fast math, as MLX builds it:
 *        d        = float(i) / float(dims / 2)           (IEEE division)
 *        inv_freq = exp2f(-d * log2_base)
 *        theta    = (scale * position) * inv_freq
 *        x1 * cosf(theta) - x2 * sinf(theta),  x1 * sinf(theta) + x2 * cosf(theta)
 *      each rounded to T; pairs (2i, 2i+1) when traditional, else
 *      (i, i + dims/2); elements from `dims` on are copied;
 *   3. writes the row of the (B, H, L, D) output that transpose(0, 2, 1, 3)
 *      makes of input row (b, l, h) of (B, L, H, D), in the memory order
 *      MLX's RoPE leaves it (`token_major`): row (b * L + l) * H + h, the
 *      input's own order, as MLX's RoPE writes over (or beside) its
 *      transposed input keeping that input's strides. Else (the keys of
 *      the KV-cache write) row (b, h, l) of a row-contiguous (B, H, C, D).
 * A side normalized over all its heads at once (`row_heads` = H, OLMo-2's
 * norm over each token's whole projection) comes as (B, L, 1, H * D): its
 * block normalizes the token's H * D elements as one row (MLX's RMSNorm
 * over that width), then rotates and places each of the row's H heads as
 * above. With `row_heads` = 1 a row is one head.
 * Without norms (`normalizes` 0: attention with no q/k norms) step 1 stages
 * the row as it is, so steps 2 and 3 rotate and place the input's own
 * values, as MLX's RoPE does over the transposed input.
 * With a frequency table (`freqs` not null) step 2 takes instead, as MLX's
 * rope_freqs kernel does, inv_freq = 1.0 / freqs[freq_stride * i] (the
 * float32 entry divided in double, converted to float). With
 * `has_input_scale`, each of the first `dims` normalized values is first
 * multiplied by `input_scale` (the scale already rounded to T on the host)
 * and rounded to T, as x.at[..., :dims].multiply(scale) does in T.
 * `log2_base` is computed on the host as MLX does: std::log2 of the float
 * base, in float. The position is MLX's too: the offset is read as int32
 * at offsets[b * offset_stride]; MLX's kernel for B == 1 and L == 1
 * converts that int32 to float, its general kernel converts the unsigned
 * sum (l + offset); the two differ only for negative offsets, and each
 * side's `signed_position` says which one MLX runs for its shape. An
 * offset the host can read (a one-element array already computed, in
 * unified memory) arrives instead as `constant_offset`: MLX keeps small
 * arrays made on the host in pinned host memory, and reading one from the
 * kernel cost most of its time (docs/performance.md, "Fused launches":
 * most stall samples waited on that load).
 *
 * With the KV-cache write (the _cache entry points), the key rows go to
 * rows [w, w + L) of the key buffer (B, Hk, C, D) instead of a
 * token-major output, further blocks copy each value row (b, l, h) to row
 * (b, h, w + l) of the value buffer, and, for a buffer the host could not
 * let the launch write in place, further blocks copy the buffer's other
 * rows into the fresh output: the bits of MLX's SliceUpdate, which copies
 * (or donates) the buffer and then the update's elements.
 *
 * DualHeadNormRopeParams (and DualHeadNormRopeCacheParams) are passed by
 * value; their one definition below is compiled into the host code
 * (fused_dual_head_norm_rope_primitive.cpp) and pasted, as text, into the
 * kernel source.
 */
#ifndef MLX_DUALNORM_DUAL_HEAD_NORM_ROPE_KERNEL_CUH
#define MLX_DUALNORM_DUAL_HEAD_NORM_ROPE_KERNEL_CUH

#include "fused/dual_head_norm_kernel.cuh"

/* After MLX_DUALNORM_KERNEL_PARAMS, whose row descriptions it uses. */
#define MLX_DUALNORM_ROPE_KERNEL_PARAMS                   \
  struct RopeSide {                                       \
    int heads;                                            \
    int row_heads;                                        \
    int sequence;                                         \
    long long offset_stride;                              \
    int signed_position;                                  \
    int token_major;                                      \
    int output_sequence;                                  \
    int output_first_row;                                 \
  };                                                      \
  template <typename Rows>                                \
  struct DualHeadNormRopeParams {                          \
    Rows queries;                                         \
    Rows keys;                                            \
    RopeSide query_rope;                                  \
    RopeSide key_rope;                                    \
    float eps;                                            \
    int normalizes;                                       \
    int dims;                                             \
    int traditional;                                      \
    float scale;                                          \
    float log2_base;                                      \
    int has_constant_offset;                              \
    int constant_offset;                                  \
    const float* freqs;                                   \
    long long freq_stride;                                \
    int has_input_scale;                                  \
    float input_scale;                                    \
  };

/* After MLX_DUALNORM_ROPE_KERNEL_PARAMS: the KV-cache write's arguments.
 * StridedRows: the rows of a rank-4 source (`strides` in elements, the
 * extents of its first three axes, `width` its last), enumerated over the
 * first three axes in order; `rows` their product, 0 for none. For the
 * buffers it describes the source of a copy: 0 rows where the buffer is
 * written in place. */
#define MLX_DUALNORM_ROPE_CACHE_KERNEL_PARAMS             \
  struct StridedRows {                                    \
    long long strides[4];                                 \
    int extents[3];                                       \
    int width;                                            \
    int rows;                                             \
  };                                                      \
  template <typename Rows>                                \
  struct DualHeadNormRopeCacheParams {                     \
    DualHeadNormRopeParams<Rows> rope;                     \
    StridedRows values;                                   \
    StridedRows key_source;                               \
    StridedRows value_source;                             \
    int value_capacity;                                   \
    int first_row;                                        \
  };

namespace mlx_dualnorm_fused {

inline constexpr const char kDualHeadNormRopeEntrySource[] =
    MLX_DUALNORM_STRINGIFY(MLX_DUALNORM_ROPE_KERNEL_PARAMS) R"cuda(
/* The normalized row, `width` elements of T, 16-byte aligned for
 * normalize_row's vector stores; sized by the launch. */
extern __shared__ __align__(16) unsigned char normalized_row_bytes[];

/* The cosine and sine of pair i's angle at `position`, MLX's expressions. */
struct PairRotation {
  float cos_theta;
  float sin_theta;
};

template <typename Params>
__device__ __forceinline__ PairRotation pair_rotation(int i, float position,
                                                      const Params& params) {
  const int half = params.dims / 2;
  const float scaled_position = params.scale * position;
  float inv_freq;
  if (params.freqs != nullptr) {
    // MLX's rope_freqs: a double division by the float32 table entry,
    // converted to float.
    inv_freq = 1.0 / params.freqs[params.freq_stride * i];
  } else {
    const float d = __fdiv_rn(static_cast<float>(i), static_cast<float>(half));
    inv_freq = exp2f(-d * params.log2_base);
  }
  const float theta = scaled_position * inv_freq;
  return PairRotation{cosf(theta), sinf(theta)};
}

/* Rotates the normalized row in shared memory into `out`; `own_pair` is
 * the rotation of pair threadIdx.x, computed before the row was (it
 * depends only on the position), the others are computed here. */
template <typename Storage, typename Params>
__device__ __forceinline__ void rotate_row(
    const typename Storage::storage* normalized, typename Storage::storage* out,
    int width, float position, PairRotation own_pair, const Params& params) {
  const int half = params.dims / 2;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const PairRotation rotation =
        i == static_cast<int>(threadIdx.x) ? own_pair : pair_rotation(i, position, params);
    const float cos_theta = rotation.cos_theta;
    const float sin_theta = rotation.sin_theta;
    const int first = params.traditional ? 2 * i : i;
    const int second = params.traditional ? first + 1 : i + half;
    float x1 = Storage::to_float(normalized[first]);
    float x2 = Storage::to_float(normalized[second]);
    if (params.has_input_scale) {
      // x.at[..., :dims].multiply(s): the product of two T values, rounded
      // to T (exact in float32 for the 16-bit types, so rounding it once
      // is the correctly rounded product MLX's T multiply gives).
      x1 = Storage::to_float(Storage::round(x1 * params.input_scale));
      x2 = Storage::to_float(Storage::round(x2 * params.input_scale));
    }
    // MLX's expressions, left to the same contraction as in its kernel.
    const float rotated_first = x1 * cos_theta - x2 * sin_theta;
    const float rotated_second = x1 * sin_theta + x2 * cos_theta;
    out[first] = Storage::round(rotated_first);
    out[second] = Storage::round(rotated_second);
  }
  for (int j = params.dims + threadIdx.x; j < width; j += blockDim.x) {
    out[j] = normalized[j];
  }
}

/* Normalizes input row `row_index` of one side, then rotates it into its
 * transposed place. Inlined per side so `layout` and `rope` stay
 * references into the parameter space. */
template <typename Storage, typename Rows>
__device__ __forceinline__ void normalize_and_rotate_row(
    const typename Storage::storage* input, const typename Storage::storage* weight,
    const int* offsets, typename Storage::storage* output, const Rows& layout,
    const RopeSide& rope, unsigned int row_index, const DualHeadNormRopeParams<Rows>& params) {
  typename Storage::storage* normalized =
      reinterpret_cast<typename Storage::storage*>(normalized_row_bytes);
  const unsigned int heads = static_cast<unsigned int>(rope.heads);
  const unsigned int row_heads = static_cast<unsigned int>(rope.row_heads);
  const unsigned int row_groups = heads / row_heads;
  const unsigned int sequence = static_cast<unsigned int>(rope.sequence);
  const unsigned int first_head = (row_index % row_groups) * row_heads;
  const unsigned int token = (row_index / row_groups) % sequence;
  const unsigned int batch = row_index / row_groups / sequence;
  // The position and this thread's first rotation come before the
  // normalization: they depend on the offset only, so the offset's load
  // and the trigonometry overlap the row's load and reduction instead of
  // following the barrier. The arithmetic is unchanged.
  const int batch_offset = params.has_constant_offset
      ? params.constant_offset
      : offsets[static_cast<long long>(batch) * rope.offset_stride];
  const float position = rope.signed_position
      ? static_cast<float>(batch_offset)
      : static_cast<float>(token + static_cast<unsigned int>(batch_offset));
  PairRotation own_pair{1.0f, 0.0f};
  if (static_cast<int>(threadIdx.x) < params.dims / 2) {
    own_pair = pair_rotation(static_cast<int>(threadIdx.x), position, params);
  }
  if (params.normalizes) {
    normalize_row<Storage>(input, weight, normalized, layout, row_index, params.eps);
  } else {
    // No norms: the row itself, its bits unchanged, staged as a normalized
    // row would be (the rotation reads it, and an output that takes the
    // input's memory is written only after the barrier).
    const typename Storage::storage* row = input + row_start(layout, row_index);
    const long long stride = element_stride(layout);
    for (int j = threadIdx.x; j < layout.width; j += blockDim.x) {
      normalized[j] = row[j * stride];
    }
  }
  __syncthreads();
  const int head_width = layout.width / static_cast<int>(row_heads);
  for (unsigned int k = 0; k < row_heads; ++k) {
    const long long output_row =
        rope.token_major
            ? (static_cast<long long>(batch) * sequence + token) * heads + first_head + k
            : (static_cast<long long>(batch) * heads + first_head + k) * rope.output_sequence +
                  rope.output_first_row + token;
    rotate_row<Storage>(normalized + k * head_width, output + output_row * head_width,
                        head_width, position, own_pair, params);
  }
}

template <typename Storage, typename Rows>
__device__ __forceinline__ void dual_head_norm_rope(
    const typename Storage::storage* queries, const typename Storage::storage* keys,
    const typename Storage::storage* query_weight, const typename Storage::storage* key_weight,
    const int* offsets, typename Storage::storage* rotated_queries,
    typename Storage::storage* rotated_keys, const DualHeadNormRopeParams<Rows>& params) {
  const unsigned int block_row = blockIdx.x;
  if (block_row < static_cast<unsigned int>(params.queries.rows)) {
    normalize_and_rotate_row<Storage>(queries, query_weight, offsets, rotated_queries,
                                      params.queries, params.query_rope, block_row, params);
  } else {
    normalize_and_rotate_row<Storage>(
        keys, key_weight, offsets, rotated_keys, params.keys, params.key_rope,
        block_row - static_cast<unsigned int>(params.queries.rows), params);
  }
}

#define MLX_DUALNORM_DEFINE_DUAL_HEAD_NORM_ROPE(NAME, STORAGE, ROWS)                   \
  extern "C" __global__ void NAME(                                                   \
      const STORAGE::storage* queries, const STORAGE::storage* keys,                 \
      const STORAGE::storage* query_weight, const STORAGE::storage* key_weight,      \
      const int* offsets, STORAGE::storage* rotated_queries,                         \
      STORAGE::storage* rotated_keys, const DualHeadNormRopeParams<ROWS> params) {    \
    dual_head_norm_rope<STORAGE, ROWS>(queries, keys, query_weight, key_weight,       \
                                      offsets, rotated_queries, rotated_keys, params); \
  }

MLX_DUALNORM_DEFINE_ENTRY_POINTS(MLX_DUALNORM_DEFINE_DUAL_HEAD_NORM_ROPE,
                                 mlx_dualnorm_dual_head_norm_rope)
)cuda" MLX_DUALNORM_STRINGIFY(MLX_DUALNORM_ROPE_CACHE_KERNEL_PARAMS) R"cuda(
/* Row `row` of a rank-4 source enumerated over its first three axes: its
 * three indices (first axis first) into `index`, and where it starts. */
template <typename T>
__device__ __forceinline__ const T* strided_row(const T* source, const StridedRows& rows,
                                                unsigned int row, unsigned int index[3]) {
  index[2] = row % static_cast<unsigned int>(rows.extents[2]);
  row /= static_cast<unsigned int>(rows.extents[2]);
  index[1] = row % static_cast<unsigned int>(rows.extents[1]);
  index[0] = row / static_cast<unsigned int>(rows.extents[1]);
  return source + index[0] * rows.strides[0] + index[1] * rows.strides[1] +
         index[2] * rows.strides[2];
}

/* Copies one row of `width` elements, `stride` apart in the source, to a
 * contiguous destination: the bits, unchanged. */
template <typename Storage>
__device__ __forceinline__ void copy_row(const typename Storage::storage* source,
                                         long long stride, typename Storage::storage* destination,
                                         int width) {
  for (int j = threadIdx.x; j < width; j += blockDim.x) {
    destination[j] = source[j * stride];
  }
}

/* Copies row `row` of a rank-4 source into the row-contiguous buffer
 * output (B, H, C, width). A value row (b, l, h) of (B, L, Hk, Dv), with
 * `value_row`, goes to row (b, h, first_row + l): the transposed values, as
 * `values.transpose(0, 2, 1, 3)` written at rows [w, w + L). A row
 * (b, h, c) of a buffer that is not written in place goes to the same row,
 * unless c is one of the rows [first_row, first_row + length) the key or
 * value blocks write. */
template <typename Storage>
__device__ __forceinline__ void copy_into_buffer(const typename Storage::storage* source,
                                                 typename Storage::storage* buffer,
                                                 const StridedRows& rows, unsigned int row,
                                                 bool value_row, int capacity, int first_row,
                                                 int length) {
  unsigned int index[3];
  const typename Storage::storage* start = strided_row(source, rows, row, index);
  long long destination_row = row;
  if (value_row) {
    destination_row =
        (static_cast<long long>(index[0]) * rows.extents[2] + index[2]) * capacity +
        first_row + index[1];
  } else if (static_cast<int>(index[2]) >= first_row &&
             static_cast<int>(index[2]) < first_row + length) {
    return;
  }
  copy_row<Storage>(start, rows.strides[3], buffer + destination_row * rows.width, rows.width);
}

/* The norm + RoPE with the KV-cache write. Blocks, in order: query rows,
 * key rows (rotated into the key buffer at rows [w, w + L)), value rows,
 * then the rows of each buffer that is copied rather than written in place
 * (none in the common case). Every output element is written by exactly one
 * block, and no block reads what another writes. */
template <typename Storage, typename Rows>
__device__ __forceinline__ void dual_head_norm_rope_with_cache(
    const typename Storage::storage* queries, const typename Storage::storage* keys,
    const typename Storage::storage* values, const typename Storage::storage* query_weight,
    const typename Storage::storage* key_weight, const int* offsets,
    const typename Storage::storage* key_source, const typename Storage::storage* value_source,
    typename Storage::storage* rotated_queries, typename Storage::storage* key_cache,
    typename Storage::storage* value_cache, const DualHeadNormRopeCacheParams<Rows>& params) {
  unsigned int block_row = blockIdx.x;
  const unsigned int normalized_rows =
      static_cast<unsigned int>(params.rope.queries.rows + params.rope.keys.rows);
  if (block_row < normalized_rows) {
    dual_head_norm_rope<Storage>(queries, keys, query_weight, key_weight, offsets,
                                rotated_queries, key_cache, params.rope);
    return;
  }
  block_row -= normalized_rows;
  const int length = params.values.extents[1];
  if (block_row < static_cast<unsigned int>(params.values.rows)) {
    copy_into_buffer<Storage>(values, value_cache, params.values, block_row, true,
                              params.value_capacity, params.first_row, length);
    return;
  }
  block_row -= static_cast<unsigned int>(params.values.rows);
  if (block_row < static_cast<unsigned int>(params.key_source.rows)) {
    copy_into_buffer<Storage>(key_source, key_cache, params.key_source, block_row, false,
                              params.rope.key_rope.output_sequence, params.first_row, length);
    return;
  }
  block_row -= static_cast<unsigned int>(params.key_source.rows);
  copy_into_buffer<Storage>(value_source, value_cache, params.value_source, block_row, false,
                            params.value_capacity, params.first_row, length);
}

#define MLX_DUALNORM_DEFINE_DUAL_HEAD_NORM_ROPE_CACHE(NAME, STORAGE, ROWS)             \
  extern "C" __global__ void NAME(                                                   \
      const STORAGE::storage* queries, const STORAGE::storage* keys,                 \
      const STORAGE::storage* values, const STORAGE::storage* query_weight,          \
      const STORAGE::storage* key_weight, const int* offsets,                        \
      const STORAGE::storage* key_source, const STORAGE::storage* value_source,      \
      STORAGE::storage* rotated_queries, STORAGE::storage* key_cache,                \
      STORAGE::storage* value_cache, const DualHeadNormRopeCacheParams<ROWS> params) { \
    dual_head_norm_rope_with_cache<STORAGE, ROWS>(                                    \
        queries, keys, values, query_weight, key_weight, offsets, key_source,        \
        value_source, rotated_queries, key_cache, value_cache, params);              \
  }

MLX_DUALNORM_DEFINE_ENTRY_POINTS(MLX_DUALNORM_DEFINE_DUAL_HEAD_NORM_ROPE_CACHE,
                                 mlx_dualnorm_dual_head_norm_rope_cache)
)cuda";

} // namespace mlx_dualnorm_fused

#endif
