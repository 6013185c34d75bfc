"""Fixtures of the core tests."""

from __future__ import annotations

import mlx.core as mx
import pytest


@pytest.fixture
def rng_key() -> mx.array:
    return mx.random.key(20261129)
