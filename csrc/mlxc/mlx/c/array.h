/* MLX arrays (upstream mlx-c v0.6.0 names and signatures).
 *
 * An mlx_array is a one-pointer handle; ctx owns a heap mlx::core::array,
 * i.e. a reference to a possibly unevaluated node of MLX's lazy graph. An
 * empty handle (ctx NULL) holds nothing. Whoever receives a handle from a
 * `_new` function or an out-parameter owns it and frees it with
 * mlx_array_free; freeing drops one reference, never the data under other
 * references.
 */
#ifndef MLX_ARRAY_H
#define MLX_ARRAY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types, in MLX's own order. */
typedef enum mlx_dtype_ {
  MLX_BOOL,
  MLX_UINT8,
  MLX_UINT16,
  MLX_UINT32,
  MLX_UINT64,
  MLX_INT8,
  MLX_INT16,
  MLX_INT32,
  MLX_INT64,
  MLX_FLOAT16,
  MLX_FLOAT32,
  MLX_FLOAT64,
  MLX_BFLOAT16,
  MLX_COMPLEX64,
} mlx_dtype;

/* Size in bytes of one element of `dtype` (0, with an error reported, for
 * a value outside the enum). */
size_t mlx_dtype_size(mlx_dtype dtype);

typedef struct mlx_array_ {
  void* ctx;
} mlx_array;

/* An empty handle: holds no array until set by an out-parameter. */
mlx_array mlx_array_new(void);

/* Drops the handle's reference. Freeing an empty handle is a no-op. */
int mlx_array_free(mlx_array arr);

/* A new evaluated array holding a COPY of `data` (row-major, `dim` extents in
 * `shape`, elements of `dtype`). Returns an empty handle on error. */
mlx_array mlx_array_new_data(
    const void* data,
    const int* shape,
    int dim,
    mlx_dtype dtype);

/* Makes `*arr` refer to the same graph node as `src` (no copy). */
int mlx_array_set(mlx_array* arr, const mlx_array src);

/* Properties of a non-empty array. For an empty handle they report an
 * error and return 0 (NULL for the shape, MLX_BOOL for the dtype). */
size_t mlx_array_itemsize(const mlx_array arr);
size_t mlx_array_size(const mlx_array arr);
size_t mlx_array_nbytes(const mlx_array arr);
size_t mlx_array_ndim(const mlx_array arr);

/* Borrowed pointer to ndim extents, valid while `arr` is alive. */
const int* mlx_array_shape(const mlx_array arr);
int mlx_array_dim(const mlx_array arr, int dim);
mlx_dtype mlx_array_dtype(const mlx_array arr);

/* Evaluates the graph behind `arr` (blocking). */
int mlx_array_eval(mlx_array arr);

/* Borrowed pointer to the data of an EVALUATED array, read as the
 * accessor's element type WHATEVER the array's dtype (as upstream: pick the
 * accessor that matches mlx_array_dtype). NULL, with an error reported, for
 * an empty handle or an array that is not evaluated. The data of a
 * non-contiguous array follows its strides, as in MLX. */
const bool* mlx_array_data_bool(const mlx_array arr);
const uint8_t* mlx_array_data_uint8(const mlx_array arr);
const uint16_t* mlx_array_data_uint16(const mlx_array arr);
const uint32_t* mlx_array_data_uint32(const mlx_array arr);
const uint64_t* mlx_array_data_uint64(const mlx_array arr);
const int8_t* mlx_array_data_int8(const mlx_array arr);
const int16_t* mlx_array_data_int16(const mlx_array arr);
const int32_t* mlx_array_data_int32(const mlx_array arr);
const int64_t* mlx_array_data_int64(const mlx_array arr);
const float* mlx_array_data_float32(const mlx_array arr);
const double* mlx_array_data_float64(const mlx_array arr);

#ifdef __cplusplus
}
#endif

#endif
