"""mlx/c/error.h"""

TYPES = """
typedef void (*mlx_error_handler_func)(const char* msg, void* data);
"""

FUNCTIONS = """
void mlx_set_error_handler(mlx_error_handler_func handler, void* data,
                           void (*dtor)(void*));
"""
