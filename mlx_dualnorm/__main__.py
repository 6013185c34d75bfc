"""``python -m mlx_dualnorm``: the package's main job and its tools.

Without a sub-command: a bit-parity check of the compiled path against the
composed path on decode-like shapes, then a benchmark report (host µs per
call, µs per decode token) on the default device, with ratios to the
composed path measured in the same run.

Sub-commands: ``parity`` (the full parity matrix), ``replay`` (the greedy
trajectory replay), ``bench`` (the full benchmark), ``mlx-lm-check``
(patched vs unpatched mlx-lm generation on a local or synthetic model),
``mlx-lm-bench`` (mlx-lm's normalize_qk against the patch).
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "parity": "mlx_dualnorm.parity",
    "replay": "mlx_dualnorm.replay",
    "bench": "mlx_dualnorm.benchmark",
    "mlx-lm-check": "mlx_dualnorm.integrations.mlx_lm_check",
    "mlx-lm-bench": "mlx_dualnorm.integrations.mlx_lm_bench",
}


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv and argv[0] in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    if argv:
        print(f"unknown sub-command {argv[0]!r}; choose from {', '.join(SUBCOMMANDS)}")
        return 2
    import mlx.core as mx

    from mlx_dualnorm import benchmark, parity

    mlx_version = getattr(mx, "__version__")  # not in MLX's type stubs
    print(f"mlx_dualnorm on {mx.default_device()} (MLX {mlx_version})\n")
    parity_status = parity.main(["--quick"])
    print()
    bench_status = benchmark.main(["--quick"])
    return parity_status or bench_status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
