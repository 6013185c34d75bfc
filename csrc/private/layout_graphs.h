/* An object's graphs, one per weight layout (internal).
 *
 * Both composites keep, per weight layout (which of the two sides has a
 * scale weight), a plain builder closure, its compiled form (empty in
 * composed mode) and the compile id it was compiled under. This is how they
 * are indexed, made and released.
 */
#ifndef MLX_DUALNORM_PRIVATE_LAYOUT_GRAPHS_H
#define MLX_DUALNORM_PRIVATE_LAYOUT_GRAPHS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "mlx/c/mlx.h"

#include "dual_head_norm_common.h"
#include "private/head_norm_input.h"

/* Weight layouts, indexing the graphs: bit 0 = a query weight, bit 1 = a
 * key weight. */
enum {
  WEIGHTLESS_LAYOUT = 0,
  QUERY_WEIGHTED_LAYOUT = 1,
  KEY_WEIGHTED_LAYOUT = 2,
  WEIGHTED_LAYOUT = 3,
  WEIGHT_LAYOUT_COUNT = 4,
};

/* Owned closures and their ids; every handle empty once released. */
typedef struct dualnorm_layout_graphs {
  mlx_closure plain[WEIGHT_LAYOUT_COUNT];
  mlx_closure compiled[WEIGHT_LAYOUT_COUNT];
  uintptr_t compile_ids[WEIGHT_LAYOUT_COUNT];
} dualnorm_layout_graphs;

/* The input vector of a call's graph: queries, keys, then `extra_input`
 * when it is not NULL (the RoPE offset), then the query weight and the key
 * weight where the call has them; `*layout` is the call's weight layout.
 * The vector takes its own references (the call's handles stay borrowed)
 * and belongs to the caller; an empty handle, with the reason sent to
 * mlx_error, on failure. */
mlx_vector_array dualnorm_graph_inputs(const dual_head_norm_call* call,
                                       const mlx_array* extra_input, int* layout);

/* Makes one layout's plain builder closure for `owner` (an empty handle,
 * with the reason sent to mlx_error, on failure). */
typedef mlx_closure (*dualnorm_new_plain_graph)(const void* owner, int layout);

/* Fills `graphs` (all empty on entry) for a new object: fresh compile ids,
 * every layout's plain closure from `new_plain_graph(owner, layout)` and,
 * unless `mode` is COMPOSED, its compiled form (traced per input shape,
 * never shapeless) under its id with `compile_constants`. Non-zero, with
 * the reason sent to mlx_error, on failure; whatever was made is then the
 * caller's to release with dualnorm_release_layout_graphs. */
int dualnorm_compile_layout_graphs(dualnorm_layout_graphs* graphs, mlx_dualnorm_mode mode,
                                   dualnorm_new_plain_graph new_plain_graph, const void* owner,
                                   const uint64_t* compile_constants, size_t constant_count);

/* Frees every closure, leaving empty handles, and erases their traces from
 * every thread's compile cache (compile_erasure.h). Non-zero when a free or
 * an erase failed. */
int dualnorm_release_layout_graphs(dualnorm_layout_graphs* graphs);

#endif
