"""``python -m mlx_dualnorm.mlx_lm SUBCOMMAND ...``: see :mod:`mlx_dualnorm.mlx_lm`."""

import sys

from mlx_dualnorm.mlx_lm import main

if __name__ == "__main__":
    sys.exit(main())
