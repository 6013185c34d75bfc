"""Integrations of mlx_dualnorm into other MLX libraries.

Each submodule imports the library it integrates with; this package imports
none of them, so ``import mlx_dualnorm`` never pulls in mlx-lm.

* :mod:`mlx_dualnorm.integrations.mlx_lm`: ``patch()`` / ``unpatch()``
  route mlx-lm's gated-delta ``normalize_qk`` through the compiled dual head
  norm (same bits).

The tools that check and time this patch on mlx-lm's models live in
:mod:`mlx_dualnorm.commands` (``python -m mlx_dualnorm mlx-lm-check`` and
``mlx-lm-bench``).
"""
