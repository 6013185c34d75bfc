"""``python -m mlx_dualnorm``: see :mod:`mlx_dualnorm.commands.cli`. An MLX other
than the one the package was built against is refused before this runs, on
importing the package (:mod:`mlx_dualnorm._mlx_version_guard`): one line, exit 2."""

import sys

from mlx_dualnorm.commands.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
