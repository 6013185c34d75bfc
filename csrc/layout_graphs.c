/* An object's graphs, one per weight layout (see layout_graphs.h). */
#include "layout_graphs.h"

#include "compile_erasure.h"

int dualnorm_weight_layout(bool has_query_weight, bool has_key_weight) {
  return (has_query_weight ? QUERY_WEIGHTED_LAYOUT : 0) |
         (has_key_weight ? KEY_WEIGHTED_LAYOUT : 0);
}

int dualnorm_release_layout_graphs(dualnorm_layout_graphs* graphs, bool were_compiled) {
  int status = 0;
  if (were_compiled) {
    status |= dualnorm_erase_compile_ids_everywhere(graphs->compile_ids, WEIGHT_LAYOUT_COUNT);
  }
  for (int layout = 0; layout < WEIGHT_LAYOUT_COUNT; ++layout) {
    status |= mlx_closure_free(graphs->compiled[layout]);
    status |= mlx_closure_free(graphs->plain[layout]);
    graphs->compiled[layout] = mlx_closure_new();
    graphs->plain[layout] = mlx_closure_new();
  }
  return status;
}
