"""mlx/c/vector.h"""

TYPES = """
typedef struct mlx_vector_array_ { void* ctx; } mlx_vector_array;
"""

FUNCTIONS = """
mlx_vector_array mlx_vector_array_new(void);
int mlx_vector_array_free(mlx_vector_array vec);
mlx_vector_array mlx_vector_array_new_data(const mlx_array* data, size_t n);
int mlx_vector_array_set_data(mlx_vector_array* vec, const mlx_array* data, size_t n);
int mlx_vector_array_append_value(mlx_vector_array vec, const mlx_array val);
size_t mlx_vector_array_size(mlx_vector_array vec);
int mlx_vector_array_get(mlx_array* res, const mlx_vector_array vec, size_t idx);
"""
