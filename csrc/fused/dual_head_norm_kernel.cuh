/* CUDA source of the fused dual RMS norm, compiled at run time by NVRTC
 * (MLX's CUDA builds carry it), so users need no nvcc. It includes no
 * header: half and bfloat16 values travel as their 16 bits and convert with
 * PTX instructions, so it compiles without the CUDA toolkit's headers.
 *
 * The bit-parity contract with MLX 0.32.x's RMSNorm kernel (docs/parity.md),
 * per row of width D, for a block of BLOCK threads reading READS elements
 * (16 bytes: 4 float32, 8 half or bfloat16, in both of MLX's regimes; for
 * rows wider than READS*1024 MLX 0.32.4 reads 16 bytes too, and the GPU
 * probe's wide rows agree only so):
 *   - thread t, chunk c owns elements [(c*BLOCK + t)*READS, +READS), zero
 *     past D, and accumulates fma(x, x, sum) over them in that order, in a
 *     float starting at +0;
 *   - each 32-lane warp reduces with the xor butterfly of cooperative
 *     groups (masks 16, 8, 4, 2, 1); warp leaders store to shared memory;
 *     every warp reloads (lanes past the warp count read 0) and reduces
 *     again, so a row needing fewer threads than the launch has is padded
 *     with exact zeros and sums in the same tree;
 *   - normalizer = rsqrt(sum / D + eps) with IEEE division;
 *   - out = w * T(x * normalizer): rounded to T BEFORE the weight multiply,
 *     which is done in T (correctly rounded), skipped without a weight
 *     (MLX multiplies by an exact 1).
 * One launch covers the rows of both inputs: blocks [0, query_rows) take
 * query rows, the rest key rows; each side has its own BLOCK (READS is
 * 16 bytes of the shared dtype).
 * Inputs may be strided views: a row is a line along the last axis, its
 * start found from the row index, the shape and the strides, so no copy is
 * made and the values (hence the bits) are the same.
 *
 * Every entry point comes in two variants that differ only in how a row is
 * found: ContiguousRows, for row-contiguous inputs (row r starts at
 * r * width), and RowLayout, for any strided view. The first exists for its
 * size: a launch's arguments travel with it, and room for eight strides
 * per side made the dual norm's arguments several times larger than those
 * of contiguous inputs. The smaller arguments make a dependent chain of
 * fused kernels finish sooner after the host has encoded it
 * (docs/performance.md, "Fused launches").
 *
 * DualHeadNormParams is passed by value. Its one definition below is
 * compiled into the host code (fused_dual_head_norm_primitive.cpp) and
 * pasted, as text, into the kernel source, so the two cannot disagree.
 */
#ifndef MLX_DUALNORM_DUAL_HEAD_NORM_KERNEL_CUH
#define MLX_DUALNORM_DUAL_HEAD_NORM_KERNEL_CUH

/* Highest input rank the kernel indexes; higher ranks take the compiled
 * graph. */
#define MLX_DUALNORM_MAX_RANK 8

/* A side's rows and MLX's launch shape for them: ContiguousRows for a
 * row-contiguous input, RowLayout (those fields, then the strided layout)
 * for any other. */
#define MLX_DUALNORM_KERNEL_PARAMS                        \
  struct ContiguousRows {                                 \
    int rows;                                             \
    int width;                                            \
    int block;                                            \
    int has_weight;                                       \
    long long weight_stride;                              \
  };                                                      \
  struct RowLayout : ContiguousRows {                     \
    long long strides[MLX_DUALNORM_MAX_RANK];             \
    int shape[MLX_DUALNORM_MAX_RANK];                     \
    int rank;                                             \
  };                                                      \
  template <typename Rows>                                \
  struct DualHeadNormParams {                              \
    Rows queries;                                         \
    Rows keys;                                            \
    float eps;                                            \
  };

#define MLX_DUALNORM_STRINGIFY_EXPANDED(...) #__VA_ARGS__
#define MLX_DUALNORM_STRINGIFY(...) MLX_DUALNORM_STRINGIFY_EXPANDED(__VA_ARGS__)

namespace mlx_dualnorm_fused {

/* The row layout, the storage types and normalize_row: the part of the
 * kernel the fused norm + RoPE (dual_head_norm_rope_kernel.cuh) shares. */
inline constexpr const char kRowNormalizationSource[] =
    MLX_DUALNORM_STRINGIFY(MLX_DUALNORM_KERNEL_PARAMS) R"cuda(
typedef unsigned short bits16;

/* Offset of the first element of `row` (rows enumerate every axis but the
 * last, in row-major order), and the distance between a row's elements.
 * Row counts fit an int, so the index arithmetic is 32-bit (64-bit
 * division is emulated and slow); offsets are 64-bit. */
__device__ __forceinline__ long long row_start(const ContiguousRows& rows, unsigned int row) {
  return static_cast<long long>(row) * rows.width;
}

__device__ __forceinline__ long long element_stride(const ContiguousRows&) {
  return 1;
}

__device__ __forceinline__ long long element_stride(const RowLayout& layout) {
  return layout.strides[layout.rank - 1];
}

__device__ __forceinline__ long long row_start(const RowLayout& layout, unsigned int row) {
  long long offset = 0;
  for (int axis = layout.rank - 2; axis >= 0; --axis) {
    const unsigned int extent = static_cast<unsigned int>(layout.shape[axis]);
    offset += static_cast<long long>(row % extent) * layout.strides[axis];
    row /= extent;
  }
  return offset;
}

/* Sixteen bytes: what one thread reads per chunk (MLX's N_READS elements),
 * moved as one vector load or store where the memory allows. */
struct __align__(16) Vector16 {
  unsigned int words[4];
};

__device__ __forceinline__ bool is_vector_aligned(const void* address) {
  return (reinterpret_cast<unsigned long long>(address) & 15ull) == 0;
}

struct Float32Storage {
  typedef float storage;
  static __device__ __forceinline__ float to_float(float value) { return value; }
  static __device__ __forceinline__ float round(float value) { return value; }
  static __device__ __forceinline__ float multiply(float a, float b) { return __fmul_rn(a, b); }
};

/* What both 16-bit formats share: values travel as their bits, and a
 * float is rounded to the format with PTX's cvt.rn (round to nearest
 * even), as MLX's conversions round. `kBrain`: bfloat16, else IEEE half. */
template <bool kBrain>
struct Bits16Storage {
  typedef bits16 storage;
  static __device__ __forceinline__ bits16 round(float value) {
    bits16 result;
    if (kBrain) {
      asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(result) : "f"(value));
    } else {
      asm("cvt.rn.f16.f32 %0, %1;" : "=h"(result) : "f"(value));
    }
    return result;
  }
};

struct Float16Storage : Bits16Storage<false> {
  static __device__ __forceinline__ float to_float(bits16 value) {
    float result;
    asm("cvt.f32.f16 %0, %1;" : "=f"(result) : "h"(value));
    return result;
  }
  static __device__ __forceinline__ bits16 multiply(bits16 a, bits16 b) {
    bits16 result;
    asm("mul.rn.f16 %0, %1, %2;" : "=h"(result) : "h"(a), "h"(b));
    return result;
  }
};

struct BFloat16Storage : Bits16Storage<true> {
  static __device__ __forceinline__ float to_float(bits16 value) {
    return __uint_as_float(static_cast<unsigned int>(value) << 16);
  }
  static __device__ __forceinline__ bits16 multiply(bits16 a, bits16 b) {
    // a * b + (-0): the correctly rounded product, signed zeros kept.
    bits16 result;
    const bits16 negative_zero = 0x8000;
    asm("fma.rn.bf16 %0, %1, %2, %3;" : "=h"(result) : "h"(a), "h"(b), "h"(negative_zero));
    return result;
  }
};

__device__ __forceinline__ float warp_butterfly_sum(float value) {
  for (int mask = 16; mask > 0; mask >>= 1) {
    value = value + __shfl_xor_sync(0xffffffffu, value, mask);
  }
  return value;
}

/* The second level: each warp's total (every lane holds it) through shared
 * memory, reduced again by every warp, lanes past the warp count adding +0. */
__device__ __forceinline__ float sum_across_warps(float warp_total) {
  __shared__ float warp_sums[32];
  const int lane = threadIdx.x & 31;
  const int warps = blockDim.x >> 5;
  if (lane == 0) {
    warp_sums[threadIdx.x >> 5] = warp_total;
  }
  __syncthreads();
  return warp_butterfly_sum(lane < warps ? warp_sums[lane] : 0.0f);
}

/* READS: the elements in 16 bytes of the storage type (4 float32, 8 half
 * or bfloat16), as in MLX's kernel. */
template <typename Storage>
__device__ constexpr int chunk_reads() {
  return sizeof(Vector16) / sizeof(typename Storage::storage);
}

/* One thread's chunk: READS elements held in registers. Elements past the
 * row's end are zero bits, which every storage type reads as +0. */
template <typename Storage>
union Chunk {
  Vector16 vector;
  typename Storage::storage values[chunk_reads<Storage>()];
};

/* Loads the chunk of elements [first, first + READS) of a row whose
 * elements are `stride` apart: one 16-byte load where `as_vector` (the row
 * is contiguous, 16-byte aligned and a whole number of chunks wide), else
 * READS independent scalar loads. */
template <typename Storage>
__device__ __forceinline__ Chunk<Storage> load_chunk(
    const typename Storage::storage* row, int first, int width, long long stride,
    bool as_vector) {
  Chunk<Storage> chunk;
  if (as_vector) {
    if (first < width) {
      chunk.vector = *reinterpret_cast<const Vector16*>(row + first);
    } else {
      chunk.vector = Vector16{{0u, 0u, 0u, 0u}};
    }
  } else {
#pragma unroll
    for (int j = 0; j < chunk_reads<Storage>(); ++j) {
      const int element = first + j;
      chunk.values[j] = element < width ? row[element * stride] : typename Storage::storage(0);
    }
  }
  return chunk;
}

/* Writes the normalized row `row_index` of `input` to `out` (`width`
 * elements, contiguous: an output row, or shared memory for the RoPE).
 * `out` may be the input row itself (the node writing over its input):
 * each thread reads and writes only its own elements, each read before
 * it is written.
 * Inlined (as is dual_head_norm) so that `layout` stays a reference into
 * the kernel's parameter space rather than a per-thread copy in local
 * memory. Kept whole, at about 75 lines: the sum pass and the write pass
 * share the row's first chunk, held in registers, and the summation order
 * (which must be MLX's, element for element) reads in one place. */
template <typename Storage, typename Rows>
__device__ __forceinline__ void normalize_row(
    const typename Storage::storage* input,
    const typename Storage::storage* weight,
    typename Storage::storage* out,
    const Rows& layout, unsigned int row_index, float eps) {
  typedef Chunk<Storage> RowChunk;
  constexpr int READS = chunk_reads<Storage>();
  const typename Storage::storage* row = input + row_start(layout, row_index);
  const long long row_element_stride = element_stride(layout);
  const int width = layout.width;
  const int row_block = layout.block;
  const bool has_weight = layout.has_weight != 0;
  const int thread = threadIdx.x;
  const bool owns_elements = thread < row_block;
  const int vectors = (width + READS - 1) / READS;
  const int chunks = (vectors + row_block - 1) / row_block;
  const bool whole_chunks = width % READS == 0;
  const bool load_vectors = whole_chunks && row_element_stride == 1 && is_vector_aligned(row);
  const bool store_vectors = whole_chunks && is_vector_aligned(out);
  const bool weight_vectors =
      has_weight && whole_chunks && layout.weight_stride == 1 && is_vector_aligned(weight);

  // The first chunk stays in registers for the second pass (the only chunk
  // at decode widths); later chunks are read again. Its weights are loaded
  // with it, before the reduction, so their latency overlaps the input's
  // instead of following the block's barrier.
  RowChunk first_chunk;
  RowChunk first_scale;
  float sum_of_squares = 0.0f;
  if (owns_elements) {
    for (int chunk = 0; chunk < chunks; ++chunk) {
      const int first = (chunk * row_block + thread) * READS;
      const RowChunk x = load_chunk<Storage>(row, first, width, row_element_stride, load_vectors);
      if (chunk == 0 && has_weight) {
        first_scale =
            load_chunk<Storage>(weight, first, width, layout.weight_stride, weight_vectors);
      }
#pragma unroll
      for (int j = 0; j < READS; ++j) {
        const float value = Storage::to_float(x.values[j]);
        sum_of_squares = __fmaf_rn(value, value, sum_of_squares);
      }
      if (chunk == 0) {
        first_chunk = x;
      }
    }
  }
  sum_of_squares = warp_butterfly_sum(sum_of_squares);
  if (blockDim.x > 32) {
    sum_of_squares = sum_across_warps(sum_of_squares);
  }
  const float normalizer =
      rsqrtf(__fadd_rn(__fdiv_rn(sum_of_squares, static_cast<float>(width)), eps));

  if (owns_elements) {
    for (int chunk = 0; chunk < chunks; ++chunk) {
      const int first = (chunk * row_block + thread) * READS;
      if (first >= width) {
        break;
      }
      const RowChunk x = chunk == 0
          ? first_chunk
          : load_chunk<Storage>(row, first, width, row_element_stride, load_vectors);
      RowChunk scale;
      if (has_weight) {
        scale = chunk == 0
            ? first_scale
            : load_chunk<Storage>(weight, first, width, layout.weight_stride, weight_vectors);
      }
      RowChunk normalized;
#pragma unroll
      for (int j = 0; j < READS; ++j) {
        const typename Storage::storage rounded =
            Storage::round(__fmul_rn(Storage::to_float(x.values[j]), normalizer));
        normalized.values[j] = has_weight ? Storage::multiply(scale.values[j], rounded) : rounded;
      }
      if (store_vectors) {
        *reinterpret_cast<Vector16*>(out + first) = normalized.vector;
      } else {
#pragma unroll
        for (int j = 0; j < READS; ++j) {
          if (first + j < width) {
            out[first + j] = normalized.values[j];
          }
        }
      }
    }
  }
}

/* Every entry point of a program, one per storage type and row
 * description, named PREFIX_{contiguous,strided}_{float32,float16,bfloat16}
 * (the names the host's KernelModule loads). DEFINE(NAME, STORAGE, ROWS)
 * defines one. */
#define MLX_DUALNORM_DEFINE_ENTRY_POINTS(DEFINE, PREFIX)                  \
  DEFINE(PREFIX##_contiguous_float32, Float32Storage, ContiguousRows)     \
  DEFINE(PREFIX##_contiguous_float16, Float16Storage, ContiguousRows)     \
  DEFINE(PREFIX##_contiguous_bfloat16, BFloat16Storage, ContiguousRows)   \
  DEFINE(PREFIX##_strided_float32, Float32Storage, RowLayout)             \
  DEFINE(PREFIX##_strided_float16, Float16Storage, RowLayout)             \
  DEFINE(PREFIX##_strided_bfloat16, BFloat16Storage, RowLayout)

)cuda";

/* The fused dual RMS norm's entry points; its program is
 * kRowNormalizationSource followed by this. */
inline constexpr const char kDualHeadNormEntrySource[] = R"cuda(
/* Output rows are contiguous, `width` apart. */
template <typename Storage, typename Rows>
__device__ __forceinline__ typename Storage::storage* output_row(
    typename Storage::storage* output, const Rows& layout, unsigned int row_index) {
  return output + static_cast<long long>(row_index) * layout.width;
}

template <typename Storage, typename Rows>
__device__ __forceinline__ void dual_head_norm(
    const typename Storage::storage* queries, const typename Storage::storage* keys,
    const typename Storage::storage* query_weight, const typename Storage::storage* key_weight,
    typename Storage::storage* normalized_queries, typename Storage::storage* normalized_keys,
    const DualHeadNormParams<Rows>& params) {
  const unsigned int block_row = blockIdx.x;
  if (block_row < static_cast<unsigned int>(params.queries.rows)) {
    normalize_row<Storage>(queries, query_weight,
                           output_row<Storage>(normalized_queries, params.queries, block_row),
                           params.queries, block_row, params.eps);
  } else {
    const unsigned int key_row = block_row - static_cast<unsigned int>(params.queries.rows);
    normalize_row<Storage>(keys, key_weight,
                           output_row<Storage>(normalized_keys, params.keys, key_row),
                           params.keys, key_row, params.eps);
  }
}

#define MLX_DUALNORM_DEFINE_DUAL_HEAD_NORM(NAME, STORAGE, ROWS)                        \
  extern "C" __global__ void NAME(                                                   \
      const STORAGE::storage* queries, const STORAGE::storage* keys,                 \
      const STORAGE::storage* query_weight, const STORAGE::storage* key_weight,      \
      STORAGE::storage* normalized_queries, STORAGE::storage* normalized_keys,       \
      const DualHeadNormParams<ROWS> params) {                                        \
    dual_head_norm<STORAGE, ROWS>(queries, keys, query_weight, key_weight,            \
                                 normalized_queries, normalized_keys, params);       \
  }

MLX_DUALNORM_DEFINE_ENTRY_POINTS(MLX_DUALNORM_DEFINE_DUAL_HEAD_NORM, mlx_dualnorm_dual_head_norm)
)cuda";

} // namespace mlx_dualnorm_fused

#endif
