# Sourced by the build scripts (not run): defines mlx_wheel_dir.
#
#   MLX_DIR="$(mlx_wheel_dir "$PYTHON")"
#
# Prints the folder of the installed mlx package that holds lib/libmlx.so
# and include/mlx (the wheel's C++ side), or says what to install and
# fails. mlx is a namespace package, so a stray `mlx` folder (an mlx-c
# checkout, MLX's kernel cache in /tmp) can be one of its portions: each
# portion is tried, and Python runs from / so the caller's directory
# cannot add one.
mlx_wheel_dir() {
  local python="${1:-python3}"
  (cd / && "$python" - <<'PY'
import os
import sys

import mlx

for portion in mlx.__path__:
    if os.path.isfile(os.path.join(portion, "lib", "libmlx.so")) and os.path.isdir(
        os.path.join(portion, "include", "mlx")
    ):
        print(os.path.realpath(portion))
        sys.exit(0)
sys.exit(
    f"error: no portion of the mlx package ({', '.join(mlx.__path__)}) has "
    "lib/libmlx.so and include/mlx: install an MLX backend wheel "
    "(pip install 'mlx[cpu]')"
)
PY
  )
}
