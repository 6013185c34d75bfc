"""``python -m mlx_dualnorm``: see :mod:`mlx_dualnorm.tools.cli` (or run it
with ``--help``)."""

import sys

from mlx_dualnorm.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
