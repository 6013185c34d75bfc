"""mlx/c/stream.h"""

TYPES = """
typedef struct mlx_stream_ { void* ctx; } mlx_stream;
"""

FUNCTIONS = """
mlx_stream mlx_stream_new(void);
int mlx_stream_free(mlx_stream stream);
int mlx_get_default_stream(mlx_stream* stream, mlx_device dev);
mlx_stream mlx_default_cpu_stream_new(void);
mlx_stream mlx_default_gpu_stream_new(void);
"""
