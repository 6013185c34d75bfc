/* The dual head norm + RoPE's graph builder and its input vector
 * (internal; dual_head_norm_rope_graph.c). It knows nothing of the object:
 * a closure carries its own copy of the constants it builds with.
 */
#ifndef MLX_DUALNORM_PRIVATE_DUAL_HEAD_NORM_ROPE_GRAPH_H
#define MLX_DUALNORM_PRIVATE_DUAL_HEAD_NORM_ROPE_GRAPH_H

#include <stdbool.h>
#include <stddef.h>

#include "private/dual_head_norm_rope_common.h"
#include "private/head_norm_input.h"

/* What one closure's builder reads at trace time: a copy per closure,
 * owned by the closure (freed with its last copy). */
typedef struct dual_head_norm_rope_constants {
  /* false: no norms, both sides rotated as they are (no weights). */
  bool normalizes;
  float rms_norm_epsilon;
  mlx_dualnorm_rope_parameters rope;
  bool has_query_weight;
  bool has_key_weight;
} dual_head_norm_rope_constants;

/* A builder closure's function: inputs borrowed (the closure's), outputs
 * published into `*output_vector` once at the end, `payload` the closure's
 * dual_head_norm_rope_constants. */
typedef int (*dualnorm_dual_head_norm_rope_builder)(mlx_vector_array* output_vector,
                                                    const mlx_vector_array input_vector,
                                                    void* payload);

/* The plain norm + RoPE builder: inputs in
 * dualnorm_dual_head_norm_rope_graph_inputs's order; outputs the rotated
 * queries, then the rotated keys. */
int dualnorm_build_dual_head_norm_rope_graph(mlx_vector_array* output_vector,
                                             const mlx_vector_array input_vector,
                                             void* payload);

/* The inputs of a norm + RoPE graph of these constants' weight set. */
size_t dualnorm_dual_head_norm_rope_input_count(const dual_head_norm_rope_constants* constants);

/* Whether a builder got an output vector and `expected_inputs` inputs;
 * else the reason sent to mlx_error, false. */
bool dualnorm_graph_inputs_expected(const mlx_vector_array* output_vector,
                                    const mlx_vector_array input_vector, size_t expected_inputs);

/* A plain closure of `builder` for one weight set, carrying its own copy of
 * `constants` (BORROWED: only read here; its has_*_weight fields are set
 * from `weight_set`). An empty handle, with the reason sent to mlx_error,
 * on failure. */
mlx_closure dualnorm_new_builder_closure(const dual_head_norm_rope_constants* constants,
                                         int weight_set,
                                         dualnorm_dual_head_norm_rope_builder builder);

/* The plain norm + RoPE closure of one weight set (a
 * dualnorm_new_plain_graph, weight_set_graphs.h): `constants` is a
 * dual_head_norm_rope_constants, borrowed. */
mlx_closure dualnorm_new_dual_head_norm_rope_graph(const void* constants, int weight_set);

/* The norm + RoPE graph's input vector (owned by the caller): queries,
 * keys, the RoPE offset, the call's weights, then the table where the call
 * has one (the builder's input order); `*weight_set` the call's. The
 * vector takes its own references. An empty handle, with the reason sent
 * to mlx_error, on failure. */
mlx_vector_array dualnorm_dual_head_norm_rope_graph_inputs(
    const dual_head_norm_call* sides, const mlx_dualnorm_rope_inputs* inputs, int* weight_set);

#endif
