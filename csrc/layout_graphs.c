/* An object's graphs, one per weight layout (see private/layout_graphs.h). */
#include "private/layout_graphs.h"

#include "private/compile_erasure.h"

/* The layout of a call with (or without) each weight. */
static int weight_layout(bool has_query_weight, bool has_key_weight) {
  return (has_query_weight ? QUERY_WEIGHTED_LAYOUT : 0) |
         (has_key_weight ? KEY_WEIGHTED_LAYOUT : 0);
}

int dualnorm_compile_layout_graphs(dualnorm_layout_graphs* graphs, mlx_dualnorm_mode mode,
                                   dualnorm_new_plain_graph new_plain_graph, const void* owner,
                                   const uint64_t* compile_constants, size_t constant_count) {
  dualnorm_new_compile_ids(graphs->compile_ids, WEIGHT_LAYOUT_COUNT);
  /* Every handle is made first, so a failure leaves handles that release
   * frees, whatever was not made. */
  for (int layout = 0; layout < WEIGHT_LAYOUT_COUNT; ++layout) {
    graphs->compiled[layout] = mlx_closure_new();
    graphs->plain[layout] = new_plain_graph(owner, layout);
  }
  for (int layout = 0; layout < WEIGHT_LAYOUT_COUNT; ++layout) {
    if (graphs->plain[layout].ctx == NULL) {
      return 1;
    }
    if (mode != MLX_DUALNORM_MODE_COMPOSED &&
        mlx_detail_compile(&graphs->compiled[layout], graphs->plain[layout],
                           graphs->compile_ids[layout], /* shapeless: */ false,
                           compile_constants, constant_count) != 0) {
      return 1;
    }
  }
  return 0;
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
