"""The parity contract of the full-attention prework: ``CompiledDualHeadNormRope``
against ``composed_dual_head_norm_rope``, bit for bit.

The dual head norm + RoPE has its own signature (it takes RoPE's
parameters and a position offset, and returns ``(B, H, L, D)``), so it has
its own small matrix rather than a place in the dual norm's: every case
varies what the RoPE adds to the norm, the rest is taken from the models
that call it:

- shapes: decode (one token) and prefill (a few tokens), with grouped
  query heads, widths 128 and 256, full and partial rotary dims (Qwen3-Next
  rotates 64 of 256);
- dtypes: bfloat16 as models run, float16 and float32;
- offsets: 0, a small and a large int, and an ``mx.array`` with one offset
  per batch entry (what a batched server passes);
- weighted and weightless norms, ``traditional`` both ways, a position
  scale other than 1;
- no norms at all (an object made with ``eps=None``, the prework of
  attention without q/k norms), once per shape.

Each mode of this build and device that is not the reference is a path
(``rope_compiled``, and ``rope_fused`` where it runs); the comparison and the
report are those of :mod:`mlx_dualnorm.commands.parity.report`; the command
line of :mod:`mlx_dualnorm.commands.parity` runs this matrix after the dual
norm's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence, Union, cast

import mlx.core as mx

from mlx_dualnorm import (
    CompiledDualHeadNormRope,
    Mode,
    available_modes,
    composed_dual_head_norm_rope,
)
from mlx_dualnorm.commands.parity.inputs import DualNormInputs, case_key
from mlx_dualnorm.commands.parity.report import ParityReport, compare_call

__all__ = [
    "ROPE_FAMILY", "ROPE_ONLY_FAMILY", "ROPE_PATH_DESCRIPTIONS", "ROPE_REFERENCE_DESCRIPTION",
    "RopeParityCase",
    "available_rope_paths", "build_rope_parity_matrix", "rope_case_inputs",
    "run_rope_parity_matrix", "unavailable_rope_paths",
]

ROPE_FAMILY = "norm_rope"
ROPE_ONLY_FAMILY = "rope_only"  # the cases without norms
ROPE_REFERENCE_DESCRIPTION = (
    "composed_dual_head_norm_rope (rms_norm, transpose, rope per side; no rms_norm for rope_only)"
)
ROPE_PATH_PREFIX = "rope_"
ROPE_PATH_DESCRIPTIONS = {
    "rope_compiled": "mlx_dualnorm.CompiledDualHeadNormRope(mode='compiled'): "
    "one compiled graph for the norms, transposes and RoPE",
    "rope_fused": "mlx_dualnorm.CompiledDualHeadNormRope(mode='fused'): one kernel (CUDA)",
}
RMS_NORM_EPSILON = 1e-6
ROPE_BASE = 10000.0

OffsetSpec = Union[int, tuple[int, ...]]
"""An int offset, or one offset per batch entry (passed as an int32 array)."""


@dataclass(frozen=True)
class RopeParityCase:
    batch_size: int
    sequence_length: int
    query_heads: int
    key_heads: int
    width: int
    dims: int
    dtype_name: str
    offset: OffsetSpec
    weighted: bool = True
    traditional: bool = False
    scale: float = 1.0
    norms: bool = True  # False: the object made without norms (eps=None)
    family: str = ROPE_FAMILY

    @property
    def query_shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, self.sequence_length, self.query_heads, self.width)

    @property
    def key_shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, self.sequence_length, self.key_heads, self.width)

    def describe(self) -> str:
        return " ".join(
            [
                f"q={self.query_shape}",
                f"k={self.key_shape}",
                f"dims={self.dims}",
                f"dtype={self.dtype_name}",
                f"offset={self.offset}",
                ("weighted" if self.weighted else "weightless") if self.norms
                else "without norms",
                f"traditional={self.traditional}",
                f"scale={self.scale}",
            ]
        )


def build_rope_parity_matrix(quick: bool = False) -> list[RopeParityCase]:
    """Every shape with every dtype, the offset, weighting and RoPE
    variant rotating across them; ``quick`` keeps one dtype per shape."""
    shapes = (
        # (batch, sequence, query heads, key heads, width, dims)
        (1, 1, 16, 2, 256, 64),  # Qwen3-Next full-attention decode, partial rotary
        (1, 1, 16, 8, 128, 128),  # Qwen3 decode
        (2, 1, 8, 2, 128, 128),  # a batch of two decodes
        (1, 6, 4, 1, 256, 64),  # a short prefill
        (2, 3, 4, 4, 128, 32),  # batched prefill, few rotated features
    )
    offsets: tuple[OffsetSpec, ...] = (0, 7, 4095)
    dtype_names = ("bfloat16",) if quick else ("bfloat16", "float16", "float32")
    cases = []
    position = 0
    for shape in shapes:
        batch = shape[0]
        for dtype_name in dtype_names:
            offset: OffsetSpec = offsets[position % len(offsets)]
            if batch > 1 and position % 2:
                offset = tuple(3 + 97 * entry for entry in range(batch))
            cases.append(
                RopeParityCase(
                    *shape,  # the case's first fields, in their order
                    dtype_name=dtype_name,
                    offset=offset,
                    weighted=position % 3 != 2,
                    traditional=position % 4 == 3,
                    scale=0.5 if position % 5 == 4 else 1.0,
                )
            )
            position += 1
        cases.append(RopeParityCase(*shape, dtype_name="bfloat16", offset=offsets[1],
                                    weighted=False, norms=False, family=ROPE_ONLY_FAMILY))
    return cases


@dataclass(frozen=True)
class RopeInputs(DualNormInputs):
    """A dual norm's inputs and the RoPE's position offset."""

    offset: Union[int, mx.array]


def rope_case_inputs(case: RopeParityCase, seed: int) -> RopeInputs:
    """Evaluated inputs of one case, from the seed and its description."""
    query_key, key_key, query_weight_key, key_weight_key = mx.random.split(
        case_key(case.describe(), seed), 4
    )
    dtype = getattr(mx, case.dtype_name)
    queries = (4.0 * mx.random.normal(case.query_shape, key=query_key)).astype(dtype)
    keys = (4.0 * mx.random.normal(case.key_shape, key=key_key)).astype(dtype)
    query_weight = key_weight = None
    if case.weighted:
        query_weight = mx.random.uniform(-2.0, 2.0, (case.width,), key=query_weight_key)
        key_weight = mx.random.uniform(-2.0, 2.0, (case.width,), key=key_weight_key)
        query_weight, key_weight = query_weight.astype(dtype), key_weight.astype(dtype)
    offset: Union[int, mx.array] = (
        case.offset if isinstance(case.offset, int) else mx.array(case.offset, dtype=mx.int32)
    )
    mx.eval([array for array in (queries, keys, query_weight, key_weight) if array is not None])
    return RopeInputs(queries, keys, query_weight, key_weight, offset)


RopeCall = Callable[[RopeInputs], "tuple[mx.array, mx.array]"]


def available_rope_paths() -> list[str]:
    """``rope_MODE`` for every mode but the reference that runs here."""
    return [
        ROPE_PATH_PREFIX + mode
        for mode in available_modes()
        if mode != "composed" and ROPE_PATH_PREFIX + mode in ROPE_PATH_DESCRIPTIONS
    ]


def unavailable_rope_paths(path_names: Sequence[str]) -> dict[str, str]:
    """Of the rope paths named, those this build or device cannot run, each
    with the reason."""
    available = available_rope_paths()
    return {
        name: f"mode {name.removeprefix(ROPE_PATH_PREFIX)!r} is not available here"
        for name in path_names
        if name not in available
    }


def _rope_call(path_name: str, case: RopeParityCase) -> RopeCall:
    """The path's call for one case's RoPE parameters (one object per
    parameter set, as a model builds one per attention layer)."""
    rope = CompiledDualHeadNormRope(
        RMS_NORM_EPSILON if case.norms else None,
        case.dims,
        base=ROPE_BASE,
        traditional=case.traditional,
        scale=case.scale,
        mode=cast(Mode, path_name.removeprefix(ROPE_PATH_PREFIX)),
    )

    def call(inputs: RopeInputs) -> tuple[mx.array, mx.array]:
        return rope(
            inputs.queries, inputs.keys, inputs.query_weight, inputs.key_weight,
            offset=inputs.offset,
        )

    return call


def run_rope_parity_matrix(
    path_names: Sequence[str],
    cases: Sequence[RopeParityCase],
    *,
    seed: int,
    matrix_name: str,
    bitwise: bool = True,
) -> dict[str, ParityReport]:
    """Every rope path over every case, against the composed norm + RoPE,
    reported as the dual norm's parity is."""
    reports = {
        path_name: ParityReport(
            path_name,
            matrix_name,
            seed,
            bitwise,
            reference_description=ROPE_REFERENCE_DESCRIPTION,
            path_description=(
                f"{path_name}: {ROPE_PATH_DESCRIPTIONS[path_name]}"
                if path_name in ROPE_PATH_DESCRIPTIONS
                else ""
            ),
        )
        for path_name in path_names
    }
    for case in cases:
        inputs = rope_case_inputs(case, seed)
        expected = composed_dual_head_norm_rope(
            inputs.queries,
            inputs.keys,
            inputs.query_weight,
            inputs.key_weight,
            eps=RMS_NORM_EPSILON if case.norms else None,
            dims=case.dims,
            base=ROPE_BASE,
            traditional=case.traditional,
            scale=case.scale,
            offset=inputs.offset,
            norms=case.norms,
        )
        mx.eval(expected)
        for path_name, report in reports.items():
            started = time.perf_counter()
            mismatch = compare_call(
                case, lambda: _rope_call(path_name, case)(inputs), expected, bitwise
            )
            report.record(case.family, mismatch, time.perf_counter() - started)
    return reports
