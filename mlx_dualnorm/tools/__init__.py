"""The tools around the product: they check and measure it, they are not it.

The product is :mod:`mlx_dualnorm` itself (``CompiledDualHeadNorm``,
``composed_dual_head_norm``) and the mlx-lm patch,
:mod:`mlx_dualnorm.integrations.mlx_lm`. Everything here serves
``python -m mlx_dualnorm`` and the tests:

* :mod:`~mlx_dualnorm.tools.compared_paths`: the paths compared, named once, and how
  a command chooses among them;
* :mod:`~mlx_dualnorm.tools.parity`: each path against the composed path,
  bit for bit, over a designed matrix (``parity_matrix``) of shapes, dtypes,
  layouts and values (``parity_inputs``), reported by ``parity_report``;
  :mod:`~mlx_dualnorm.tools.rope_parity` does the same for the norm + RoPE;
* :mod:`~mlx_dualnorm.tools.replay`: each path inside a small greedy decoder;
* :mod:`~mlx_dualnorm.tools.benchmark`: time and memory of each path (what
  is measured: ``benchmark_results``; the measurements:
  ``benchmark_measurements``; JSON, chart and tables: ``benchmark_report``);
* :mod:`~mlx_dualnorm.tools.mlx_lm_check`, :mod:`~mlx_dualnorm.tools.mlx_lm_bench`
  (its results and tables: ``mlx_lm_bench_results``),
  :mod:`~mlx_dualnorm.tools.mlx_lm_synthetic` and
  :mod:`~mlx_dualnorm.tools.mlx_lm_distributed` (started by
  ``mlx_lm_launcher``): the mlx-lm patch checked and timed on mlx-lm's own
  models (these import mlx-lm);
* :mod:`~mlx_dualnorm.tools.command`: what every command shares (parser,
  argument types, exit statuses, progress lines);
* :mod:`~mlx_dualnorm.tools.cli`: the command line.

Importing this package imports none of them.
"""
