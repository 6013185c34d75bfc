/* The dual head norm + RoPE's cache graph builder, and the writes and
 * fetches it shares with the fused route (internal;
 * dual_head_norm_rope_cache_graph.c). Like the norm + RoPE's builder, it
 * knows nothing of the object.
 */
#ifndef MLX_DUALNORM_PRIVATE_DUAL_HEAD_NORM_ROPE_CACHE_GRAPH_H
#define MLX_DUALNORM_PRIVATE_DUAL_HEAD_NORM_ROPE_CACHE_GRAPH_H

#include <stddef.h>

#include "private/dual_head_norm_rope_common.h"

/* The plain cache closure of one weight set (a dualnorm_new_plain_graph,
 * weight_set_graphs.h): `constants` is a dual_head_norm_rope_constants,
 * borrowed. Inputs: the norm + RoPE graph's, then values, key_cache,
 * value_cache and the write offset; outputs as
 * dualnorm_publish_cache_outputs. */
mlx_closure dualnorm_new_dual_head_norm_rope_cache_graph(const void* constants, int weight_set);

/* Sets `*res` (owned by the caller) to a cache write's three outputs, in
 * the caller's ABI order, published once at the end: the rotated queries
 * of `rotated` (the norm + RoPE's two outputs, borrowed), then both buffers
 * with rows [w, w + L) written from the cache inputs at
 * `inputs[first_cache_input]` onwards (borrowed), on the default device's
 * stream as mlx-lm's indexing writes. With `constant_row` NULL the row is
 * the write-offset input, an int32 scalar read when the graph runs (MLX's
 * DynamicSliceUpdate: a trace replays at every row); else it is
 * *constant_row, MLX's SliceUpdate, what mlx-lm's indexing builds, for the
 * eager fused route. Every handle made here is freed on every path. */
int dualnorm_publish_cache_outputs(mlx_vector_array* res, const mlx_vector_array rotated,
                                   const mlx_vector_array inputs, size_t first_cache_input,
                                   const int* constant_row);

/* Sets `*res` to the outputs of a cache write, `written` (borrowed: rotated
 * queries, both buffers written) followed by rows [0, end) of both
 * buffers, MLX slices on the default device's stream: what the class's
 * `buffer[..., :end, :]` fetches (the graphs cannot hold them: their
 * shape changes at every decode step). Every handle made here is freed
 * on every path; `*res` is set only once everything is built. */
int dualnorm_publish_with_fetched_rows(mlx_vector_array* res, const mlx_vector_array written,
                                       int end);

#endif
