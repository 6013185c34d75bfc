"""Importing mlx_dualnorm under an MLX other than the one it was compiled
against raises an ImportError naming both and the fix, before any extension
module (MLX's own included) is loaded.

The first tests copy the package as imported here (installed or in-place
built, extension modules included) into a temporary folder and change only
its build record, then import that copy in a fresh interpreter: the guard
runs exactly as shipped, against the MLX really installed. The last test
imports the package under a really different MLX release, in a virtual
environment CI makes (mlx 0.32.3 beside this package's wheel).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

import mlx_dualnorm
from mlx_dualnorm import _built_against, _mlx_version_guard

PACKAGE_DIR = pathlib.Path(mlx_dualnorm.__file__).resolve().parent
OTHER_MLX_PYTHON_SETTING = "MLX_DUALNORM_OTHER_MLX_PYTHON"

IMPORT_AND_REPORT = textwrap.dedent(
    """
    import sys
    try:
        import mlx_dualnorm
    except ImportError as error:
        print("IMPORT ERROR:", error)
    else:
        print("IMPORTED FROM:", mlx_dualnorm.__file__)
    loaded = sorted(
        name for name in ("mlx.core", "mlx_dualnorm._native", "mlx_dualnorm._interop")
        if name in sys.modules
    )
    print("LOADED EXTENSIONS:", loaded)
    """
)


def _copy_with_record(tmp_path: pathlib.Path, record: str | None) -> pathlib.Path:
    """A copy of the package whose build record reads ``record`` (None: no
    record at all); returns the folder to put on the path."""
    site = tmp_path / "site"
    shutil.copytree(PACKAGE_DIR, site / "mlx_dualnorm", ignore=shutil.ignore_patterns("__pycache__"))
    record_file = site / "mlx_dualnorm" / "_built_against.py"
    if record is None:
        record_file.unlink()
    else:
        record_file.write_text(record)
    return site


def _import_in_fresh_interpreter(site: pathlib.Path) -> str:
    process = subprocess.run(
        [sys.executable, "-c", IMPORT_AND_REPORT],
        # The copy first; the rest of the path as it is (MLX may be found through it).
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
        },
        cwd=str(site),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert process.returncode == 0, process.stdout + process.stderr
    return process.stdout


def _record(version: str, backend: str) -> str:
    return f"MLX_VERSION = {version!r}\nMLX_BACKEND = {backend!r}\n"


def test_the_record_matches_the_installed_mlx() -> None:
    installed = _mlx_version_guard.installed_mlx()
    assert installed is not None
    assert (_built_against.MLX_VERSION, _built_against.MLX_BACKEND) == tuple(installed)


def test_an_unchanged_copy_imports(tmp_path: pathlib.Path) -> None:
    """The control: the copying itself leaves an importable package."""
    site = _copy_with_record(tmp_path, (PACKAGE_DIR / "_built_against.py").read_text())
    output = _import_in_fresh_interpreter(site)
    assert f"IMPORTED FROM: {site / 'mlx_dualnorm' / '__init__.py'}" in output, output


def test_another_mlx_release_is_refused_before_any_extension_loads(tmp_path: pathlib.Path) -> None:
    installed = _mlx_version_guard.installed_mlx()
    site = _copy_with_record(tmp_path, _record("0.30.1", installed.backend))
    output = _import_in_fresh_interpreter(site)
    assert (
        f"IMPORT ERROR: [import mlx_dualnorm] mlx_dualnorm was compiled against mlx 0.30.1 "
        f"({installed.backend} backend), but mlx {installed.version} ({installed.backend} "
        f"backend) is installed" in output
    ), output
    assert f'pip install "mlx[{installed.backend}]==0.30.1"' in output
    assert "rebuild mlx_dualnorm from its source" in output
    assert "LOADED EXTENSIONS: []" in output


def test_another_mlx_backend_is_refused(tmp_path: pathlib.Path) -> None:
    installed = _mlx_version_guard.installed_mlx()
    other_backend = "cuda13" if installed.backend == "cpu" else "cpu"
    site = _copy_with_record(tmp_path, _record(installed.version, other_backend))
    output = _import_in_fresh_interpreter(site)
    assert f"compiled against mlx {installed.version} ({other_backend} backend)" in output, output
    assert f'pip install "mlx[{other_backend}]=={installed.version}"' in output
    assert "LOADED EXTENSIONS: []" in output


def test_a_build_without_a_record_is_refused(tmp_path: pathlib.Path) -> None:
    site = _copy_with_record(tmp_path, None)
    output = _import_in_fresh_interpreter(site)
    assert "has no record of the MLX it was compiled against" in output, output
    assert "LOADED EXTENSIONS: []" in output


@pytest.mark.skipif(
    not os.environ.get(OTHER_MLX_PYTHON_SETTING),
    reason=f"needs {OTHER_MLX_PYTHON_SETTING}: the python of a virtual environment with "
    "another MLX release and this package installed (.ci/run makes one)",
)
def test_a_real_other_mlx_release_is_refused() -> None:
    other_python = os.environ[OTHER_MLX_PYTHON_SETTING]
    # That environment's own packages only, whatever this run's path is.
    own_environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    version_probe = subprocess.run(
        [other_python, "-c", "import importlib.metadata as m; print(m.version('mlx'))"],
        capture_output=True, text=True, check=True, env=own_environment,
    )
    other_version = version_probe.stdout.strip()
    assert other_version != _built_against.MLX_VERSION
    guarded = subprocess.run(
        [other_python, "-c", IMPORT_AND_REPORT],
        capture_output=True, text=True, cwd="/", timeout=120, env=own_environment,
    )
    assert (
        f"compiled against mlx {_built_against.MLX_VERSION} (cpu backend), but mlx "
        f"{other_version} (cpu backend) is installed" in guarded.stdout
    ), guarded.stdout + guarded.stderr
    assert "LOADED EXTENSIONS: []" in guarded.stdout
    # What the guard stands in front of: the extension itself cannot load there.
    unguarded = subprocess.run(
        [
            other_python,
            "-c",
            "import importlib.util, mlx.core, pathlib\n"
            "package = importlib.util.find_spec('mlx_dualnorm').submodule_search_locations[0]\n"
            "path = next(pathlib.Path(package).glob('_native*.so'))\n"
            "spec = importlib.util.spec_from_file_location('mlx_dualnorm._native', path)\n"
            "importlib.util.module_from_spec(spec)\n",
        ],
        capture_output=True, text=True, cwd="/", timeout=120, env=own_environment,
    )
    assert unguarded.returncode != 0
    assert "undefined symbol" in unguarded.stderr, unguarded.stderr


def test_an_mlx_without_its_backend_is_told_to_install_one_not_blamed_on_the_abi(
    tmp_path: pathlib.Path,
) -> None:
    """``pip install mlx`` without ``[cpu]`` on Linux: the mlx package and its
    metadata, but neither mlx-cpu nor libmlx. Rebuilt here as a folder first
    on the path holding a copy of the installed mlx less its lib/ (and the
    mlx distribution's metadata only), with an unchanged copy of this package."""
    site = _copy_with_record(tmp_path, (PACKAGE_DIR / "_built_against.py").read_text())
    mlx_site = pathlib.Path(_mlx_version_guard._mlx_site_directory())
    shutil.copytree(
        mlx_site / "mlx", site / "mlx", ignore=shutil.ignore_patterns("lib", "include", "__pycache__")
    )
    (mlx_distribution,) = [
        path for path in mlx_site.glob("mlx-*.dist-info")
        if path.name.startswith(f"mlx-{_built_against.MLX_VERSION}")
    ]
    shutil.copytree(mlx_distribution, site / mlx_distribution.name)
    output = _import_in_fresh_interpreter(site)
    assert "is installed without a backend" in output, output
    assert 'pip install "mlx[cpu]" (or "mlx[cuda13]"' in output
    assert "C++ ABI" not in output
    assert "LOADED EXTENSIONS: []" in output
