"""Integrations of mlx_dualnorm into other MLX libraries.

Each submodule imports the library it integrates with; this package imports
none of them, so ``import mlx_dualnorm`` never pulls in mlx-lm.

* :mod:`mlx_dualnorm.integrations.mlx_lm`: ``patch()`` / ``unpatch()``
  route mlx-lm's gated-delta ``normalize_qk`` through the compiled dual head
  norm (same bits).
* :mod:`mlx_dualnorm.integrations.mlx_lm_check`: patched vs unpatched greedy
  generation on a local model (``python -m mlx_dualnorm mlx-lm-check``).
* :mod:`mlx_dualnorm.integrations.mlx_lm_bench`: per-token generation time
  and the q/k prework at the Qwen3-Next decode shape, patched vs unpatched.
"""
