/* What both composites of mlx_dualnorm share: the status every fallible
 * call returns, the modes an object runs in, the error record a failed
 * call fills, the part of a fused backend both share, and the process-wide
 * set-up.
 *
 * dual_head_norm.h (the dual head norm) and dual_head_norm_rope.h (the
 * dual head norm + RoPE) include this header; a program includes those.
 *
 * Errors travel with the call: every fallible entry point takes an
 * `mlx_dualnorm_error*` (NULL when the caller does not want the details)
 * that it fills before it returns a non-zero status. Nothing is left in
 * shared or thread-local state for the caller to collect later.
 *
 * Every object (mlx_dualnorm_compiled_dual_head_norm,
 * mlx_dualnorm_dual_head_norm_rope) has one life cycle, stated here once:
 * - _new gives the caller an object it owns; _free releases it.
 * - _apply BORROWS its inputs: it never frees them, and only the lazy
 *   outputs reference them. It fills `*res` (allocated when empty, owned by
 *   the caller) with exactly the outputs its header names, in that order.
 *   Applies are thread-safe.
 * - _close releases the compiled graphs and their entries in every
 *   thread's compile cache (the calling thread's at once, any other
 *   thread's at that thread's next apply or its exit), after waiting for
 *   the applies in flight. Later applies fail with MLX_DUALNORM_CLOSED (the
 *   struct outlives _close, so a late caller gets that status, never a
 *   dangling pointer). Closing twice is a no-op.
 * - _free closes (if still open) and frees; NULL is a no-op. The caller
 *   must ensure no other thread still uses the pointer. A failure to close
 *   is not reported: freeing runs in finalizers, where nobody could act on
 *   it.
 */
#ifndef MLX_DUALNORM_DUAL_HEAD_NORM_COMMON_H
#define MLX_DUALNORM_DUAL_HEAD_NORM_COMMON_H

#include <stdbool.h>
#include <stddef.h>

#include "mlx/c/mlx.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum mlx_dualnorm_status_ {
  MLX_DUALNORM_OK = 0,
  /* MLX itself failed; the description is MLX's first message. */
  MLX_DUALNORM_MLX_FAILURE = 1,
  /* An input the composed path would reject, or one a compiled replay
   * would not check (a weight whose length is not the width, nor, for the
   * norm + RoPE, the width times the heads). */
  MLX_DUALNORM_INVALID_ARGUMENT = 2,
  /* The object was closed. */
  MLX_DUALNORM_CLOSED = 3,
} mlx_dualnorm_status;

/* How an object runs. AUTO resolves, at construction, to FUSED where a
 * fused backend is registered, MLX has a CUDA GPU and the kernel compiles,
 * else to COMPILED. */
typedef enum mlx_dualnorm_mode_ {
  MLX_DUALNORM_MODE_AUTO = 0,
  /* The composed MLX calls, built on every call (the reference path). */
  MLX_DUALNORM_MODE_COMPOSED = 1,
  /* One replay of the compiled dual-output graph (traced once per input
   * shape). */
  MLX_DUALNORM_MODE_COMPILED = 2,
  /* One CUDA kernel launch for both inputs (fused/); inputs it does not
   * support take the compiled graph, with the same bits. */
  MLX_DUALNORM_MODE_FUSED = 3,
} mlx_dualnorm_mode;

/* What a failed call reports. `operation` is a static string, the short
 * label of the operation that failed (never freed); `description` says
 * what went wrong, for failures inside MLX MLX's own first message (the
 * root cause). The description holds at most 1023 bytes and a terminating
 * NUL. */
typedef struct mlx_dualnorm_error_ {
  mlx_dualnorm_status status;
  const char* operation;
  char description[1024];
} mlx_dualnorm_error;

/* The part of a fused CUDA backend that both composites' tables share
 * (mlx_dualnorm_fused_backend, mlx_dualnorm_fused_rope_backend: each
 * begins with one, followed by its own launch). A fused build provides the
 * tables (fused/fused_dual_head_norm.h). The composite decides which calls
 * the kernel takes (one float dtype, float32/float16/bfloat16, for every
 * input and weight; rows on both sides; rank <= max_rank; rows no wider
 * than max_width; fewer than 2^31 rows; the CUDA GPU as default device;
 * and what the operation itself adds); the backend only launches. */
typedef struct mlx_dualnorm_fused_kernel_ {
  /* True when the running MLX has a CUDA GPU. */
  bool (*available)(void);
  /* Compiles the kernel, once per process; later calls return the first
   * outcome. 0 on success; non-zero with the reason sent to mlx_error. */
  int (*prepare)(void);
  /* Highest input rank the kernel indexes. */
  int max_rank;
  /* Widest rows (last dimension) the kernel takes. */
  int max_width;
} mlx_dualnorm_fused_kernel;

/* Installs the mlx-c error handler that keeps each thread's first MLX
 * message for the call in flight (mlx-c's default handler exits the
 * process). Call once before anything else; the Python package does so at
 * import. Idempotent. */
void mlx_dualnorm_install_error_handler(void);

/* Waits, at most `timeout_ms`, until every other thread that applied an
 * object of this package has finished exiting (its thread-local
 * destructors, MLX's included, have run); returns how many have not. For
 * an interpreter's exit hook: a thread's exit runs MLX's thread-local
 * destructors, and those of MLX's Python module take the GIL, which aborts
 * the process once interpreter finalization has begun. Waiting for them
 * before finalization (with the GIL released) lets them finish. */
size_t mlx_dualnorm_await_thread_exits(unsigned timeout_ms);

/* How many compile-cache entries are held for threads other than their
 * owners: ids queued for a thread's next apply plus the open objects each
 * thread noted it applied. It grows only with objects a thread applied
 * itself, never with what other threads create and close; for tests and
 * soak runs that check closing costs bounded memory. */
size_t mlx_dualnorm_pending_erasure_entries(void);

#ifdef __cplusplus
}
#endif

#endif
