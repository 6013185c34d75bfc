/* What every unit of the dual head norm + RoPE shares (internal): its
 * error labels, the rank of its inputs and the layout of its graphs'
 * input vectors. Definitions only, no functions.
 *
 * The family's units, each with its own private header, calls flowing
 * down this list only:
 *
 *   dual_head_norm_rope.c              the public entry points: the
 *                                      object's life cycle, every apply,
 *                                      the route
 *   dual_head_norm_rope_cache_route.c  the route of a call with a cache
 *                                      write
 *   dual_head_norm_rope_object.c       the object held open for one run:
 *                                      a graph or a fused launch
 *   dual_head_norm_rope_checks.c       every input read and checked once;
 *                                      the fused kernel's conditions
 *   dual_head_norm_rope_cache_graph.c  the cache graph builder and the
 *                                      writes and fetches it shares
 *   dual_head_norm_rope_graph.c        the norm + RoPE graph builder and
 *                                      its input vector
 *
 * dual_head_norm_rope.c's file comment says what the composite does and
 * why; each unit's header says what its functions own and free.
 */
#ifndef MLX_DUALNORM_PRIVATE_DUAL_HEAD_NORM_ROPE_COMMON_H
#define MLX_DUALNORM_PRIVATE_DUAL_HEAD_NORM_ROPE_COMMON_H

#include "mlx_dualnorm/dual_head_norm_rope.h"
#include "mlx_dualnorm/dual_head_norm_rope_cache.h"

/* The labels of the errors, as MLX writes "[rope] ...": construction and
 * apply are the operation itself. Static strings: an error record keeps a
 * pointer to them. */
static const char DUALNORM_DUAL_HEAD_NORM_ROPE_OPERATION[] = "dual_head_norm_rope";
static const char DUALNORM_DUAL_HEAD_NORM_ROPE_CACHE_OPERATION[] =
    "dual_head_norm_rope_with_cache";

enum {
  /* (batch, sequence, heads, head dim): the rank of every input but the
   * offset, the weights and the table. */
  ATTENTION_INPUT_RANK = 4,
  /* The norm + RoPE graph's inputs: queries, keys and the RoPE offset
   * always, then at most the two weights and the frequency table. */
  DUAL_HEAD_NORM_ROPE_FIXED_INPUTS = 3,
  DUAL_HEAD_NORM_ROPE_MAX_INPUTS = DUAL_HEAD_NORM_ROPE_FIXED_INPUTS + 3,
  /* The cache graph's inputs past the norm + RoPE's, in this order:
   * values, key_cache, value_cache, the write offset. */
  CACHE_GRAPH_EXTRA_INPUTS = 4,
};

/* (B, L, H, D) -> (B, H, L, D), as mlx-lm's attention transposes. */
static const int DUALNORM_HEAD_MAJOR_AXES[ATTENTION_INPUT_RANK] = {0, 2, 1, 3};

#endif
