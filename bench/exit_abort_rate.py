"""How often the interpreter aborts at exit after worker threads used MLX:
this package's compiled mode against plain MLX (the composed path), in the
same pattern, in fresh interpreters. ThreadPoolExecutor(8) runs 64 tasks;
each builds its inputs (with mx.random, or with mx.ones), normalizes them
and evaluates; then the interpreter exits. Prints aborts out of runs for
each pattern and path: the package's rate should be no higher than plain
MLX's."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent(
    """
    import sys
    from concurrent.futures import ThreadPoolExecutor
    import mlx.core as mx

    make_inputs, path = sys.argv[1], sys.argv[2]
    if path == "package":
        from mlx_dualnorm import CompiledDualHeadNorm
        normalize = CompiledDualHeadNorm(1e-6, mode="compiled")
    else:
        def normalize(queries, keys):
            return mx.fast.rms_norm(queries, None, 1e-6), mx.fast.rms_norm(keys, None, 1e-6)

    def task(index):
        shape = (1, 1, 16, 128)
        if make_inputs == "random":
            queries = mx.random.normal(shape).astype(mx.bfloat16)
            keys = mx.random.normal(shape).astype(mx.bfloat16)
        else:
            queries = mx.ones(shape, dtype=mx.bfloat16)
            keys = mx.ones(shape, dtype=mx.bfloat16)
        mx.eval(normalize(queries, keys))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(task, range(64)))
    """
)


PATHS = ("plain-mlx", "package")


def aborts(make_inputs: str, runs: int) -> dict[str, int]:
    """Aborted runs per path; the paths alternate, so both see the same
    machine load."""
    counts = dict.fromkeys(PATHS, 0)
    for _ in range(runs):
        for path in PATHS:
            process = subprocess.run(
                [sys.executable, "-c", PROGRAM, make_inputs, path],
                capture_output=True, text=True, timeout=120,
            )
            counts[path] += process.returncode != 0
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="runs per pattern and path")
    parser.add_argument("--inputs", nargs="+", choices=("ones", "random"),
                        default=["ones", "random"], help="how the tasks make their inputs")
    arguments = parser.parse_args()
    for make_inputs in arguments.inputs:
        for path, count in aborts(make_inputs, arguments.runs).items():
            print(f"inputs from mx.{make_inputs:6} {path:9}: {count}/{arguments.runs} runs aborted",
                  flush=True)


if __name__ == "__main__":
    main()
