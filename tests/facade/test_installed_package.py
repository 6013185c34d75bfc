"""What an install holds: every package of the source tree, its typing data
and its build record; and, where CI says the suite must run against an
installed wheel (MLX_DUALNORM_EXPECT_INSTALLED=<site-packages folder>), that
this process and the subprocesses the tests start import it from there,
never from the source tree."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import pathlib
import subprocess
import sys

import pytest

import mlx_dualnorm

SOURCE_PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "mlx_dualnorm"
IMPORTED_PACKAGE = pathlib.Path(mlx_dualnorm.__file__).resolve().parent
EXPECT_INSTALLED_SETTING = "MLX_DUALNORM_EXPECT_INSTALLED"


def _source_packages() -> list[str]:
    """Dotted names of mlx_dualnorm and its subpackages in the source tree."""
    return sorted(
        ".".join(init.parent.relative_to(SOURCE_PACKAGE.parent).parts)
        for init in SOURCE_PACKAGE.rglob("__init__.py")
        if "__pycache__" not in init.parts
    )


def test_every_source_package_is_importable_from_the_imported_package() -> None:
    packages = _source_packages()
    assert "mlx_dualnorm.integrations" in packages
    for name in packages:
        module = importlib.import_module(name)
        assert pathlib.Path(module.__file__).resolve().is_relative_to(IMPORTED_PACKAGE), name


def test_typing_data_and_build_record_are_beside_the_package() -> None:
    assert (IMPORTED_PACKAGE / "py.typed").is_file()
    for stub in SOURCE_PACKAGE.rglob("*.pyi"):
        assert (IMPORTED_PACKAGE / stub.relative_to(SOURCE_PACKAGE)).is_file(), stub
    assert (IMPORTED_PACKAGE / "_built_against.py").is_file()


def test_the_installed_distribution_declares_its_license_by_expression() -> None:
    """PEP 639: the wheel's metadata names the license by its SPDX
    expression and carries the license file in its .dist-info."""
    # The installed one (pip writes INSTALLER), not the egg-info a build of
    # the source tree leaves there, which a run from the tree also sees.
    (distribution,) = [
        found for found in importlib.metadata.distributions(name="mlx_dualnorm")
        if found.read_text("INSTALLER") is not None
    ]
    assert distribution.metadata["License-Expression"] == "MIT"
    assert distribution.metadata.get_all("License-File") == ["LICENSE"]
    license_files = [path for path in distribution.files or [] if path.name == "LICENSE"]
    assert [str(path.parent).split("/", 1)[-1] for path in license_files] == ["licenses"], license_files
    assert license_files[0].read_text().startswith("MIT License")


def test_both_extension_modules_are_built_for_the_stable_abi() -> None:
    """One wheel serves every CPython from 3.10 on: the cffi module and the
    nanobind bridge are both abi3 modules."""
    for name in ("_native", "_interop"):
        module = importlib.import_module(f"mlx_dualnorm.{name}")
        assert pathlib.Path(module.__file__).name == f"{name}.abi3.so", module.__file__


@pytest.mark.skipif(
    not os.environ.get(EXPECT_INSTALLED_SETTING),
    reason=f"{EXPECT_INSTALLED_SETTING} is not set: the suite may run on the source tree",
)
def test_the_suite_runs_against_the_installed_package() -> None:
    site_packages = pathlib.Path(os.environ[EXPECT_INSTALLED_SETTING]).resolve()
    assert IMPORTED_PACKAGE == site_packages / "mlx_dualnorm", IMPORTED_PACKAGE
    assert not IMPORTED_PACKAGE.is_relative_to(SOURCE_PACKAGE.parent)
    # The tests' subprocesses inherit this run's path and folder.
    child = subprocess.run(
        [sys.executable, "-c", "import mlx_dualnorm; print(mlx_dualnorm.__file__)"],
        capture_output=True, text=True, check=True,
    )
    assert pathlib.Path(child.stdout.strip()).resolve().parent == IMPORTED_PACKAGE
    print(f"mlx_dualnorm imported from {IMPORTED_PACKAGE}")
