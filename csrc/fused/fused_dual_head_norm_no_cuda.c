/* The fused backend tables in a build without MLX's CUDA backend headers:
 * both report the fused mode unavailable, so mode AUTO resolves to
 * COMPILED and mode FUSED is refused before anything would launch, and no
 * fused output comes from MLX's device pool. build_ffi.py compiles this
 * file instead of fused_dual_head_norm_cuda.cpp where it compiles no
 * primitive; the composites only ever call `available` here, and the
 * other entries fail with the reason should a caller reach them anyway.
 */
#include "fused/fused_dual_head_norm.h"

static const char BUILT_WITHOUT_CUDA[] =
    "mlx_dualnorm was built without MLX's CUDA headers: no fused kernel";

static bool fused_mode_available(void) {
  return false;
}

static int prepare_no_dual_head_norm(void) {
  mlx_error("[fused_dual_head_norm] %s", BUILT_WITHOUT_CUDA);
  return 1;
}

static int prepare_no_dual_head_norm_rope(void) {
  mlx_error("[fused_dual_head_norm_rope] %s", BUILT_WITHOUT_CUDA);
  return 1;
}

static int launch_no_dual_head_norm(mlx_vector_array* res, const mlx_array queries,
                                   const mlx_array keys, const mlx_array query_scale_weight,
                                   const mlx_array key_scale_weight, float rms_norm_epsilon) {
  (void)res, (void)queries, (void)keys, (void)query_scale_weight, (void)key_scale_weight;
  (void)rms_norm_epsilon;
  mlx_error("[fused_dual_head_norm] %s", BUILT_WITHOUT_CUDA);
  return 1;
}

static int launch_no_dual_head_norm_rope(mlx_vector_array* res,
                                        const mlx_dualnorm_rope_inputs* inputs,
                                        const mlx_dualnorm_cache_write* cache_write,
                                        bool normalizes, float rms_norm_epsilon,
                                        mlx_dualnorm_rope_parameters rope) {
  (void)res, (void)inputs, (void)cache_write, (void)normalizes, (void)rms_norm_epsilon;
  (void)rope;
  mlx_error("[fused_dual_head_norm_rope] %s", BUILT_WITHOUT_CUDA);
  return 1;
}

/* No rank and no width: the kernel takes no call. */
static const mlx_dualnorm_fused_backend fused_backend = {
    .kernel = {fused_mode_available, prepare_no_dual_head_norm, 0, 0},
    .apply = launch_no_dual_head_norm,
};

static const mlx_dualnorm_fused_rope_backend fused_rope_backend = {
    .kernel = {fused_mode_available, prepare_no_dual_head_norm_rope, 0, 0},
    .apply = launch_no_dual_head_norm_rope,
    .writes_cache = false,
};

const mlx_dualnorm_fused_backend* mlx_dualnorm_fused_backend_table(void) {
  return &fused_backend;
}

const mlx_dualnorm_fused_rope_backend* mlx_dualnorm_fused_rope_backend_table(void) {
  return &fused_rope_backend;
}

bool mlx_dualnorm_fused_outputs_in_device_pool(void) {
  return false;
}
