"""The package ships ``py.typed``, so its annotations are part of its API:
every module must type-check against MLX's own stubs."""

from __future__ import annotations

import pathlib

import pytest

mypy_api = pytest.importorskip("mypy.api", reason="mypy comes with the test extra")

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]


def test_the_package_type_checks(tmp_path):
    stdout, stderr, status = mypy_api.run(
        [
            str(REPOSITORY / "mlx_dualnorm"),
            "--config-file", str(REPOSITORY / "pyproject.toml"),
            "--cache-dir", str(tmp_path / "mypy-cache"),
        ]
    )
    assert status == 0, stdout + stderr
