"""Bad arguments, table driven: every bad argument to a constructor or a
call (values, types, dtypes, shapes, numpy forms, constants) raises the
documented type, TypeError or DualHeadNormValueError, with a message
``[operation] message`` (Python's own argument-count errors name the
method instead); nothing crashes, and the next valid call on the same
object still gives the composed path's bits.

Whether an input is bad is decided by the composed path (two
mx.fast.rms_norm calls): an array-level case counts as bad only if the
composed path rejects it too, and the test checks that it does. What the
composed path accepts (zero-row and zero-width arrays, integer or bool
inputs with a floating weight, mixed dtypes and ranks, huge ranks, strided
and broadcast views, ...) is tested separately, for bit parity.

Two places where the package deliberately differs from the composed path
are tested as its own contract, not against the composed path: numpy
arrays are accepted (copied in), and eps must be finite and >= 0 (the
composed path takes NaN, inf and negative epsilons). Random arguments
against the same contract are test_fuzz_arguments.py's.
"""

from __future__ import annotations

import fractions
import re
from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import numpy as np
import pytest
from helpers.bit_parity import ON_GPU, assert_bit_identical, composed_reference
from helpers.isolated_process import describe, run_python

from mlx_dualnorm import (
    CompiledDualHeadNorm,
    CompiledDualHeadNormRope,
    DualHeadNormValueError,
    MlxCError,
    composed_dual_head_norm,
    composed_dual_head_norm_rope,
)
from mlx_dualnorm.dual_head_norm import DUAL_HEAD_NORM_OPERATION as OPERATION

# The labels of errors the C side raises itself.
APPLY_OPERATION = "dual_head_norm"
COMPILE_OPERATION = "dual_head_norm"
EPS = 1e-5
WIDTH = 64

QUERIES = mx.random.normal((2, 4, WIDTH), key=mx.random.key(1)) * 1e-2
KEYS = mx.random.normal((2, 2, WIDTH), key=mx.random.key(2)) * 1e-2
WEIGHT = 1 + mx.random.normal((WIDTH,), key=mx.random.key(3)) * 0.1
mx.eval(QUERIES, KEYS, WEIGHT)

NORM = CompiledDualHeadNorm(EPS)

GPU_AVAILABLE = mx.is_available(mx.gpu)
try:
    from mlx_dualnorm import available_modes
except ImportError:  # a build without modes
    available_modes = None


def typed(dtype: mx.Dtype, shape: tuple[int, ...] = (2, 4, WIDTH)) -> mx.array:
    return mx.ones(shape, dtype=dtype)


# ---- the bad-input table -------------------------------------------------


@dataclass(frozen=True)
class BadInput:
    """A call that must fail. ``composed`` is the same input through the
    composed path (None where it has no counterpart: constructor arguments,
    argument counts, numpy inputs); it must fail too."""

    name: str
    call: Callable[[], object]
    error: type
    composed: Optional[Callable[[], object]] = None
    # Set where MLX itself refuses the input before this package runs, with
    # the composed path's very error: the "[op]" tag MLX names.
    mlx_operation: Optional[str] = None
    # A pattern the message must contain (re.search), where it is pinned.
    message: Optional[str] = None
    # Python's own refusal of the argument list: named by the method, not
    # in the package's "[operation] message" form.
    by_python: bool = False


def call_with(*args, **kwargs) -> Callable[[], object]:
    return lambda: NORM(*args, **kwargs)


def composed_with(queries, keys, query_weight=None, key_weight=None) -> Callable[[], object]:
    return lambda: composed_dual_head_norm(queries, keys, query_weight, key_weight, EPS)


def rejected_by_both(name: str, error: type, *arrays) -> BadInput:
    """A bad input given, as is, to the compiled call and the composed path."""
    return BadInput(name, call_with(*arrays), error, composed_with(*arrays))


def build(*args, **kwargs) -> Callable[[], object]:
    return lambda: CompiledDualHeadNorm(*args, **kwargs)


def closed_norm_call() -> object:
    norm = CompiledDualHeadNorm(EPS)
    norm.close()
    return norm(QUERIES, KEYS)


BAD_INPUTS = [
    # eps, at construction
    BadInput("eps string", build("1e-5"), TypeError),
    BadInput("eps None", build(None), TypeError),
    BadInput("eps bool", build(True), TypeError),
    BadInput("eps complex", build(1j), TypeError),
    BadInput("eps list", build([1e-5]), TypeError),
    BadInput("eps mx.array", build(mx.array(1e-5)), TypeError),
    BadInput("eps 0-d numpy array", build(np.array(1e-5)), TypeError),
    BadInput("eps nan", build(float("nan")), ValueError),
    BadInput("eps inf", build(float("inf")), ValueError),
    BadInput("eps -inf", build(float("-inf")), ValueError),
    BadInput("eps negative", build(-1e-6), ValueError),
    # Checked as the double given, before rounding to float32 (to inf, -0.0).
    BadInput("eps overflows float32", build(1e39), ValueError, message=r"^\[dual_head_norm\]"),
    BadInput("eps rounds to -0.0 in float32", build(-1e-50), ValueError,
             message=r"^\[dual_head_norm\]"),
    BadInput("eps int too large for a float", build(10**400), ValueError),
    BadInput("two positional eps", build(1e-5, 1e-6, 7), TypeError, by_python=True),
    BadInput("unknown constructor keyword", build(epsilon=1e-5), TypeError, by_python=True),
    BadInput("mode not a string", build(EPS, mode=3), TypeError),
    # argument counts and keywords
    BadInput("no arguments", call_with(), TypeError, by_python=True),
    BadInput("queries only", call_with(QUERIES), TypeError, by_python=True),
    BadInput("five positional arrays", call_with(QUERIES, KEYS, WEIGHT, WEIGHT, WEIGHT), TypeError,
             by_python=True),
    BadInput("unknown keyword", call_with(QUERIES, KEYS, scale=WEIGHT), TypeError, by_python=True),
    # not arrays
    rejected_by_both("queries None", TypeError, None, KEYS),
    rejected_by_both("keys None", TypeError, QUERIES, None),
    rejected_by_both("queries string", TypeError, "queries", KEYS),
    rejected_by_both("queries bytes", TypeError, b"\x00" * 8, KEYS),
    # The converter's own TypeError, unchanged.
    BadInput("queries list", call_with([[1.0] * WIDTH], KEYS), TypeError,
             composed_with([[1.0] * WIDTH], KEYS),
             message=rf"^\[{re.escape(OPERATION)}\] queries must be an mlx\.core\.array or "
             r"numpy\.ndarray, not list$"),
    rejected_by_both("queries tuple", TypeError, (1.0,) * WIDTH, KEYS),
    rejected_by_both("queries float", TypeError, 1.0, KEYS),
    rejected_by_both("queries int", TypeError, 3, KEYS),
    rejected_by_both("queries dict", TypeError, {}, KEYS),
    rejected_by_both("queries a Device", TypeError, mx.cpu, KEYS),
    rejected_by_both("keys an object", TypeError, QUERIES, object()),
    rejected_by_both("query weight list", TypeError, QUERIES, KEYS, [1.0] * WIDTH),
    rejected_by_both("key weight string", TypeError, QUERIES, KEYS, None, "w"),
    BadInput("numpy structured array", call_with(np.zeros(WIDTH, dtype=[("a", "f4")]), KEYS),
             TypeError),
    BadInput("stream a string", call_with(QUERIES, KEYS, stream="cpu"), TypeError),
    BadInput("stream an int", call_with(QUERIES, KEYS, stream=0), TypeError),
    # arrays the composed path rejects
    rejected_by_both("0-d queries", ValueError, mx.array(1.0), KEYS),
    rejected_by_both("0-d keys", ValueError, QUERIES, mx.array(1.0)),
    rejected_by_both("int32 queries", ValueError, typed(mx.int32), KEYS),
    rejected_by_both("bool queries", ValueError, typed(mx.bool_), KEYS),
    rejected_by_both("uint8 keys", ValueError, QUERIES, typed(mx.uint8)),
    rejected_by_both("complex64 queries", ValueError, typed(mx.complex64), KEYS),
    rejected_by_both("int queries, int weight", ValueError,
                     typed(mx.int32), KEYS, typed(mx.int32, (WIDTH,))),
    rejected_by_both("float queries, complex weight", ValueError,
                     QUERIES, KEYS, typed(mx.complex64, (WIDTH,))),
    rejected_by_both("0-d query weight", ValueError, QUERIES, KEYS, mx.array(1.0)),
    rejected_by_both("2-d query weight", ValueError, QUERIES, KEYS, WEIGHT[None]),
    rejected_by_both("short query weight", ValueError, QUERIES, KEYS, WEIGHT[:-1]),
    rejected_by_both("long key weight", ValueError, QUERIES, KEYS, None, mx.ones((WIDTH + 1,))),
    rejected_by_both("empty key weight", ValueError, QUERIES, KEYS, None, mx.ones((0,))),
    rejected_by_both("key weight of the query width", ValueError,
                     QUERIES, KEYS[..., :32], None, WEIGHT),
    rejected_by_both("weights swapped between widths", ValueError,
                     QUERIES[..., :32], KEYS, WEIGHT, WEIGHT[:32]),
    rejected_by_both("rank-40 int queries", ValueError,
                     mx.ones((1,) * 39 + (WIDTH,), dtype=mx.int16), KEYS),
    # numpy arrays: the composed path sees their mx.array copies
    BadInput("0-d numpy queries", call_with(np.array(1.0, np.float32), KEYS), ValueError,
             composed_with(mx.array(1.0), KEYS)),
    BadInput("int64 numpy queries", call_with(np.ones((2, WIDTH), np.int64), KEYS), ValueError,
             composed_with(typed(mx.int64), KEYS)),
    BadInput("complex128 numpy keys", call_with(QUERIES, np.ones((2, WIDTH), np.complex128)),
             ValueError, composed_with(QUERIES, typed(mx.complex64))),
    # Converted like any numpy array (no std::bad_cast), then refused for its
    # dtype, as mx.fast.rms_norm refuses int32.
    BadInput("big-endian int32 numpy queries", call_with(np.ones((2, WIDTH), ">i4"), KEYS),
             ValueError, composed_with(typed(mx.int32), KEYS), message="unsupported dtype int32"),
    BadInput("use after close", closed_norm_call, ValueError),
    # the composed function's own arguments
    BadInput("composed eps a string",
             lambda: composed_dual_head_norm(QUERIES, KEYS, eps="x"), TypeError),
]
if available_modes is not None:
    BAD_INPUTS.append(BadInput("unknown mode", build(EPS, mode="turbo"), ValueError))
    if "fused" not in available_modes():
        BAD_INPUTS.append(BadInput("fused mode without CUDA", build(EPS, mode="fused"), ValueError))
if not GPU_AVAILABLE:
    # MLX itself refuses the stream before any of this package runs; the
    # composed path raises the very same error.
    BAD_INPUTS.append(
        BadInput(
            "gpu stream on a CPU-only MLX",
            call_with(QUERIES, KEYS, stream=mx.gpu),
            ValueError,
            lambda: composed_dual_head_norm(QUERIES, KEYS, eps=EPS, stream=mx.gpu),
            mlx_operation="[default_stream]",
            # The call's name, then MLX's own reason.
            message=rf"^\[{re.escape(OPERATION)}\] .*Cannot get gpu stream without gpu backend",
        )
    )


# The form of every message the package raises: "[operation] message".
MLX_MESSAGE_FORM = re.compile(r"^\[[^\]]+\] \S")
OPERATION_NAMES = (
    f"[{OPERATION}]",
    APPLY_OPERATION,
    COMPILE_OPERATION,
    "CompiledDualHeadNorm.__call__",  # Python's own argument-count errors
    "CompiledDualHeadNorm.__init__",
)


def assert_valid_call_works() -> None:
    outputs = NORM(QUERIES, KEYS, WEIGHT, None)
    expected = composed_dual_head_norm(QUERIES, KEYS, WEIGHT, None, EPS)
    assert_bit_identical(outputs[0], expected[0], "queries after a bad call")
    assert_bit_identical(outputs[1], expected[1], "keys after a bad call")


def test_the_table_has_at_least_forty_cases():
    assert len(BAD_INPUTS) >= 40
    assert len({case.name for case in BAD_INPUTS}) == len(BAD_INPUTS)


@pytest.mark.parametrize("case", [pytest.param(case, id=case.name) for case in BAD_INPUTS])
def test_bad_input_raises_a_clear_error_and_the_next_call_works(case: BadInput):
    if case.composed is not None:
        with pytest.raises((TypeError, ValueError)):
            mx.eval(case.composed())
    with pytest.raises(case.error) as raised:
        mx.eval(case.call())
    error, message = raised.value, str(raised.value)
    names = (case.mlx_operation,) if case.mlx_operation else OPERATION_NAMES
    assert any(name in message for name in names), f"{type(error).__name__}: {message}"
    if not case.by_python:
        # The documented types exactly, and the one message form: a value
        # error is an MlxCError carrying the operation.
        documented = DualHeadNormValueError if isinstance(error, ValueError) else TypeError
        assert type(error) is documented, (type(error), message)
        assert MLX_MESSAGE_FORM.match(message), message
        if isinstance(error, MlxCError):
            assert message == f"[{error.operation}] {error.description}"
    if case.message is not None:
        assert re.search(case.message, message), message
    assert_valid_call_works()


# ---- inputs the composed path accepts: parity, not errors ------------------


@dataclass(frozen=True)
class AcceptedInput:
    name: str
    queries: object
    keys: object
    query_weight: object = None
    key_weight: object = None
    eps: float = EPS


def small(shape, dtype=mx.float32, seed=0) -> mx.array:
    return (mx.random.normal(shape, key=mx.random.key(seed)) * 1e-2).astype(dtype)


def float64_input(name: str, *arrays: Callable[[], mx.array]):
    """A float64 case: MLX has no float64 on the GPU, so it runs where the
    default device is the CPU and is shown as skipped elsewhere (its arrays
    are made only where it runs)."""
    if ON_GPU:
        return pytest.param(None, id=name, marks=pytest.mark.skip(reason="MLX has no float64 on the GPU"))
    return AcceptedInput(name, *(make() for make in arrays))


ACCEPTED_INPUTS = [
    AcceptedInput("zero rows", small((0, WIDTH)), small((0, WIDTH)), WEIGHT, WEIGHT),
    AcceptedInput("zero in a middle dimension", small((2, 0, WIDTH)), small((2, 3, WIDTH))),
    AcceptedInput("int32 queries, float32 weight", mx.arange(2 * WIDTH).reshape(2, WIDTH), KEYS, WEIGHT),
    AcceptedInput("bool queries, float16 weight", typed(mx.bool_, (2, WIDTH)), KEYS, WEIGHT.astype(mx.float16)),
    AcceptedInput("uint64 queries, bfloat16 weight", typed(mx.uint64, (2, WIDTH)), KEYS, WEIGHT.astype(mx.bfloat16)),
    AcceptedInput("float32 queries, int32 weight", QUERIES, KEYS, mx.arange(WIDTH)),
    float64_input("float16 queries, float64 weight",
                  lambda: QUERIES.astype(mx.float16), lambda: KEYS, lambda: WEIGHT.astype(mx.float64)),
    AcceptedInput("bfloat16 queries, float32 weight", QUERIES.astype(mx.bfloat16), KEYS.astype(mx.bfloat16), WEIGHT, WEIGHT),
    float64_input("float64 inputs", lambda: QUERIES.astype(mx.float64), lambda: KEYS.astype(mx.float64)),
    AcceptedInput("queries and keys of other dtypes", QUERIES.astype(mx.float16), KEYS.astype(mx.bfloat16)),
    AcceptedInput("queries and keys of other ranks", small((3, WIDTH)), small((1, 2, 1, 3, 32))),
    AcceptedInput("rank 1", small((WIDTH,)), small((32,)), WEIGHT, None),
    AcceptedInput("rank 64", small((1,) * 63 + (WIDTH,)), KEYS),
    AcceptedInput("width 2", small((3, 2)), small((3, 2)), mx.array([0.5, 2.0]), None),
    AcceptedInput("transposed queries", mx.swapaxes(small((4, WIDTH, 2)), -1, -2), KEYS),
    AcceptedInput("broadcast queries", mx.broadcast_to(small((1, WIDTH)), (5, WIDTH)), KEYS),
    AcceptedInput("strided weight", QUERIES, KEYS, mx.ones((2 * WIDTH,))[::2], None),
    AcceptedInput("non-finite values", mx.array([[np.nan, 1.0], [np.inf, -np.inf], [0.0, -0.0]]), KEYS),
    AcceptedInput("all-zero rows", mx.zeros((2, WIDTH)), KEYS),
    AcceptedInput("eps 0", QUERIES, KEYS, eps=0.0),
    AcceptedInput("eps -0.0", QUERIES, KEYS, eps=-0.0),
    AcceptedInput("eps subnormal float32", QUERIES, KEYS, eps=1e-40),
    AcceptedInput("eps below float32's range", QUERIES, KEYS, eps=1e-50),
    AcceptedInput("eps int", QUERIES, KEYS, eps=0),
    AcceptedInput("eps numpy float32", QUERIES, KEYS, eps=np.float32(1e-5)),
    AcceptedInput("eps Fraction", QUERIES, KEYS, eps=fractions.Fraction(1, 100000)),
]


@pytest.mark.parametrize("case", ACCEPTED_INPUTS, ids=lambda case: case.name)
def test_inputs_the_composed_path_accepts_match_it_bit_for_bit(case: AcceptedInput):
    inputs = (case.queries, case.keys, case.query_weight, case.key_weight)
    expected = composed_reference(*inputs, eps=float(case.eps))
    mx.eval(expected)  # the composed path accepts this input
    norm = NORM if case.eps == EPS else CompiledDualHeadNorm(case.eps)
    outputs = norm(*inputs)
    assert_bit_identical(outputs[0], expected[0], f"{case.name}: queries")
    assert_bit_identical(outputs[1], expected[1], f"{case.name}: keys")


STREAMS = {
    "device type": lambda: mx.cpu,
    "device": lambda: mx.Device(mx.cpu, 0),
    "new stream": lambda: mx.new_stream(mx.cpu),
    "default stream": lambda: mx.default_stream(mx.cpu),
    "thread-local stream": lambda: mx.new_thread_local_stream(mx.cpu),
}


@pytest.mark.parametrize("stream", STREAMS)
def test_stream_arguments_the_composed_path_accepts(stream):
    stream = STREAMS[stream]()
    expected = composed_dual_head_norm(QUERIES, KEYS, WEIGHT, WEIGHT, EPS, stream=stream)
    mx.eval(expected)
    outputs = NORM(QUERIES, KEYS, WEIGHT, WEIGHT, stream=stream)
    mx.eval(outputs)
    for actual, reference in zip(outputs, expected):
        assert_bit_identical(actual, reference, "stream argument")


@pytest.mark.parametrize(
    "dtype", [np.float16, np.float32, np.float64, np.int32, np.bool_, ">f4", ">f2", ">f8", "<f4"]
)
def test_numpy_inputs_match_the_composed_path_on_the_same_values(dtype):
    """An extension over the composed path (which takes only mx.array):
    numpy inputs of either byte order are copied in and give the bits of
    their mx.array copy (in the native byte order, the one MLX holds)."""
    values = np.random.default_rng(5).standard_normal((3, WIDTH)) * 1e-2
    queries = values.astype(dtype)
    native = mx.array(queries.astype(queries.dtype.newbyteorder("=")))
    weight = np.linspace(0.5, 1.5, WIDTH, dtype=np.float32)
    outputs = NORM(queries, KEYS, weight, None)
    expected = composed_dual_head_norm(native, KEYS, mx.array(weight), None, EPS)
    assert_bit_identical(outputs[0], expected[0], "numpy queries")
    assert_bit_identical(outputs[1], expected[1], "keys")


@pytest.mark.parametrize("position", ["queries", "keys", "query_weight", "key_weight"])
@pytest.mark.parametrize("dtype", [np.longdouble, np.clongdouble, "U3", object])
def test_numpy_dtypes_mlx_cannot_hold_are_a_clear_type_error(position, dtype):
    arguments = {"queries": QUERIES, "keys": KEYS}
    arguments[position] = np.zeros(WIDTH if position.endswith("weight") else (2, WIDTH), dtype=dtype)
    with pytest.raises(TypeError, match=rf"^\[{re.escape(OPERATION)}\] {position} has numpy dtype"):
        NORM(**arguments)
    assert_valid_call_works()


# Widths 0 and 1 crash or mis-shape MLX 0.32.4's shapeless compile (its
# CPU sum segfaults at width 1 and rank >= 2; width 0 comes back as width
# 1). A crash would take pytest down, so these run in a child process.
DEGENERATE_WIDTH_CHECK = """
    import mlx.core as mx
    from helpers.bit_parity import assert_bit_identical, composed_reference
    from mlx_dualnorm import CompiledDualHeadNorm

    norm = CompiledDualHeadNorm(1e-5)
    shapes = [(3, 1), (2, 2, 1), (1, 1), (0, 1), (2, 0), (2, 3, 0), (0,), (1,), (2, 8), (3, 1)]
    for weighted in (False, True):
        for shape in shapes:
            queries = mx.random.normal(shape, key=mx.random.key(len(shape))) * 1e-2
            weight = mx.full(shape[-1:], 1.5) if weighted else None
            keys = mx.random.normal((2, 8), key=mx.random.key(9))
            expected = composed_reference(queries, keys, weight, None, 1e-5)
            outputs = norm(queries, keys, weight, None)
            assert_bit_identical(outputs[0], expected[0], f"{shape} weighted={weighted}")
            assert_bit_identical(outputs[1], expected[1], f"keys next to {shape}")
            print("ok", shape, weighted)
"""


def test_widths_zero_and_one_match_the_composed_path():
    process = run_python(DEGENERATE_WIDTH_CHECK)
    assert process.returncode == 0, describe(process)
    assert process.stdout.count("ok") == 20, process.stdout


def float64_on_the_cpu(shape) -> mx.array:
    return mx.ones(shape, dtype=mx.float64, stream=mx.cpu)  # the GPU cannot even make it


# name: (queries, query weight), keys being (2, WIDTH) float16 without weight
FLOAT64_ON_THE_GPU = {
    "float64 queries": lambda: (float64_on_the_cpu((2, WIDTH)), None),
    "float64 weight": lambda: (small((2, WIDTH), mx.float16), float64_on_the_cpu((WIDTH,))),
    "float64 weight, empty queries": lambda: (small((0, WIDTH), mx.float16), float64_on_the_cpu((WIDTH,))),
}


@pytest.mark.skipif(not ON_GPU, reason="MLX refuses float64 on the GPU only")
@pytest.mark.parametrize("mode", ["auto", "compiled", "composed"])
@pytest.mark.parametrize("case", FLOAT64_ON_THE_GPU)
def test_float64_on_the_gpu_is_a_value_error_as_for_the_composed_path(mode, case):
    """MLX refuses float64 on the GPU with a ValueError; so does the call,
    empty inputs included (which would otherwise run on the CPU stream)."""
    queries, query_weight = FLOAT64_ON_THE_GPU[case]()
    keys = small((2, WIDTH), mx.float16)
    with pytest.raises(ValueError):
        composed_dual_head_norm(queries, keys, query_weight, None, EPS)
    with pytest.raises(DualHeadNormValueError, match="float64"):
        CompiledDualHeadNorm(EPS, mode=mode)(queries, keys, query_weight, None)


# ---- constants and the norm + RoPE's arguments --------------------------------


@pytest.mark.parametrize(
    "cls, constants, name",
    [
        (CompiledDualHeadNormRope, {"base": 10**400}, "base"),
        (CompiledDualHeadNormRope, {"base": fractions.Fraction(10**400, 3)}, "base"),
        (CompiledDualHeadNormRope, {"base": 1e4, "scale": 10**400}, "scale"),
        (CompiledDualHeadNormRope, {"base": 1e4, "scale": -(10**400)}, "scale"),
        *(
            (cls, {"eps": eps}, "eps")
            for eps in (10**400, -(10**400), fractions.Fraction(10**400, 7))
            for cls in (CompiledDualHeadNorm, CompiledDualHeadNormRope)
        ),
    ],
)
def test_constants_beyond_a_float_are_value_errors(cls, constants, name):
    """Numbers no double holds (ints and fractions of 400 digits): refused
    as values, never an OverflowError."""
    options = {"base": 1e4, **constants} if cls is CompiledDualHeadNormRope else dict(constants)
    eps = options.pop("eps", 1e-6)
    arguments = (eps,) if cls is CompiledDualHeadNorm else (eps, 16)
    pattern = r"^\[.+\] .*eps" if name == "eps" else rf"^\[.+\] {name} is beyond the range of a float"
    with pytest.raises(ValueError, match=pattern):
        cls(*arguments, **options)


@pytest.mark.parametrize("offset", [1.5, 2.0, 1j])
def test_a_python_float_offset_is_refused_as_not_an_integer(offset):
    queries = mx.ones((1, 2, 4, 64))
    norm_rope = CompiledDualHeadNormRope(1e-6, 64, base=1e4)
    with pytest.raises(DualHeadNormValueError) as raised:
        norm_rope(queries, queries, offset=offset)
    assert str(raised.value) == f"[dual_head_norm_rope] offset must be an integer, not {offset!r}"


def test_composed_dual_head_norm_rope_still_requires_eps():
    queries = mx.ones((1, 2, 4, 64))
    with pytest.raises(TypeError, match=r"^\[composed_dual_head_norm_rope\] missing .* eps"):
        composed_dual_head_norm_rope(queries, queries, dims=64, base=1e4)
