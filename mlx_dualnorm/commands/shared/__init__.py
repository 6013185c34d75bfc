"""What several commands share: the parser, argument types and exit
statuses (:mod:`~mlx_dualnorm.commands.shared.command`), the compared paths
(:mod:`~mlx_dualnorm.commands.shared.paths`) and the synthetic mlx-lm
models (:mod:`~mlx_dualnorm.commands.shared.synthetic`). Importing this
package imports none of them."""
