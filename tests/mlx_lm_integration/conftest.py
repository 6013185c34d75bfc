"""Fixtures of the mlx-lm integration's tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def unpatched_mlx_lm():
    """mlx-lm as it ships before and after the test: the package's patch
    removed either side (modules of mlx-lm tests use it for every test)."""
    from mlx_dualnorm.integrations import mlx_lm as integration

    integration.unpatch()
    yield
    integration.unpatch()
