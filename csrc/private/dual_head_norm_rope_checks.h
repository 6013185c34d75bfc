/* The dual head norm + RoPE's checks and route choice (internal;
 * dual_head_norm_rope_checks.c): every input read and checked once per
 * call, and the facts read choose the route. They read the object's
 * constants (dual_head_norm_rope_object.h) and call nothing of the family.
 */
#ifndef MLX_DUALNORM_PRIVATE_DUAL_HEAD_NORM_ROPE_CHECKS_H
#define MLX_DUALNORM_PRIVATE_DUAL_HEAD_NORM_ROPE_CHECKS_H

#include <stdbool.h>
#include <stddef.h>

#include "private/dual_head_norm_rope_common.h"
#include "private/head_norm_input.h"

enum {
  /* The compiled graphs' bound, with or without the cache write, in
   * elements of queries and keys together: 128 rows of 128. Larger calls
   * (prefill) take the plain builder (dual_head_norm_rope.c says why). */
  COMPILED_GRAPH_MAX_ELEMENTS = 16384,
};

/* What one call knows about the RoPE offset, read once. */
typedef struct rope_offset_input {
  size_t rank;
  size_t size;
} rope_offset_input;

/* What the checks read of one call's inputs, once, and the route they
 * choose: `fused` where FUSED mode's kernel takes the call. */
typedef struct dual_head_norm_rope_facts {
  dual_head_norm_call sides;
  rope_offset_input offset;
  bool fused;
} dual_head_norm_rope_facts;

/* The constructor's argument checks, before anything is allocated (the
 * epsilon only where the object `normalizes`). */
int dualnorm_check_dual_head_norm_rope_constants(bool normalizes, double rms_norm_epsilon,
                                                 const mlx_dualnorm_rope_parameters* rope,
                                                 mlx_dualnorm_error* error);

/* A call's start and route, failures labelled `operation`: the pointers,
 * every input read and checked once into `*facts` (the cache write's too,
 * where `cache_write` is not NULL), the thread noted as applying the
 * graphs the call may run (its queued erasures done), then `facts->fused`
 * set where FUSED mode's kernel takes the call. Nothing is built. */
int dualnorm_check_dual_head_norm_rope_call(
    const mlx_vector_array* res, const mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
    const mlx_dualnorm_rope_inputs* inputs, const mlx_dualnorm_cache_write* cache_write,
    const char* operation, dual_head_norm_rope_facts* facts, mlx_dualnorm_error* error);

/* The compiled graph for decode-sized, non-empty calls, with or without the
 * cache write; the plain builder otherwise. */
bool dualnorm_takes_compiled_graph(const mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
                                   const dual_head_norm_call* sides);

/* Whether the fused backend writes the cache in the norm + RoPE's launch:
 * it can, and the values and both buffers have the queries' dtype (a
 * write that casts takes MLX's slice updates, which cast as indexing
 * does). */
bool dualnorm_one_launch_writes_cache(
    const mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
    const dual_head_norm_call* sides, const mlx_dualnorm_cache_write* cache_write);

#endif
