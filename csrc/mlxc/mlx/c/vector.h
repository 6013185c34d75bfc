/* Vectors of MLX arrays (upstream mlx-c v0.6.0 names and signatures).
 *
 * ctx owns a heap std::vector<mlx::core::array>. Elements are stored by
 * reference (no data copies); getters hand out new handles the caller frees.
 */
#ifndef MLX_VECTOR_H
#define MLX_VECTOR_H

#include <stddef.h>

#include "mlx/c/array.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mlx_vector_array_ {
  void* ctx;
} mlx_vector_array;

/* A new (non-empty) handle to a vector holding no arrays. */
mlx_vector_array mlx_vector_array_new(void);

/* Frees the vector and its references. An empty handle is a no-op. */
int mlx_vector_array_free(mlx_vector_array vec);

/* A new vector referring to the `n` arrays of `data`. */
mlx_vector_array mlx_vector_array_new_data(const mlx_array* data, size_t n);

/* Replaces the contents of `*vec` (allocating it when empty). */
int mlx_vector_array_set_data(
    mlx_vector_array* vec,
    const mlx_array* data,
    size_t n);

int mlx_vector_array_append_value(mlx_vector_array vec, const mlx_array val);

/* Number of arrays; 0, with an error reported, for an empty handle. */
size_t mlx_vector_array_size(mlx_vector_array vec);

/* Sets `*res` to the array at `idx`; fails (status 1, error reported)
 * when idx is out of range. */
int mlx_vector_array_get(mlx_array* res, const mlx_vector_array vec, size_t idx);

#ifdef __cplusplus
}
#endif

#endif
