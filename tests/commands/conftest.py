"""Fixtures of the command tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def unpatched_mlx_lm():
    """mlx-lm as it ships before and after the test: the package's patch
    removed either side (the mlx-lm commands patch and unpatch it)."""
    from mlx_dualnorm.integrations import mlx_lm as integration

    integration.unpatch()
    yield
    integration.unpatch()
