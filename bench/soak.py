"""Soak: memory stays flat over many calls of the compiled dual head norm.

    python bench/soak.py                       # 10**6 decode-shaped calls
    python bench/soak.py --calls 20000 --samples 10
    python bench/soak.py --churn-every 1000    # a new object every 1000 calls
    python bench/soak.py --caller-thread       # calls on a long-lived worker
                                               # thread, objects made and
                                               # freed on the main thread

Each call normalizes decode-shaped queries and keys (mlx-lm's gated-delta
layers: (1, 1, 16, 128) and (1, 1, 2, 128) bf16, no weight by default),
evaluates both outputs and drops them. At evenly spaced points it samples
the process's resident set (VmRSS) and MLX's active memory, then prints the
samples and the growth from the first (taken after a warm-up, once every
graph is traced and every kernel built) to the last. Exits 1 when active
memory grew at all or the resident set grew by more than
--max-rss-growth-mib; 0 otherwise. The loop is the test suite's own
(tests/helpers/memory.py; tests/facade/test_soak.py runs it CI-sized).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import mlx.core as mx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import mlx_dualnorm  # noqa: E402
from helpers.memory import run_decode_calls  # noqa: E402

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=10**6)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--warmup-calls", type=int, default=None,
                        help="calls before the first sample (default: 1%%, at least 100)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--weighted", action="store_true")
    parser.add_argument("--churn-every", type=int, default=0, help="build a new object every N calls")
    parser.add_argument("--caller-thread", action="store_true", help="call on a long-lived worker thread")
    parser.add_argument("--max-rss-growth-mib", type=float, default=32.0)
    options = parser.parse_args(argv)
    warmup_calls = (
        max(100, options.calls // 100) if options.warmup_calls is None else options.warmup_calls
    )
    print(
        f"mlx_dualnorm soak: {options.calls} calls, {options.dtype}, "
        f"weighted={options.weighted}, churn_every={options.churn_every}, "
        f"caller_thread={options.caller_thread}, MLX {mx.__version__} on {mx.default_device()}\n"
        f"package: {mlx_dualnorm.__file__}",
        flush=True,
    )
    run = run_decode_calls(
        options.calls, options.samples, warmup_calls, dtype=DTYPES[options.dtype],
        weighted=options.weighted, churn_every=options.churn_every,
        caller_thread=options.caller_thread,
    )
    print(run.describe())
    flat = (
        run.active_growth_bytes <= 0
        and run.rss_growth_kib <= options.max_rss_growth_mib * 1024
    )
    print("FLAT" if flat else "GROWING")
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
