"""The commands of ``python -m mlx_dualnorm`` (:mod:`~mlx_dualnorm.commands.cli`):
they check and measure the product, they are not it. One subpackage per
command, on the package's public API, plus ``shared`` (what several use);
the product imports nothing from here, and importing this package imports
none of them. The mlx-lm command wrapper is :mod:`mlx_dualnorm.mlx_lm`."""
