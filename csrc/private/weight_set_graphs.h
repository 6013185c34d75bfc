/* An object's graphs, one per weight set (internal).
 *
 * Both composites keep, per weight set (which of the two sides has a
 * scale weight), a plain builder closure, its compiled form (empty in
 * composed mode) and the compile id it was compiled under. This is how they
 * are indexed, made and released.
 */
#ifndef MLX_DUALNORM_PRIVATE_WEIGHT_SET_GRAPHS_H
#define MLX_DUALNORM_PRIVATE_WEIGHT_SET_GRAPHS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "mlx/c/mlx.h"

#include "mlx_dualnorm/dual_head_norm_common.h"
#include "private/head_norm_input.h"

/* Weight sets, indexing the graphs: bit 0 = a query weight, bit 1 = a
 * key weight. */
enum {
  WEIGHT_SET_NONE = 0,
  WEIGHT_SET_QUERY = 1,
  WEIGHT_SET_KEY = 2,
  WEIGHT_SET_BOTH = 3,
  WEIGHT_SET_COUNT = 4,
};

/* Owned closures and their ids; every handle empty once released. */
typedef struct dualnorm_weight_set_graphs {
  mlx_closure plain[WEIGHT_SET_COUNT];
  mlx_closure compiled[WEIGHT_SET_COUNT];
  uintptr_t compile_ids[WEIGHT_SET_COUNT];
} dualnorm_weight_set_graphs;

/* The input vector of a call's graph: queries, keys, then `extra_input`
 * when it is not NULL (the RoPE offset), then the query weight and the key
 * weight where the call has them; `*weight_set` is the call's weight set.
 * The vector takes its own references (the call's handles stay borrowed)
 * and belongs to the caller; an empty handle, with the reason sent to
 * mlx_error, on failure. */
mlx_vector_array dualnorm_graph_inputs(const dual_head_norm_call* call,
                                       const mlx_array* extra_input, int* weight_set);

/* Makes one weight set's plain builder closure for `owner` (an empty handle,
 * with the reason sent to mlx_error, on failure). */
typedef mlx_closure (*dualnorm_new_plain_graph)(const void* owner, int weight_set);

/* Fills `graphs` (all empty on entry) for a new object: fresh compile ids,
 * every weight set's plain closure from `new_plain_graph(owner,
 * weight_set)` and, unless `mode` is COMPOSED, its compiled form (traced per input shape,
 * never shapeless) under its id with `compile_constants`. Non-zero, with
 * the reason sent to mlx_error, on failure; whatever was made is then the
 * caller's to release with dualnorm_release_weight_set_graphs. */
int dualnorm_compile_weight_set_graphs(dualnorm_weight_set_graphs* graphs,
                                       mlx_dualnorm_mode mode,
                                       dualnorm_new_plain_graph new_plain_graph,
                                       const void* owner, const uint64_t* compile_constants,
                                       size_t constant_count);

/* Frees every closure, leaving empty handles, and erases their traces from
 * every thread's compile cache (compile_erasure.h). Non-zero when a free or
 * an erase failed. */
int dualnorm_release_weight_set_graphs(dualnorm_weight_set_graphs* graphs);

#endif
