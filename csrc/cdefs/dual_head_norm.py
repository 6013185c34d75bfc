"""dual_head_norm.h: the compiled dual head norm composite."""

TYPES = """
typedef enum mlx_dualnorm_status_ {
  MLX_DUALNORM_OK = 0,
  MLX_DUALNORM_MLX_FAILURE = 1,
  MLX_DUALNORM_INVALID_ARGUMENT = 2,
  MLX_DUALNORM_CLOSED = 3,
} mlx_dualnorm_status;
typedef enum mlx_dualnorm_mode_ {
  MLX_DUALNORM_MODE_AUTO = 0,
  MLX_DUALNORM_MODE_COMPOSED = 1,
  MLX_DUALNORM_MODE_COMPILED = 2,
  MLX_DUALNORM_MODE_FUSED = 3,
} mlx_dualnorm_mode;
typedef struct mlx_dualnorm_compiled_dual_head_norm_
    mlx_dualnorm_compiled_dual_head_norm;
"""

FUNCTIONS = """
void mlx_dualnorm_install_error_handler(void);
int mlx_dualnorm_compiled_dual_head_norm_new(
    mlx_dualnorm_compiled_dual_head_norm** res, float rms_norm_epsilon,
    mlx_dualnorm_mode mode);
mlx_dualnorm_mode mlx_dualnorm_compiled_dual_head_norm_mode(
    const mlx_dualnorm_compiled_dual_head_norm* dual_head_norm);
float mlx_dualnorm_compiled_dual_head_norm_epsilon(
    const mlx_dualnorm_compiled_dual_head_norm* dual_head_norm);
int mlx_dualnorm_apply_compiled_dual_head_norm(
    mlx_vector_array* res, mlx_dualnorm_compiled_dual_head_norm* dual_head_norm,
    const mlx_array queries, const mlx_array keys,
    const mlx_array query_scale_weight, const mlx_array key_scale_weight);
int mlx_dualnorm_compiled_dual_head_norm_close(
    mlx_dualnorm_compiled_dual_head_norm* dual_head_norm);
void mlx_dualnorm_compiled_dual_head_norm_free(
    mlx_dualnorm_compiled_dual_head_norm* dual_head_norm);
mlx_dualnorm_status mlx_dualnorm_last_error_status(void);
const char* mlx_dualnorm_last_error_operation(void);
const char* mlx_dualnorm_last_error_description(void);
void mlx_dualnorm_clear_last_error(void);
bool mlx_dualnorm_fused_backend_available(void);
"""
