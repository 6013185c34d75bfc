/* The route of a dual head norm + RoPE call with a KV-cache write
 * (internal; dual_head_norm_rope_cache_route.c). The public entry that
 * takes this call (dual_head_norm_rope_cache.h) is dual_head_norm_rope.c's,
 * with every other entry of the family.
 */
#ifndef MLX_DUALNORM_PRIVATE_DUAL_HEAD_NORM_ROPE_CACHE_ROUTE_H
#define MLX_DUALNORM_PRIVATE_DUAL_HEAD_NORM_ROPE_CACHE_ROUTE_H

#include "private/dual_head_norm_rope_checks.h"
#include "private/dual_head_norm_rope_common.h"

/* The route of a call with a cache write, its checks done (`facts`): the
 * fused launch with the write where it takes it, else the fused launch or
 * the cache graph, then MLX's slice updates, then with `fetch` the rows
 * fetched. `*res` is set only on success. */
int dualnorm_apply_dual_head_norm_rope_with_cache(
    mlx_vector_array* res, mlx_dualnorm_dual_head_norm_rope* dual_head_norm_rope,
    const dual_head_norm_rope_facts* facts, const mlx_dualnorm_rope_inputs* inputs,
    const mlx_dualnorm_cache_write* cache_write, mlx_dualnorm_error* error);

#endif
