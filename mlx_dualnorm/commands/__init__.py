"""The commands of ``python -m mlx_dualnorm``: they check and measure the
product, they are not it.

The product is :mod:`mlx_dualnorm` itself (``CompiledDualHeadNorm``,
``CompiledDualHeadNormRope``, ``composed_dual_head_norm``) and the mlx-lm
patch, :mod:`mlx_dualnorm.integrations.mlx_lm`; neither imports anything
from here. One subpackage per command, each on the package's public API:

* :mod:`~mlx_dualnorm.commands.parity`: each path against the composed
  path, bit for bit, over a designed matrix, and the norm + RoPE;
* :mod:`~mlx_dualnorm.commands.replay`: each path inside a small greedy
  decoder;
* :mod:`~mlx_dualnorm.commands.bench`: time and memory of each path;
* :mod:`~mlx_dualnorm.commands.mlx_lm_check` and
  :mod:`~mlx_dualnorm.commands.mlx_lm_bench`: the mlx-lm patch checked and
  timed on mlx-lm's own models (these import mlx-lm);
* :mod:`~mlx_dualnorm.commands.shared`: what several commands share (the
  parser and argument types, the compared paths, the synthetic mlx-lm
  models);
* :mod:`~mlx_dualnorm.commands.cli`: the command line and its main job.

The mlx-lm command wrapper (``mlx-lm-dualnorm``) is :mod:`mlx_dualnorm.mlx_lm`.
Importing this package imports none of them.
"""
