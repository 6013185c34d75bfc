"""mlx/c/closure.h"""

TYPES = """
typedef struct mlx_closure_ { void* ctx; } mlx_closure;
"""

FUNCTIONS = """
mlx_closure mlx_closure_new(void);
int mlx_closure_free(mlx_closure cls);
mlx_closure mlx_closure_new_func(int (*fun)(mlx_vector_array*, const mlx_vector_array));
mlx_closure mlx_closure_new_func_payload(
    int (*fun)(mlx_vector_array*, const mlx_vector_array, void*),
    void* payload, void (*dtor)(void*));
int mlx_closure_apply(mlx_vector_array* res, mlx_closure cls, const mlx_vector_array input);
"""
