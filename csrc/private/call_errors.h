/* Failure reports of the package's C entry points (internal).
 *
 * Every fallible entry point calls dualnorm_begin_call() first and, on
 * failure, fills the caller's mlx_dualnorm_error through one of the fail
 * functions before it returns. MLX's own messages reach the package through
 * the mlx-c error handler (mlx_dualnorm_install_error_handler), which keeps
 * the calling thread's FIRST message since its call began: the root cause
 * when a failure inside a graph builder propagates out through the closure
 * and the compiled graph, each layer reporting again.
 */
#ifndef MLX_DUALNORM_PRIVATE_CALL_ERRORS_H
#define MLX_DUALNORM_PRIVATE_CALL_ERRORS_H

#include "mlx_dualnorm/dual_head_norm_common.h"

/* Forgets the calling thread's MLX message: the start of an entry point. */
void dualnorm_begin_call(void);

/* Fills `error` (when not NULL) and returns `status`. */
int dualnorm_fail_with(mlx_dualnorm_error* error, mlx_dualnorm_status status,
                       const char* operation, const char* format, ...)
    __attribute__((format(printf, 4, 5)));

/* An MLX failure while doing `operation`: the description is MLX's first
 * message since the call began. Returns MLX_DUALNORM_MLX_FAILURE. */
int dualnorm_fail_in_mlx(mlx_dualnorm_error* error, const char* operation);

/* The end of a step that owned `vector`: frees it and returns `status`,
 * or, where the step succeeded but the free failed, the MLX failure of
 * `operation`. */
int dualnorm_free_vector_after(int status, mlx_vector_array vector, const char* operation,
                               mlx_dualnorm_error* error);

#endif
