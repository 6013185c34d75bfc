/* An object's graphs, one per weight set (see private/weight_set_graphs.h). */
#include "private/weight_set_graphs.h"

#include "private/compile_erasure.h"

/* The weight set of a call with (or without) each weight. */
static int weight_set_of(bool has_query_weight, bool has_key_weight) {
  return (has_query_weight ? WEIGHT_SET_QUERY : 0) |
         (has_key_weight ? WEIGHT_SET_KEY : 0);
}

int dualnorm_compile_weight_set_graphs(dualnorm_weight_set_graphs* graphs,
                                       mlx_dualnorm_mode mode,
                                       dualnorm_new_plain_graph new_plain_graph,
                                       const void* owner, const uint64_t* compile_constants,
                                       size_t constant_count) {
  dualnorm_new_compile_ids(graphs->compile_ids, WEIGHT_SET_COUNT);
  /* Every handle is made first, so a failure leaves handles that release
   * frees, whatever was not made. */
  for (int weight_set = 0; weight_set < WEIGHT_SET_COUNT; ++weight_set) {
    graphs->compiled[weight_set] = mlx_closure_new();
    graphs->plain[weight_set] = new_plain_graph(owner, weight_set);
  }
  for (int weight_set = 0; weight_set < WEIGHT_SET_COUNT; ++weight_set) {
    if (graphs->plain[weight_set].ctx == NULL) {
      return 1;
    }
    if (mode != MLX_DUALNORM_MODE_COMPOSED &&
        mlx_detail_compile(&graphs->compiled[weight_set], graphs->plain[weight_set],
                           graphs->compile_ids[weight_set], /* shapeless: */ false,
                           compile_constants, constant_count) != 0) {
      return 1;
    }
  }
  return 0;
}

int dualnorm_release_weight_set_graphs(dualnorm_weight_set_graphs* graphs) {
  /* Composed graphs were never compiled, so erasing finds nothing; it still
   * drops the threads' notes that they applied this object. */
  int status = dualnorm_erase_compile_ids_everywhere(graphs->compile_ids, WEIGHT_SET_COUNT);
  for (int weight_set = 0; weight_set < WEIGHT_SET_COUNT; ++weight_set) {
    status |= mlx_closure_free(graphs->compiled[weight_set]);
    status |= mlx_closure_free(graphs->plain[weight_set]);
    graphs->compiled[weight_set] = mlx_closure_new();
    graphs->plain[weight_set] = mlx_closure_new();
  }
  return status;
}

mlx_vector_array dualnorm_graph_inputs(const dual_head_norm_call* call,
                                       const mlx_array* extra_input, int* weight_set) {
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
  *weight_set = weight_set_of(has_query_weight, has_key_weight);
  return mlx_vector_array_new_data(graph_inputs, input_count);
}
