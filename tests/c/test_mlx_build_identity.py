"""The check that keys the fused mode's reliance on MLX's private workings
to the exact MLX build compiled against (csrc/fused/mlx_build_identity.*).

The installed package must find the loaded libmlx.so to be its own build.
The same translation unit, compiled here against the installed MLX's
headers and libmlx.so with the right build-id, must agree; compiled against
a copy of the headers that names another patch release, or with another
build-id recorded, it must refuse and name both builds.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess

import mlx.core as mx
import pytest

import mlx_dualnorm
from mlx_dualnorm._native import ffi, lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
IDENTITY_SOURCE = ROOT / "csrc" / "fused" / "mlx_build_identity.cpp"


def _load_build_ffi():
    """build_ffi.py, loaded by path (it is no package module)."""
    spec = importlib.util.spec_from_file_location("_test_build_ffi", ROOT / "build_ffi.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILD_FFI = _load_build_ffi()
MLX = BUILD_FFI.find_mlx_install()


def loaded_libmlx() -> pathlib.Path:
    """The libmlx.so this process has mapped (mlx.core loads it)."""
    mapped = {
        line.split()[-1]
        for line in pathlib.Path("/proc/self/maps").read_text().splitlines()
        if line.rstrip().endswith("/libmlx.so")
    }
    assert len(mapped) == 1, f"one libmlx.so expected in the process, found {sorted(mapped)}"
    return pathlib.Path(mapped.pop())


def readelf_build_id(library: pathlib.Path) -> str:
    """The GNU build-id binutils' readelf reads from `library`'s notes."""
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed")
    notes = subprocess.run([readelf, "-n", str(library)], capture_output=True, text=True, check=True)
    found = re.findall(r"Build ID: ([0-9a-f]+)", notes.stdout)
    assert len(found) == 1, notes.stdout
    return found[0]


def identity(version: str, build_id: str) -> str:
    return f"MLX {version} ({'build-id ' + build_id if build_id else 'no build-id'})"


class IdentityCheck:
    """One standalone build of the identity translation unit, loaded."""

    def __init__(self, library: pathlib.Path):
        self._library = ctypes.CDLL(str(library))
        for name in ("mlx_dualnorm_mlx_build_compiled", "mlx_dualnorm_mlx_build_loaded"):
            getattr(self._library, name).restype = ctypes.c_char_p
        self._library.mlx_dualnorm_mlx_build_matches.restype = ctypes.c_bool

    def matches(self) -> bool:
        return self._library.mlx_dualnorm_mlx_build_matches()

    def compiled(self) -> str:
        return self._library.mlx_dualnorm_mlx_build_compiled().decode()

    def loaded(self) -> str:
        return self._library.mlx_dualnorm_mlx_build_loaded().decode()


def build_identity_check(
    work: pathlib.Path, include_dir: pathlib.Path, build_id: str | None
) -> IdentityCheck:
    """Compiles mlx_build_identity.cpp against `include_dir`'s MLX headers and
    the installed libmlx.so, with `build_id` recorded as build_ffi.py records
    it (None: no define, as a build that records nothing)."""
    library = work / "libidentity.so"
    define = [] if build_id is None else [f'-D{BUILD_FFI.BUILD_ID_DEFINE}="{build_id}"']
    command = [
        os.environ.get("CXX", "g++"), *BUILD_FFI.CXX_FLAGS, "-fvisibility=default",
        "-O1", "-fPIC", "-shared", *define,
        "-I", str(ROOT / "csrc"), "-isystem", str(include_dir),
        str(IDENTITY_SOURCE), "-o", str(library),
        "-L", str(MLX.library_dir), "-lmlx", f"-Wl,-rpath,{MLX.library_dir}",
    ]  # fmt: skip
    compiled = subprocess.run(command, capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr
    return IdentityCheck(library)


@pytest.fixture(scope="module")
def right_build_id() -> str:
    build_id = readelf_build_id(loaded_libmlx())
    assert build_id, "the installed libmlx.so has a build-id"
    return build_id


def test_the_installed_package_was_compiled_against_the_loaded_mlx(right_build_id):
    expected = identity(mx.__version__, right_build_id)
    assert ffi.string(lib.mlx_dualnorm_mlx_build_loaded()).decode() == expected
    assert ffi.string(lib.mlx_dualnorm_mlx_build_compiled()).decode() == expected
    assert lib.mlx_dualnorm_mlx_build_matches()


def test_the_build_reads_the_build_id_readelf_reads(right_build_id):
    assert BUILD_FFI.libmlx_build_id(loaded_libmlx()) == right_build_id
    assert BUILD_FFI.mlx_build_id_define(MLX) == (BUILD_FFI.BUILD_ID_DEFINE, f'"{right_build_id}"')


def test_the_check_accepts_the_build_it_was_compiled_against(tmp_path, right_build_id):
    check = build_identity_check(tmp_path, MLX.include_dir, right_build_id)
    assert check.compiled() == identity(mx.__version__, right_build_id)
    assert check.loaded() == identity(mx.__version__, right_build_id)
    assert check.matches()


def test_the_check_refuses_headers_of_another_release(tmp_path, right_build_id):
    headers = tmp_path / "include"
    shutil.copytree(MLX.include_dir, headers)
    version_header = headers / "mlx" / "version.h"
    patch = re.search(r"#define MLX_VERSION_PATCH (\d+)", version_header.read_text())
    assert patch, "mlx/version.h defines MLX_VERSION_PATCH"
    other_patch = int(patch.group(1)) + 1
    version_header.write_text(
        version_header.read_text().replace(patch.group(0), f"#define MLX_VERSION_PATCH {other_patch}")
    )
    other_version = re.sub(r"\d+$", str(other_patch), mx.__version__)
    assert other_version != mx.__version__

    check = build_identity_check(tmp_path, headers, right_build_id)
    assert check.compiled() == identity(other_version, right_build_id)
    assert check.loaded() == identity(mx.__version__, right_build_id)
    assert not check.matches()


def test_the_check_refuses_another_build_id(tmp_path, right_build_id):
    other_build_id = right_build_id[::-1] if right_build_id[::-1] != right_build_id else "0" * 40
    check = build_identity_check(tmp_path, MLX.include_dir, other_build_id)
    assert check.compiled() == identity(mx.__version__, other_build_id)
    assert check.loaded() == identity(mx.__version__, right_build_id)
    assert not check.matches()


def test_the_check_refuses_when_no_build_id_was_recorded(tmp_path, right_build_id):
    check = build_identity_check(tmp_path, MLX.include_dir, None)
    assert check.compiled() == identity(mx.__version__, "")
    assert check.loaded() == identity(mx.__version__, right_build_id)
    assert not check.matches()


def test_fused_outputs_use_the_device_pool_only_in_the_build_compiled_against():
    """Run with -s on a GPU machine to see where the fused outputs come from."""
    in_device_pool = bool(lib.mlx_dualnorm_fused_outputs_in_device_pool())
    matches = bool(lib.mlx_dualnorm_mlx_build_matches())
    fused = "fused" in mlx_dualnorm.available_modes()
    print(
        f"\nMLX compiled against: {ffi.string(lib.mlx_dualnorm_mlx_build_compiled()).decode()}"
        f"\nMLX loaded: {ffi.string(lib.mlx_dualnorm_mlx_build_loaded()).decode()}"
        f"\nfused mode built: {fused}; fused outputs from "
        + ("MLX's stream-ordered device pool" if in_device_pool else "MLX's public allocator")
    )
    assert in_device_pool == (fused and matches)
