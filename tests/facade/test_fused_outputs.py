"""``fused_outputs_in_device_pool()``: the public answer to where the fused
kernels' outputs come from (MLX's stream-ordered device pool, or its public
unified-memory allocator)."""

from __future__ import annotations

import pytest

import mlx_dualnorm
from mlx_dualnorm import _built_against
from mlx_dualnorm._native import lib

CUDA_BUILD = _built_against.MLX_BACKEND.startswith("cuda")


def test_the_query_is_public_and_answers_a_bool():
    assert "fused_outputs_in_device_pool" in mlx_dualnorm.__all__
    assert type(mlx_dualnorm.fused_outputs_in_device_pool()) is bool


@pytest.mark.skipif(CUDA_BUILD, reason="a build with the fused mode")
def test_a_build_without_the_fused_mode_never_reports_the_device_pool():
    assert mlx_dualnorm.fused_outputs_in_device_pool() is False


@pytest.mark.skipif(not CUDA_BUILD, reason="a build without the fused mode")
def test_a_cuda_build_takes_the_device_pool_exactly_over_the_mlx_build_it_compiled_against():
    # Not merely the same release (the import guard checks that): the same
    # libmlx.so build; tests/c/test_mlx_build_identity.py checks the
    # identity itself, and that the installed package matches it.
    assert mlx_dualnorm.fused_outputs_in_device_pool() is bool(
        lib.mlx_dualnorm_mlx_build_matches()
    )
