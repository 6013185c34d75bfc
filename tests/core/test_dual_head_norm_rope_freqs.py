"""CompiledDualHeadNormRope with a frequency table (``base=None``, ``freqs=``
per call) and an input scale: bit parity with ``mx.fast.rope(...,
base=None, freqs=)`` after ``x.at[..., :dims].multiply(s)``, as mlx-lm's
scaled RoPEs (Llama3RoPE, YarnRoPE, SuScaledRoPE, ProportionalRoPE) compute
it, across dtypes, offsets, partial dims and layouts; a changed table
followed; bad input refused; transforms."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from helpers.bit_parity import assert_bit_identical, assert_transforms_agree

from mlx_dualnorm import (
    CompiledDualHeadNormRope,
    DualHeadNormValueError,
    available_modes,
    composed_dual_head_norm_rope,
)
from mlx_dualnorm._native import ffi, lib

rope_utils = pytest.importorskip("mlx_lm.models.rope_utils")

DTYPES = (mx.bfloat16, mx.float16, mx.float32)
FUSED_AVAILABLE = "fused" in available_modes()
MODES = ("compiled", "composed") + (("fused",) if FUSED_AVAILABLE else ())
EPS = 1e-6


def scaled_ropes(dims, traditional=False):
    """One module of each covered rope_utils class, with a non-trivial
    table and (YaRN, su) an input scale that bfloat16 cannot hold."""
    return {
        "llama3": rope_utils.Llama3RoPE(
            dims, max_position_embeddings=4096, traditional=traditional, base=500000.0,
            scaling_config={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 1024},
        ),
        "yarn": rope_utils.YarnRoPE(
            dims, traditional=traditional, max_position_embeddings=32768, base=1e6,
            scaling_factor=4.0, original_max_position_embeddings=1024, mscale=1.0,
            mscale_all_dim=0.5,
        ),
        "su": rope_utils.SuScaledRoPE(
            dims, base=1e4, max_position_embeddings=131072,
            original_max_position_embeddings=4096, short_factor=1.0,
            long_factor=[1.0 + 0.1 * i for i in range(dims // 2)],
        ),
        "proportional": rope_utils.ProportionalRoPE(
            dims, rotated_dims=dims // 2, traditional=traditional, base=1e4, factor=2.0
        ),
    }


def constants_of(rope):
    """(dims, traditional, input_scale) as the module's __call__ uses them."""
    if isinstance(rope, rope_utils.SuScaledRoPE):
        return rope.dim, False, rope._scale
    if isinstance(rope, rope_utils.YarnRoPE):
        return rope.dims, rope.traditional, None if rope.mscale == 1.0 else rope.mscale
    return rope.dims, rope.traditional, None


def module_reference(rope, inputs, offset):
    """What mlx-lm's attention computes: rms_norm, transpose, the module."""
    queries, keys, query_weight, key_weight = inputs
    return tuple(
        rope(mx.fast.rms_norm(side, weight, EPS).transpose(0, 2, 1, 3), offset=offset)
        for side, weight in ((queries, query_weight), (keys, key_weight))
    )


def random_inputs(query_shape, key_shape, dtype, seed):
    keys_of = mx.random.split(mx.random.key(seed), 4)
    width = query_shape[-1]
    return (
        (3 * mx.random.normal(query_shape, key=keys_of[0])).astype(dtype),
        mx.random.normal(key_shape, key=keys_of[1]).astype(dtype),
        mx.random.normal((width,), key=keys_of[2]).astype(dtype),
        mx.random.normal((width,), key=keys_of[3]).astype(dtype),
    )


def offset_of(name, batch):
    return {
        "int": 4093,
        "scalar array": mx.array(11, dtype=mx.int32),
        "lazy scalar": mx.array(5, dtype=mx.int32) + 6,
        "per batch": mx.array([3, 200][:batch], dtype=mx.int32),
    }[name]


def assert_pairs_identical(actual, expected, context):
    assert isinstance(actual, tuple) and len(actual) == 2
    for side, a, e in zip(("queries", "keys"), actual, expected):
        assert_bit_identical(a, e, f"{context} {side}")


# ---- Parity with mlx-lm's modules -------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("offset", ["int", "scalar array", "lazy scalar", "per batch"])
def test_scaled_ropes_give_their_modules_bits(mode, dtype, traditional, offset):
    """Each class at decode (L = 1, B = 1 and 2) and a short prefill, with
    partial dims (the rest copied), as the module itself computes it after
    mlx-lm's norm and transpose."""
    for name, rope in scaled_ropes(64, traditional).items():
        dims, rope_traditional, input_scale = constants_of(rope)
        norm_rope = CompiledDualHeadNormRope(
            EPS, dims, base=None, traditional=rope_traditional, input_scale=input_scale,
            mode=mode,
        )
        for batch, length in ((1, 1), (2, 1), (2, 5)):
            inputs = random_inputs((batch, length, 4, 128), (batch, length, 2, 128), dtype, 3)
            rope_offset = offset_of(offset, batch)
            actual = norm_rope(*inputs, offset=rope_offset, freqs=rope._freqs)
            expected = module_reference(rope, inputs, rope_offset)
            assert_pairs_identical(actual, expected, f"{name} B={batch} L={length}")
            composed = composed_dual_head_norm_rope(
                *inputs, eps=EPS, dims=dims, base=None, traditional=rope_traditional,
                offset=rope_offset, freqs=rope._freqs, input_scale=input_scale,
            )
            assert_pairs_identical(actual, composed, f"{name} composed B={batch} L={length}")


@pytest.mark.parametrize("mode", MODES)
def test_prefill_sizes_and_full_width_dims(mode):
    """Prefill sizes (the plain builder in compiled mode), dims equal
    to the head width, and unweighted or mixed weight sets."""
    for name, rope in scaled_ropes(128).items():
        dims, traditional, input_scale = constants_of(rope)
        norm_rope = CompiledDualHeadNormRope(
            EPS, dims, base=None, traditional=traditional, input_scale=input_scale, mode=mode
        )
        queries, keys, query_weight, key_weight = random_inputs(
            (1, 16, 8, 128), (1, 16, 4, 128), mx.bfloat16, 5
        )
        for weights in ((query_weight, key_weight), (None, None), (query_weight, None)):
            inputs = (queries, keys, *weights)
            actual = norm_rope(*inputs, offset=9, freqs=rope._freqs)
            assert_pairs_identical(actual, module_reference(rope, inputs, 9), name)


@pytest.mark.parametrize("mode", MODES)
def test_strided_and_non_float32_tables(mode):
    """A table of any dtype is converted to float32, as mx.fast.rope does,
    and a strided view of a larger table is read with its stride."""
    inputs = random_inputs((1, 1, 4, 64), (1, 1, 2, 64), mx.float16, 7)
    wide = mx.exp(mx.linspace(0.0, 9.0, 64))
    tables = {
        "strided": wide[::2],
        "reversed": wide[::-2],
        "bfloat16": wide[:32].astype(mx.bfloat16),
        "int32": mx.arange(1, 33, dtype=mx.int32),
    }
    norm_rope = CompiledDualHeadNormRope(EPS, 64, base=None, input_scale=0.7, mode=mode)
    for name, table in tables.items():
        actual = norm_rope(*inputs, offset=21, freqs=table)
        expected = composed_dual_head_norm_rope(
            *inputs, eps=EPS, dims=64, base=None, offset=21, freqs=table, input_scale=0.7
        )
        assert_pairs_identical(actual, expected, name)


@pytest.mark.parametrize("mode", MODES)
def test_a_changed_table_is_followed(mode):
    """The table is an input, not a constant: the same object with a new
    table gives the new table's bits (and the first table's again)."""
    rope = scaled_ropes(64)["llama3"]
    norm_rope = CompiledDualHeadNormRope(EPS, 64, base=None, mode=mode)
    inputs = random_inputs((1, 1, 4, 64), (1, 1, 2, 64), mx.bfloat16, 11)
    first_table = rope._freqs
    first = norm_rope(*inputs, offset=300, freqs=first_table)
    rope._freqs = 3.0 * first_table
    second = norm_rope(*inputs, offset=300, freqs=rope._freqs)
    assert_pairs_identical(second, module_reference(rope, inputs, 300), "second table")
    assert any(
        not mx.array_equal(a, b).item() for a, b in zip(first, second)
    ), "the tables must give different rotations"
    rope._freqs = first_table
    assert_pairs_identical(
        norm_rope(*inputs, offset=300, freqs=first_table),
        module_reference(rope, inputs, 300), "first table again",
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_input_scale_with_a_base(mode, dtype):
    """The input scale is its own parameter: with a base too, it gives the
    bits of x.at[..., :dims].multiply(s) before mx.fast.rope, the scale
    rounded to the input dtype (1/3 is not exact in any of them)."""
    inputs = random_inputs((2, 1, 4, 64), (2, 1, 2, 64), dtype, 13)
    norm_rope = CompiledDualHeadNormRope(EPS, 32, base=1e4, input_scale=1 / 3, mode=mode)
    for offset in (0, 77, mx.array([1, 2], dtype=mx.int32)):
        actual = norm_rope(*inputs, offset=offset)
        expected = tuple(
            mx.fast.rope(
                mx.fast.rms_norm(side, weight, EPS).transpose(0, 2, 1, 3).at[..., :32]
                .multiply(1 / 3),
                32, traditional=False, base=1e4, scale=1.0, offset=offset,
            )
            for side, weight in ((inputs[0], inputs[2]), (inputs[1], inputs[3]))
        )
        assert_pairs_identical(actual, expected, f"offset {offset}")
    # The rounding of the scale matters: a float32 multiply would differ.
    if dtype != mx.float32:
        normalized = mx.fast.rms_norm(inputs[0], inputs[2], EPS).transpose(0, 2, 1, 3)
        unrounded = (normalized[..., :32].astype(mx.float32) * (1 / 3)).astype(dtype)
        rounded = normalized.at[..., :32].multiply(1 / 3)[..., :32]
        assert not mx.array_equal(unrounded, rounded).item()


def graph_primitives(*outputs):
    """The primitive names of the graph behind `outputs`."""
    import io
    import re

    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return re.findall(r'label ="([^"]+)", shape=rectangle', dot.getvalue())


def test_the_graph_scales_as_mlx_does():
    """The input scale is the SliceUpdate Prod of x.at[...].multiply, and
    None adds no multiply at all (YaRN's mscale of 1)."""
    inputs = random_inputs((1, 1, 4, 64), (1, 1, 2, 64), mx.bfloat16, 2)
    table = mx.ones((16,))
    for input_scale, updates in ((1.5, 2), (None, 0)):
        norm_rope = CompiledDualHeadNormRope(
            EPS, 32, base=None, input_scale=input_scale, mode="composed"
        )
        primitives = graph_primitives(*norm_rope(*inputs, offset=3, freqs=table))
        assert primitives.count("SliceUpdate Prod") == updates, primitives


@pytest.mark.skipif(not FUSED_AVAILABLE, reason="the fused mode needs MLX's CUDA backend")
def test_the_fused_kernel_takes_float32_tables():
    """A float32 table (every rope_utils class's) runs the one fused node; a
    table of another dtype runs the compiled graph, same bits."""
    inputs = random_inputs((1, 1, 4, 64), (1, 1, 2, 64), mx.bfloat16, 2)
    norm_rope = CompiledDualHeadNormRope(EPS, 64, base=None, input_scale=1.5, mode="fused")
    for table, fused in ((mx.ones((32,)), True), (mx.ones((32,), dtype=mx.bfloat16), False)):
        primitives = graph_primitives(*norm_rope(*inputs, offset=3, freqs=table))
        assert ("FusedDualRmsNormRope" in primitives) == fused, primitives


# ---- Bad input ---------------------------------------------------------------------


def make_freqs_object(mode="compiled", **options):
    return CompiledDualHeadNormRope(EPS, 8, base=None, mode=mode, **options)


BAD_CALLS = {
    "no table": (dict(), DualHeadNormValueError, "freqs are required"),
    "wrong size": (dict(freqs=mx.ones((3,))), DualHeadNormValueError,
                   "freqs must be one dimensional with size 4 but got shape (3)"),
    "two dimensions": (dict(freqs=mx.ones((1, 4))), DualHeadNormValueError,
                       "freqs must be one dimensional with size 4"),
    "scalar": (dict(freqs=mx.array(1.0)), DualHeadNormValueError,
               "freqs must be one dimensional with size 4 but got shape ()"),
    "a list": (dict(freqs=[1.0, 2.0, 3.0, 4.0]), TypeError, "freqs must be an mlx.core.array"),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
@pytest.mark.parametrize("mode", MODES)
def test_bad_tables_raise_naming_the_operation(case, mode):
    arguments, error, message = BAD_CALLS[case]
    inputs = random_inputs((1, 1, 2, 8), (1, 1, 2, 8), mx.float32, 1)
    norm_rope = make_freqs_object(mode)
    with pytest.raises(error, match=r"^\[dual_head_norm_rope\] " + _escaped(message)):
        norm_rope(*inputs, offset=0, **arguments)
    # What mx.fast.rope itself refuses, it refuses too.
    if error is DualHeadNormValueError and "freqs" in arguments:
        with pytest.raises(ValueError, match="freqs must be one dimensional"):
            mx.fast.rope(inputs[0], 8, traditional=False, base=None, scale=1.0, offset=0,
                         freqs=arguments["freqs"])
    # The object still works after a refused call.
    table = mx.ones((4,))
    assert_pairs_identical(
        norm_rope(*inputs, offset=0, freqs=table),
        composed_dual_head_norm_rope(*inputs, eps=EPS, dims=8, base=None, freqs=table),
        "after a refused call",
    )


def test_a_table_for_an_object_with_a_base_is_refused():
    inputs = random_inputs((1, 1, 2, 8), (1, 1, 2, 8), mx.float32, 1)
    norm_rope = CompiledDualHeadNormRope(EPS, 8, base=1e4)
    with pytest.raises(DualHeadNormValueError, match="only one of base or freqs"):
        norm_rope(*inputs, offset=0, freqs=mx.ones((4,)))


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(input_scale=math.inf), DualHeadNormValueError, "input_scale must be finite"),
        (dict(input_scale=math.nan), DualHeadNormValueError, "input_scale must be finite"),
        (dict(input_scale=1e39), DualHeadNormValueError, "input_scale must be finite"),
        (dict(input_scale="2"), TypeError, "input_scale must be a real number"),
        (dict(input_scale=True), TypeError, "input_scale must be a real number"),
    ],
)
def test_bad_input_scales(options, error, message):
    with pytest.raises(error, match=r"^\[dual_head_norm_rope\] " + _escaped(message)):
        make_freqs_object(**options)


def test_c_api_refuses_a_base_with_frequencies():
    rope = ffi.new("mlx_dualnorm_rope_parameters *",
                   dict(dims=8, base=1e4, scale=1.0, with_freqs=True))
    created = ffi.new("mlx_dualnorm_dual_head_norm_rope **")
    error = ffi.new("mlx_dualnorm_error *")
    status = lib.mlx_dualnorm_dual_head_norm_rope_new(
        created, 1e-6, rope[0], lib.MLX_DUALNORM_MODE_COMPILED, error
    )
    assert status == lib.MLX_DUALNORM_INVALID_ARGUMENT
    assert ffi.string(error.operation) == b"dual_head_norm_rope"
    assert b"only one of base or freqs" in ffi.string(error.description)


def _escaped(message):
    import re

    return re.escape(message)


# ---- Properties ----------------------------------------------------------------------


def test_properties_and_repr():
    norm_rope = CompiledDualHeadNormRope(EPS, 8, base=None, input_scale=0.1, mode="composed")
    assert norm_rope.base is None
    assert norm_rope.input_scale == float(mx.array(0.1, dtype=mx.float32).item())
    assert "base=None" in repr(norm_rope) and "input_scale=0.1" in repr(norm_rope)
    plain = CompiledDualHeadNormRope(EPS, 8, base=1e4, mode="composed")
    assert plain.base == 1e4 and plain.input_scale is None
    assert "input_scale" not in repr(plain)
    with pytest.raises(AttributeError):
        norm_rope.input_scale = 2.0  # type: ignore[misc]


# ---- Transforms --------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("transform", ["vjp", "jvp", "vmap", "compile"])
@pytest.mark.parametrize("rope_name", ["llama3", "yarn", "su"])
def test_transforms_give_the_composed_calls_bits(mode, transform, rope_name):
    """vjp, jvp (every input's: queries, keys, weights) and vmap of a
    scaled RoPE give the bits of the same transform of the composed calls,
    the table a constant of both. MLX has no jvp of the input scale's
    multiply (SliceUpdate with Prod): there both refuse alike."""
    rope = scaled_ropes(32)[rope_name]
    dims, traditional, input_scale = constants_of(rope)
    table = rope._freqs
    queries, keys, query_weight, key_weight = random_inputs(
        (2, 3, 4, 64), (2, 3, 2, 64), mx.float32, 9
    )
    norm_rope = CompiledDualHeadNormRope(
        1e-5, dims, base=None, traditional=traditional, input_scale=input_scale, mode=mode
    )

    def ours(q, k, wq, wk):
        return list(norm_rope(q, k, wq, wk, offset=5, freqs=table))

    def composed(q, k, wq, wk):
        return list(
            composed_dual_head_norm_rope(
                q, k, wq, wk, eps=1e-5, dims=dims, base=None, traditional=traditional,
                offset=5, freqs=table, input_scale=input_scale,
            )
        )

    stacked = [mx.stack([side, 0.5 * side]) for side in (queries, keys)]
    primals = [queries, keys, query_weight, key_weight]
    if transform == "jvp" and input_scale is not None:
        for function in (composed, ours):
            with pytest.raises(RuntimeError, match=r"\[SliceUpdate\] JVP for product"):
                mx.eval(mx.jvp(function, primals, primals))
        return
    assert_transforms_agree(
        transform, ours, composed, primals, [*stacked, query_weight, key_weight]
    )
