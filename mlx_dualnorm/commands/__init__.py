"""The commands of ``python -m mlx_dualnorm`` (:mod:`~mlx_dualnorm.commands.cli`),
one subpackage each plus ``shared``: they check and measure the product on its
public API, and the product imports nothing from here."""
