"""Where the host time of one compiled dual head norm call goes: a developer's
profile of the package's own layers, so it imports their private modules
(the bridge, the cffi module) on purpose, unlike the benchmarks in bench/.

Two views of the same call, ``CompiledDualHeadNorm(eps)(q, k)`` at the
gated-delta decode shape (q, k ``(1, 1, 16, 128)`` bf16, no weights):

1. A timing ladder. Each rung calls one layer deeper into the stack, timed
   like the benchmark's host metric (median of batches, graph build only,
   each batch's outputs released outside the clock):

     facade        CompiledDualHeadNorm.__call__              (Python)
     bridge        mlx_dualnorm._interop.apply                (nanobind)
     C apply       mlx_dualnorm_compiled_dual_head_norm_apply (via cffi)
     replay        mlx_closure_apply of an identical shapeless compiled
                   graph, built here through cffi              (via cffi)

   plus the references (two mx.fast.rms_norm calls, one call, Python
   mx.compile) and the floors (an empty Python call, an empty cffi call).
   Differences between rungs estimate each layer's own cost; they are
   estimates (the rungs run in separate loops, with their own cache state).

2. A sampling profile (py-spy --native, when py-spy is installed) of a
   child process that only calls the facade in a loop: inclusive shares of
   the frames of each layer, so the ladder's differences can be checked
   against where the samples land. The raw py-spy output is kept with
   ``--output-dir``.

Also printed: how many primitives each path puts in the graph per dual call
(from ``mx.export_to_dot``): what the evaluation then has to dispatch.

Run: ``python bench/profile_host_path.py [--output-dir DIR] [--no-sampler]``.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

import mlx.core as mx

from mlx_dualnorm import CompiledDualHeadNorm
from mlx_dualnorm._binding import apply_compiled_dual_head_norm, ffi, lib
from mlx_dualnorm.commands.bench import GATED_DELTA_DECODE
from mlx_dualnorm.commands.bench.measurements import (
    ScenarioInputs,
    make_inputs,
    time_graph_builds,
)

EPSILON = 1e-6
SEED = 20261129


# ---- 1. The timing ladder ------------------------------------------------------------


class CffiDualHeadNormGraph:
    """The compiled dual head norm's graph rebuilt through cffi: a Python
    builder (called only when MLX traces) doing the two mlx_fast_rms_norm
    calls, compiled shapeless with mlx_compile, plus copies of the inputs
    as owned mlx_array handles. Lets the ladder time the C apply
    and the bare MLX replay without the Python and nanobind layers."""

    def __init__(self, inputs: ScenarioInputs, eps: float) -> None:
        self.eps = eps
        # Own mlx_array copies of the inputs (same shapes, dtypes, values).
        self.query_handle = self._copy_in(inputs.queries)
        self.key_handle = self._copy_in(inputs.keys)
        self.empty_handle = lib.mlx_array_new()
        input_handles = ffi.new("mlx_array[2]", [self.query_handle, self.key_handle])
        self.input_vector = lib.mlx_vector_array_new_data(input_handles, 2)

        # Keep the callback object alive as long as the closures that call it.
        self._builder_callback = ffi.callback(
            "int(mlx_vector_array*, const mlx_vector_array)", self._build_graph
        )
        builder = lib.mlx_closure_new_func(self._builder_callback)
        compiled = ffi.new("mlx_closure*")
        if builder.ctx == ffi.NULL or lib.mlx_compile(compiled, builder, True) != 0:
            raise RuntimeError("mlx_compile of the cffi-built dual head norm graph failed")
        lib.mlx_closure_free(builder)
        self.compiled_graph = compiled[0]

    @staticmethod
    def _copy_in(array: mx.array) -> object:
        """An mlx_array with the same bits (bf16 as raw uint16 words)."""
        import numpy as np

        if array.dtype != mx.bfloat16:
            raise ValueError("the ladder uses bf16 inputs")
        # bf16 -> f32 is exact, so the f32 words' upper halves are the bits.
        float_words = np.array(array.astype(mx.float32)).view(np.uint32)
        raw_words = np.ascontiguousarray((float_words >> 16).astype(np.uint16))
        shape = ffi.new("int[]", list(array.shape))
        handle = lib.mlx_array_new_data(
            ffi.from_buffer(raw_words), shape, array.ndim, lib.MLX_BFLOAT16
        )
        if handle.ctx == ffi.NULL:
            raise RuntimeError("mlx_array_new_data failed")
        return handle

    def _build_graph(self, result, input_vector) -> int:
        queries = ffi.new("mlx_array*")
        keys = ffi.new("mlx_array*")
        normalized_queries = ffi.new("mlx_array*")
        normalized_keys = ffi.new("mlx_array*")
        device = ffi.new("mlx_device*")
        stream = ffi.new("mlx_stream*")
        status = 1
        try:
            if (
                lib.mlx_vector_array_get(queries, input_vector, 0) == 0
                and lib.mlx_vector_array_get(keys, input_vector, 1) == 0
                and lib.mlx_get_default_device(device) == 0
                and lib.mlx_get_default_stream(stream, device[0]) == 0
                and lib.mlx_fast_rms_norm(
                    normalized_queries, queries[0], self.empty_handle, self.eps, stream[0]
                ) == 0
                and lib.mlx_fast_rms_norm(
                    normalized_keys, keys[0], self.empty_handle, self.eps, stream[0]
                ) == 0
            ):
                outputs = ffi.new("mlx_array[2]", [normalized_queries[0], normalized_keys[0]])
                status = lib.mlx_vector_array_set_data(result, outputs, 2)
        finally:
            for handle in (queries, keys, normalized_queries, normalized_keys):
                lib.mlx_array_free(handle[0])
            lib.mlx_stream_free(stream[0])
            lib.mlx_device_free(device[0])
        return status

    def close(self) -> None:
        lib.mlx_closure_free(self.compiled_graph)
        lib.mlx_vector_array_free(self.input_vector)
        lib.mlx_array_free(self.query_handle)
        lib.mlx_array_free(self.key_handle)


def time_cffi_calls(
    call_into_slot: Callable[[object], int], batches: int, calls_per_batch: int
) -> float:
    """Median us per call of ``call_into_slot(output_vector_pointer)``; each
    call fills its own output vector, freed after the batch's clock stops
    (so, as in the benchmark, no graph teardown is timed)."""
    output_vectors = ffi.new("mlx_vector_array[]", calls_per_batch)
    slots = [output_vectors + index for index in range(calls_per_batch)]
    per_call_us = []
    for _ in range(batches):
        started = time.perf_counter_ns()
        for slot in slots:
            call_into_slot(slot)
        finished = time.perf_counter_ns()
        for index in range(calls_per_batch):
            lib.mlx_vector_array_free(output_vectors[index])
            output_vectors[index].ctx = ffi.NULL
        per_call_us.append((finished - started) / 1e3 / calls_per_batch)
    return statistics.median(per_call_us)


def run_ladder(batches: int, calls_per_batch: int, rounds: int) -> dict[str, float]:
    """Per rung, the minimum over ``rounds`` interleaved rounds of the
    median over batches: the least disturbed estimate (on a shared machine
    other work only ever adds time)."""
    inputs = make_inputs(GATED_DELTA_DECODE, SEED)
    queries, keys = inputs.queries, inputs.keys
    norm = CompiledDualHeadNorm(EPSILON)
    address = int(ffi.cast("uintptr_t", norm._native))  # what the facade passes
    native = norm._native
    cffi_graph = CffiDualHeadNormGraph(inputs, EPSILON)
    empty = cffi_graph.empty_handle
    python_compiled = mx.compile(
        lambda q, k, wq, wk: (mx.fast.rms_norm(q, wq, EPSILON), mx.fast.rms_norm(k, wk, EPSILON)),
        shapeless=True,
    )

    error = ffi.new("mlx_dualnorm_error *")

    def check(status: int) -> int:
        if status != 0:
            raise RuntimeError(ffi.string(error.description).decode())
        return status

    python_rungs: dict[str, Callable] = {
        "empty Python call (floor)": lambda q, k, wq, wk: None,
        "facade: CompiledDualHeadNorm.__call__": norm,
        "bridge: _interop.apply": lambda q, k, wq, wk: apply_compiled_dual_head_norm(
            address, q, k, wq, wk
        ),
        "reference: 2 x mx.fast.rms_norm": lambda q, k, wq, wk: (
            mx.fast.rms_norm(q, wq, EPSILON),
            mx.fast.rms_norm(k, wk, EPSILON),
        ),
        "reference: 1 x mx.fast.rms_norm": lambda q, k, wq, wk: mx.fast.rms_norm(q, wq, EPSILON),
        "reference: Python mx.compile replay": python_compiled,
    }
    apply = lib.mlx_dualnorm_compiled_dual_head_norm_apply
    closure_apply = lib.mlx_closure_apply
    query_handle, key_handle = cffi_graph.query_handle, cffi_graph.key_handle
    compiled_graph, input_vector = cffi_graph.compiled_graph, cffi_graph.input_vector
    epsilon_getter = lib.mlx_dualnorm_compiled_dual_head_norm_epsilon
    cffi_rungs: dict[str, Callable[[object], object]] = {
        "empty cffi call (floor)": lambda slot: epsilon_getter(native),
        "C apply: mlx_dualnorm_..._apply (cffi)": lambda slot: apply(
            slot, native, query_handle, key_handle, empty, empty, error
        ),
        "replay: mlx_closure_apply (cffi)": lambda slot: closure_apply(
            slot, compiled_graph, input_vector
        ),
    }
    # Warm up: traces, checks every rung works.
    for rung in python_rungs.values():
        rung(queries, keys, None, None)
    for name, rung in cffi_rungs.items():
        probe = ffi.new("mlx_vector_array*")
        status = rung(probe)
        if "floor" not in name:
            check(status)
        lib.mlx_vector_array_free(probe[0])

    samples: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(rounds):
        for name, rung in python_rungs.items():
            samples[name].append(time_graph_builds(rung, inputs, batches, calls_per_batch)[0])
        for name, rung in cffi_rungs.items():
            samples[name].append(time_cffi_calls(rung, batches, calls_per_batch))
    cffi_graph.close()
    norm.close()
    return {name: min(values) for name, values in samples.items()}


def ladder_breakdown(ladder: dict[str, float]) -> list[tuple[str, float]]:
    """Each layer's own cost, estimated by differences of rungs."""
    python_floor = ladder["empty Python call (floor)"]
    cffi_floor = ladder["empty cffi call (floor)"]
    facade = ladder["facade: CompiledDualHeadNorm.__call__"]
    bridge = ladder["bridge: _interop.apply"]
    c_apply = ladder["C apply: mlx_dualnorm_..._apply (cffi)"] - cffi_floor
    replay = ladder["replay: mlx_closure_apply (cffi)"] - cffi_floor
    return [
        ("Python facade (__call__ body, unpack, checks)", facade - bridge),
        ("nanobind bridge (call dispatch, casts, output tuple)", bridge - python_floor - c_apply),
        ("C apply around the replay (checks, input vector, lock)", c_apply - replay),
        ("MLX compiled replay (mlx-c closure + compile cache + replay)", replay),
        ("benchmark loop floor (Python call + list append)", python_floor),
    ]


# ---- Graph sizes ----------------------------------------------------------------------


def primitives_per_call(call: Callable, inputs: ScenarioInputs) -> Optional[int]:
    """Primitive nodes in the graph of one call's outputs (from the DOT
    text MLX exports; None if the format is not recognized)."""
    outputs = call(inputs.queries, inputs.keys, inputs.query_weight, inputs.key_weight)
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    count = sum(1 for line in dot.getvalue().splitlines() if "shape=rectangle" in line)
    return count or None


def graph_sizes() -> dict[str, dict[str, Optional[int]]]:
    from mlx_dualnorm.commands.bench import DECODE_SCENARIOS, PATH_REGISTRY, PathUnavailable

    sizes: dict[str, dict[str, Optional[int]]] = {}
    for scenario in DECODE_SCENARIOS:
        inputs = make_inputs(scenario, SEED)
        sizes[scenario.name] = {}
        for name, path in PATH_REGISTRY.items():
            try:
                call = path.factory(EPSILON)
            except (PathUnavailable, ImportError):
                continue
            sizes[scenario.name][name] = primitives_per_call(call, inputs)
    return sizes


# ---- 2. The sampling profile ---------------------------------------------------------------


def _build_batch(norm: CompiledDualHeadNorm, inputs: ScenarioInputs, kept: list, calls: int) -> None:
    queries, keys = inputs.queries, inputs.keys
    for _ in range(calls):
        kept.append(norm(queries, keys))


def _release_batch(kept: list) -> None:
    kept.clear()


def worker_loop(seconds: float) -> None:
    """The profiled child: facade calls, in batches released apart."""
    inputs = make_inputs(GATED_DELTA_DECODE, SEED)
    norm = CompiledDualHeadNorm(EPSILON)
    kept: list = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        _build_batch(norm, inputs, kept, 200)
        _release_batch(kept)


# Frames whose inclusive share is reported: label -> pattern in a frame.
PROFILE_FRAMES = (
    ("build loop (all calls)", r"^_build_batch "),
    ("release loop (graph teardown)", r"^_release_batch "),
    ("facade CompiledDualHeadNorm.__call__", r"^CompiledDualHeadNorm\.__call__ "),
    # nanobind's runtime is the nanobind-backend package's library (the
    # bridge is built in split mode), which ships without symbol names: its
    # frames are matched by the library's name too.
    ("nanobind dispatch (nb_func_vectorcall)", r"nb_func_vectorcall|_nb_backend_v\d"),
    ("bridge apply (array_bridge.cpp)", r"^(\(anonymous namespace\)::)?apply \(array_bridge"),
    ("C apply mlx_dualnorm_compiled_dual_head_norm_apply", r"^mlx_dualnorm_compiled_dual_head_norm_apply"),
    ("mlx_vector_array_new_data / _free", r"^mlx_vector_array_(new_data|free) "),
    ("pthread mutex lock/unlock", r"pthread_mutex_(un)?lock"),
    ("mlx_closure_apply", r"^mlx_closure_apply "),
    ("MLX compile wrapper mlx::core::detail::compile", r"mlx::core::detail::compile\("),
    ("MLX compile_replace (the replay)", r"mlx::core::detail::compile_replace"),
    ("  of which output_shapes (shapeless shape inference)", r"output_shapes"),
    ("  of which std::unordered_map (replay bookkeeping)", r"_Hashtable|_Prime_rehash_policy"),
    ("mlx::core::array constructors", r"mlx::core::array::array\b|ArrayDesc::ArrayDesc|ArrayDesc::init"),
    ("mlx::core::array teardown (~ArrayDesc)", r"~ArrayDesc"),
    ("malloc / free / new / delete (any caller)", r"^(malloc|free|cfree|_int_malloc|_int_free|operator new|operator delete|__GI___libc_(malloc|free))\b"),
)


def run_sampler(seconds: float, rate: int, raw_output: pathlib.Path) -> Optional[dict]:
    py_spy = shutil.which("py-spy") or str(pathlib.Path(sys.executable).with_name("py-spy"))
    if not pathlib.Path(py_spy).exists():
        print("py-spy not found (pip install py-spy): no sampling profile", file=sys.stderr)
        return None
    command = [
        py_spy, "record", "--native", "--rate", str(rate), "--format", "raw",
        "--output", str(raw_output), "--",
        sys.executable, str(pathlib.Path(__file__).resolve()), "--worker-loop", str(seconds),
    ]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0 or not raw_output.exists():
        print(f"py-spy failed ({completed.returncode}): {completed.stderr.strip()[-500:]}",
              file=sys.stderr)
        return None
    return aggregate_raw_profile(raw_output)


def aggregate_raw_profile(raw_profile: pathlib.Path) -> dict:
    """Inclusive shares of PROFILE_FRAMES among samples in the loop, and the
    leaf functions that take most samples."""
    patterns = [(label, re.compile(pattern)) for label, pattern in PROFILE_FRAMES]
    inclusive: collections.Counter = collections.Counter()
    leaves: collections.Counter = collections.Counter()
    loop_samples = 0
    for line in raw_profile.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        frames = stack.split(";")
        if not any(frame.startswith(("_build_batch ", "_release_batch ")) for frame in frames):
            continue
        count = int(count_text)
        loop_samples += count
        for label, pattern in patterns:
            if any(pattern.search(frame) for frame in frames):
                inclusive[label] += count
        leaf = re.sub(r" \([^()]*\)$", "", frames[-1])
        leaves[leaf[:100]] += count
    if loop_samples == 0:
        return {"loop_samples": 0}
    return {
        "loop_samples": loop_samples,
        "build_split_percent": sampled_build_split(inclusive),
        "inclusive_percent": {
            label: 100 * inclusive[label] / loop_samples for label, _ in PROFILE_FRAMES
        },
        "top_leaf_percent": {
            leaf: 100 * count / loop_samples for leaf, count in leaves.most_common(15)
        },
    }


# Nested frames of one call, outermost first: (label of the layer's own
# share, PROFILE_FRAMES label of the frame the layer starts at).
CALL_LAYERS = (
    ("benchmark loop + Python's call into __call__ (slot_tp_call)", "build loop (all calls)"),
    ("Python facade body (__call__: try, None and len checks, unpack)",
     "facade CompiledDualHeadNorm.__call__"),
    ("nanobind dispatch + bridge (casts, borrow, output wrapping, tuple)",
     "nanobind dispatch (nb_func_vectorcall)"),
    ("C apply around the replay (checks, input vector, lock, error record)",
     "C apply mlx_dualnorm_compiled_dual_head_norm_apply"),
    ("mlx-c closure + std::function + compile-cache lookup", "mlx_closure_apply"),
    ("MLX compile_replace (rebuilding the 10-primitive graph)", "MLX compile_replace (the replay)"),
)


def sampled_build_split(inclusive: collections.Counter) -> dict[str, float]:
    """Each layer's own share of the build loop's samples: its frame's
    inclusive samples minus the next inner layer's."""
    build_samples = inclusive["build loop (all calls)"]
    if build_samples == 0:
        return {}
    split = {}
    for index, (label, frame_label) in enumerate(CALL_LAYERS):
        inner = inclusive[CALL_LAYERS[index + 1][1]] if index + 1 < len(CALL_LAYERS) else 0
        split[label] = 100 * (inclusive[frame_label] - inner) / build_samples
    return split


# ---- Report ----------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=pathlib.Path, default=None,
                        help="write host_path_profile.json (and py-spy's raw profile) here")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved ladder rounds")
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--calls-per-batch", type=int, default=100)
    parser.add_argument("--no-sampler", action="store_true", help="skip py-spy")
    parser.add_argument("--sample-seconds", type=float, default=4.0)
    parser.add_argument("--sample-rate", type=int, default=1000)
    parser.add_argument("--worker-loop", type=float, default=None, help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.worker_loop is not None:
        worker_loop(arguments.worker_loop)
        return 0

    print(f"host path of one dual call, {GATED_DELTA_DECODE.description}; "
          f"{mx.default_device()}, MLX {mx.__version__}")
    ladder = run_ladder(arguments.batches, arguments.calls_per_batch, arguments.rounds)
    print("\n1. timing ladder (us per call, graph build only: min over rounds of "
          "the median over batches)")
    for name, value in ladder.items():
        print(f"   {value:7.3f}  {name}")
    breakdown = ladder_breakdown(ladder)
    facade_total = ladder["facade: CompiledDualHeadNorm.__call__"]
    print(f"\n   estimated split of the facade's {facade_total:.2f} us:")
    for name, value in breakdown:
        print(f"   {value:7.3f}  {100 * value / facade_total:5.1f}%  {name}")

    sizes = graph_sizes()
    print("\n2. primitives in the graph per dual call (what eval dispatches)")
    for scenario, per_path in sizes.items():
        print(f"   {scenario}: " + ", ".join(f"{path} {count}" for path, count in per_path.items()))

    profile = None
    raw_path = None
    if not arguments.no_sampler:
        directory = arguments.output_dir or pathlib.Path(tempfile.mkdtemp(prefix="dualnorm-prof-"))
        directory.mkdir(parents=True, exist_ok=True)
        raw_path = directory / "host_path_py-spy.txt"
        profile = run_sampler(arguments.sample_seconds, arguments.sample_rate, raw_path)
        if profile and profile.get("loop_samples"):
            print(f"\n3. py-spy --native, {profile['loop_samples']} samples in the facade loop "
                  "(inclusive % of loop samples)")
            for label, percent in profile["inclusive_percent"].items():
                print(f"   {percent:5.1f}%  {label}")
            build_us = ladder["facade: CompiledDualHeadNorm.__call__"]
            print(f"\n   split of one call's build time by sampled frames "
                  f"(% of build-loop samples; us scaled to the ladder's {build_us:.2f} us)")
            for label, percent in profile["build_split_percent"].items():
                print(f"   {percent:5.1f}%  {build_us * percent / 100:6.3f} us  {label}")
            print("   top leaf functions:")
            for leaf, percent in profile["top_leaf_percent"].items():
                print(f"   {percent:5.1f}%  {leaf}")
            print(f"   raw profile: {raw_path}")

    if arguments.output_dir is not None:
        result = {
            "device": str(mx.default_device()),
            "mlx_version": mx.__version__,
            "scenario": GATED_DELTA_DECODE.name,
            "ladder_us": ladder,
            "breakdown_us": dict(breakdown),
            "primitives_per_call": sizes,
            "sampling_profile": profile,
        }
        arguments.output_dir.mkdir(parents=True, exist_ok=True)
        destination = arguments.output_dir / "host_path_profile.json"
        destination.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"\nwrote {destination}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
