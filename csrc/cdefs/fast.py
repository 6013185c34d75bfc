"""mlx/c/fast.h"""

TYPES = ""

FUNCTIONS = """
int mlx_fast_rms_norm(mlx_array* res, const mlx_array x, const mlx_array weight,
                      float eps, const mlx_stream s);
"""
