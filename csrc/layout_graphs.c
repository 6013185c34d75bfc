/* An object's graphs, one per weight layout (see layout_graphs.h). */
#include "private/layout_graphs.h"

#include "private/compile_erasure.h"

/* The layout of a call with (or without) each weight. */
static int weight_layout(bool has_query_weight, bool has_key_weight) {
  return (has_query_weight ? QUERY_WEIGHTED_LAYOUT : 0) |
         (has_key_weight ? KEY_WEIGHTED_LAYOUT : 0);
}

int dualnorm_release_layout_graphs(dualnorm_layout_graphs* graphs) {
  /* Composed graphs were never compiled, so erasing finds nothing; it still
   * drops the threads' notes that they applied this object. */
  int status = dualnorm_erase_compile_ids_everywhere(graphs->compile_ids, WEIGHT_LAYOUT_COUNT);
  for (int layout = 0; layout < WEIGHT_LAYOUT_COUNT; ++layout) {
    status |= mlx_closure_free(graphs->compiled[layout]);
    status |= mlx_closure_free(graphs->plain[layout]);
    graphs->compiled[layout] = mlx_closure_new();
    graphs->plain[layout] = mlx_closure_new();
  }
  return status;
}

mlx_vector_array dualnorm_graph_inputs(const dual_head_norm_call* call,
                                       const mlx_array* extra_input, int* layout) {
  bool has_query_weight = call->queries.weight.ctx != NULL;
  bool has_key_weight = call->keys.weight.ctx != NULL;
  mlx_array graph_inputs[5] = {call->queries.array, call->keys.array};
  size_t input_count = 2;
  if (extra_input != NULL) {
    graph_inputs[input_count++] = *extra_input;
  }
  if (has_query_weight) {
    graph_inputs[input_count++] = call->queries.weight;
  }
  if (has_key_weight) {
    graph_inputs[input_count++] = call->keys.weight;
  }
  *layout = weight_layout(has_query_weight, has_key_weight);
  return mlx_vector_array_new_data(graph_inputs, input_count);
}
