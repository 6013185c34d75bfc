/* Closures: C functions MLX can call and transform (upstream mlx-c v0.6.0
 * names and signatures).
 *
 * ctx owns a heap std::function<std::vector<array>(const std::vector<array>&)>.
 * When MLX calls the closure, the C function receives a fresh input vector
 * it must NOT free (the closure frees it) and a pointer to an empty result
 * handle it fills (the closure takes it over). A non-zero return, or a
 * result left empty, makes the call fail: the closure throws, and the
 * failure surfaces as the return code of whatever applied it
 * (mlx_closure_apply, a compiled closure, ...) with a message naming
 * mlx_closure (mlx_vector_array for an empty result).
 */
#ifndef MLX_CLOSURE_H
#define MLX_CLOSURE_H

#include "mlx/c/array.h"
#include "mlx/c/vector.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mlx_closure_ {
  void* ctx;
} mlx_closure;

mlx_closure mlx_closure_new(void);
int mlx_closure_free(mlx_closure cls);

/* Wraps a plain C function. */
mlx_closure mlx_closure_new_func(
    int (*fun)(mlx_vector_array*, const mlx_vector_array));

/* Wraps a C function that also receives `payload`. The closure (and every
 * copy MLX keeps of it, compiled ones included) shares ownership of
 * `payload`; `dtor`, when not NULL, runs once the last copy is gone. */
mlx_closure mlx_closure_new_func_payload(
    int (*fun)(mlx_vector_array*, const mlx_vector_array, void*),
    void* payload,
    void (*dtor)(void*));

/* Calls the closure on `input`, setting `*res` (allocated when empty). */
int mlx_closure_apply(
    mlx_vector_array* res,
    mlx_closure cls,
    const mlx_vector_array input);

#ifdef __cplusplus
}
#endif

#endif
