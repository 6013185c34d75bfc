"""mlx/c/compile.h"""

TYPES = ""

FUNCTIONS = """
int mlx_compile(mlx_closure* res, const mlx_closure fun, bool shapeless);
int mlx_detail_compile(mlx_closure* res, const mlx_closure fun, uintptr_t fun_id,
                       bool shapeless, const uint64_t* constants, size_t num_constants);
int mlx_detail_compile_erase(uintptr_t fun_id);
int mlx_detail_compile_clear_cache(void);
int mlx_disable_compile(void);
int mlx_enable_compile(void);
"""
