"""``python -m mlx_dualnorm``: see :mod:`mlx_dualnorm.commands.cli` (or run it
with ``--help``).

Python imports the package before this module runs, so an installed MLX
other than the one the package was built against is refused there, by
:mod:`mlx_dualnorm._mlx_version_guard`: under ``python -m`` as one line on
stderr and exit status 2 (cannot run here), for a library user as the
ImportError."""

import sys

from mlx_dualnorm.commands.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
