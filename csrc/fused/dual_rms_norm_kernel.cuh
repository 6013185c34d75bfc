/* CUDA source of the fused dual RMS norm, compiled at run time by NVRTC
 * (MLX's CUDA builds carry it), so users need no nvcc. It includes no
 * header: half and bfloat16 values travel as their 16 bits and convert with
 * PTX instructions, so it compiles without the CUDA toolkit's headers.
 *
 * The bit-parity contract with MLX 0.32.x's RMSNorm kernel (mlx-facts §5),
 * per row of width D, for a block of BLOCK threads reading READS elements:
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
 * query rows, the rest key rows; each side has its own BLOCK and READS.
 * Inputs may be strided views: a row is a line along the last axis, its
 * start found from the row index, the shape and the strides, so no copy is
 * made and the values (hence the bits) are the same.
 *
 * DualRmsNormParams is passed by value. Its one definition below is
 * compiled into the host code (fused_dual_rms_norm_primitive.cpp) and
 * pasted, as text, into the kernel source, so the two cannot disagree.
 */
#ifndef MLX_DUALNORM_DUAL_RMS_NORM_KERNEL_CUH
#define MLX_DUALNORM_DUAL_RMS_NORM_KERNEL_CUH

/* Highest input rank the kernel indexes; higher ranks take the compiled
 * graph. */
#define MLX_DUALNORM_MAX_RANK 8

/* A side's rows: the strided input layout and MLX's launch shape for it. */
#define MLX_DUALNORM_KERNEL_PARAMS                        \
  struct RowLayout {                                      \
    long long strides[MLX_DUALNORM_MAX_RANK];             \
    int shape[MLX_DUALNORM_MAX_RANK];                     \
    int rank;                                             \
    int rows;                                             \
    int width;                                            \
    int block;                                            \
    int reads;                                            \
    int has_weight;                                       \
    long long weight_stride;                              \
  };                                                      \
  struct DualRmsNormParams {                              \
    RowLayout queries;                                    \
    RowLayout keys;                                       \
    float eps;                                            \
  };

#define MLX_DUALNORM_STRINGIFY_EXPANDED(...) #__VA_ARGS__
#define MLX_DUALNORM_STRINGIFY(...) MLX_DUALNORM_STRINGIFY_EXPANDED(__VA_ARGS__)

namespace mlx_dualnorm_fused {

inline constexpr const char* kDualRmsNormKernelSource =
    MLX_DUALNORM_STRINGIFY(MLX_DUALNORM_KERNEL_PARAMS) R"cuda(
typedef unsigned short bits16;

/* Offset of the first element of `row` (rows enumerate every axis but the
 * last, in row-major order). */
__device__ __forceinline__ long long row_start(const RowLayout& layout, long long row) {
  long long offset = 0;
  for (int axis = layout.rank - 2; axis >= 0; --axis) {
    offset += (row % layout.shape[axis]) * layout.strides[axis];
    row /= layout.shape[axis];
  }
  return offset;
}

struct Float32Storage {
  typedef float storage;
  static __device__ __forceinline__ float to_float(float value) { return value; }
  static __device__ __forceinline__ float round(float value) { return value; }
  static __device__ __forceinline__ float multiply(float a, float b) { return __fmul_rn(a, b); }
};

struct Float16Storage {
  typedef bits16 storage;
  static __device__ __forceinline__ float to_float(bits16 value) {
    float result;
    asm("cvt.f32.f16 %0, %1;" : "=f"(result) : "h"(value));
    return result;
  }
  static __device__ __forceinline__ bits16 round(float value) {
    bits16 result;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(result) : "f"(value));
    return result;
  }
  static __device__ __forceinline__ bits16 multiply(bits16 a, bits16 b) {
    bits16 result;
    asm("mul.rn.f16 %0, %1, %2;" : "=h"(result) : "h"(a), "h"(b));
    return result;
  }
};

struct BFloat16Storage {
  typedef bits16 storage;
  static __device__ __forceinline__ float to_float(bits16 value) {
    return __uint_as_float(static_cast<unsigned int>(value) << 16);
  }
  static __device__ __forceinline__ bits16 round(float value) {
    bits16 result;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(result) : "f"(value));
    return result;
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

template <typename Storage>
__device__ void normalize_row(
    const typename Storage::storage* input,
    const typename Storage::storage* weight,
    typename Storage::storage* output,
    const RowLayout& layout, long long row_index, float eps) {
  __shared__ float warp_sums[32];
  const typename Storage::storage* row = input + row_start(layout, row_index);
  const long long element_stride = layout.strides[layout.rank - 1];
  typename Storage::storage* out = output + row_index * layout.width;
  const int width = layout.width;
  const int row_block = layout.block;
  const int row_reads = layout.reads;
  const bool has_weight = layout.has_weight != 0;
  const int thread = threadIdx.x;
  const bool owns_elements = thread < row_block;
  const int vectors = (width + row_reads - 1) / row_reads;
  const int chunks = (vectors + row_block - 1) / row_block;

  float sum_of_squares = 0.0f;
  if (owns_elements) {
    for (int chunk = 0; chunk < chunks; ++chunk) {
      const int first = (chunk * row_block + thread) * row_reads;
      for (int j = 0; j < row_reads; ++j) {
        const int element = first + j;
        const float x = element < width ? Storage::to_float(row[element * element_stride]) : 0.0f;
        sum_of_squares = __fmaf_rn(x, x, sum_of_squares);
      }
    }
  }
  sum_of_squares = warp_butterfly_sum(sum_of_squares);
  const int warp = thread >> 5;
  const int lane = thread & 31;
  const int warps = blockDim.x >> 5;
  if (warps > 1) {
    if (lane == 0) {
      warp_sums[warp] = sum_of_squares;
    }
    __syncthreads();
    sum_of_squares = warp_butterfly_sum(lane < warps ? warp_sums[lane] : 0.0f);
  }
  const float normalizer =
      rsqrtf(__fadd_rn(__fdiv_rn(sum_of_squares, static_cast<float>(width)), eps));

  if (owns_elements) {
    for (int chunk = 0; chunk < chunks; ++chunk) {
      const int first = (chunk * row_block + thread) * row_reads;
      for (int j = 0; j < row_reads; ++j) {
        const int element = first + j;
        if (element < width) {
          const typename Storage::storage normalized =
              Storage::round(__fmul_rn(Storage::to_float(row[element * element_stride]), normalizer));
          out[element] = has_weight
                             ? Storage::multiply(weight[element * layout.weight_stride], normalized)
                             : normalized;
        }
      }
    }
  }
}

template <typename Storage>
__device__ void dual_rms_norm(
    const typename Storage::storage* queries, const typename Storage::storage* keys,
    const typename Storage::storage* query_weight, const typename Storage::storage* key_weight,
    typename Storage::storage* normalized_queries, typename Storage::storage* normalized_keys,
    const DualRmsNormParams& params) {
  const long long block_row = blockIdx.x;
  if (block_row < params.queries.rows) {
    normalize_row<Storage>(queries, query_weight, normalized_queries, params.queries,
                           block_row, params.eps);
  } else {
    normalize_row<Storage>(keys, key_weight, normalized_keys, params.keys,
                           block_row - params.queries.rows, params.eps);
  }
}

#define MLX_DUALNORM_DEFINE_DUAL_RMS_NORM(NAME, STORAGE)                              \
  extern "C" __global__ void NAME(                                                   \
      const STORAGE::storage* queries, const STORAGE::storage* keys,                 \
      const STORAGE::storage* query_weight, const STORAGE::storage* key_weight,      \
      STORAGE::storage* normalized_queries, STORAGE::storage* normalized_keys,       \
      const DualRmsNormParams params) {                                              \
    dual_rms_norm<STORAGE>(queries, keys, query_weight, key_weight,                  \
                           normalized_queries, normalized_keys, params);             \
  }

MLX_DUALNORM_DEFINE_DUAL_RMS_NORM(mlx_dualnorm_dual_rms_norm_float32, Float32Storage)
MLX_DUALNORM_DEFINE_DUAL_RMS_NORM(mlx_dualnorm_dual_rms_norm_float16, Float16Storage)
MLX_DUALNORM_DEFINE_DUAL_RMS_NORM(mlx_dualnorm_dual_rms_norm_bfloat16, BFloat16Storage)
)cuda";

} // namespace mlx_dualnorm_fused

#endif
