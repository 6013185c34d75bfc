"""mlx/c/device.h"""

TYPES = """
typedef enum mlx_device_type_ { MLX_CPU, MLX_GPU } mlx_device_type;
typedef struct mlx_device_ { void* ctx; } mlx_device;
"""

FUNCTIONS = """
mlx_device mlx_device_new(void);
mlx_device mlx_device_new_type(mlx_device_type type, int index);
int mlx_device_free(mlx_device dev);
int mlx_get_default_device(mlx_device* dev);
int mlx_device_get_type(mlx_device_type* type, mlx_device dev);
"""
