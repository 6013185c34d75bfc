"""Builds mlx_dualnorm's C extensions against the installed MLX.

Two extension modules, one MLX runtime:

* ``mlx_dualnorm._native`` (cffi, API mode): the mlx-c subset in
  ``csrc/mlxc`` (C++ over ``libmlx.so``) and the plain-C composite in
  ``csrc/dual_head_norm.c``, declared to cffi by ``csrc/cdefs``.
* ``mlx_dualnorm._interop`` (nanobind, MLX's domain): hands ``mx.array``
  objects to the composite without copies, since cffi has no ``PyObject*``.

Both link the very ``libmlx.so`` of the importable ``mlx`` package (found
through ``mlx.__path__``; the ``mlx[cpu]`` and ``mlx[cuda13]`` backends
install the same layout) with an rpath to it, and the package imports
``mlx.core`` first, so the dynamic linker reuses the loaded ``libmlx.so``
(same soname) and the process holds one MLX runtime.

``MLX_C_DIR=/prefix`` builds against an installed upstream mlx-c
(``/prefix/include/mlx/c``, ``/prefix/lib/libmlxc.*``) instead of the
bundled subset.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import sys
from typing import NamedTuple

from cffi import FFI

ROOT = pathlib.Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
BUNDLED_MLX_C = CSRC / "mlxc"
NATIVE_MODULE = "mlx_dualnorm._native"
INTEROP_MODULE = "mlx_dualnorm._interop"

C_FLAGS = ["-std=c11", "-Wall", "-Wextra"]
CXX_FLAGS = ["-std=c++20", "-Wall", "-fvisibility=hidden"]


class MlxInstall(NamedTuple):
    """Where the importable mlx package keeps its C++ headers and libmlx."""

    include_dir: pathlib.Path
    library_dir: pathlib.Path

    @property
    def link_args(self) -> list[str]:
        # Installed side by side in site-packages: $ORIGIN/../mlx/lib. The
        # absolute path serves in-place (editable) builds.
        return [
            "-Wl,-rpath,$ORIGIN/../mlx/lib",
            f"-Wl,-rpath,{self.library_dir}",
        ]


def find_mlx_install() -> MlxInstall:
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "mlx_dualnorm builds against the installed MLX: "
            "pip install 'mlx[cpu]==0.32.4' (or mlx[cuda13]) first"
        )
    for location in spec.submodule_search_locations:
        package_dir = pathlib.Path(location)
        if (package_dir / "lib" / "libmlx.so").exists() and (
            package_dir / "include" / "mlx" / "mlx.h"
        ).exists():
            return MlxInstall(package_dir / "include", package_dir / "lib")
    raise RuntimeError(
        "found the mlx package but no lib/libmlx.so with headers beside it; "
        "on Linux install a backend: pip install 'mlx[cpu]==0.32.4'"
    )


class MlxCSource(NamedTuple):
    """The mlx-c implementation compiled in: bundled sources, or an install."""

    include_dir: pathlib.Path
    sources: list[str]
    library_dirs: list[str]
    libraries: list[str]
    link_args: list[str]


def find_mlx_c() -> MlxCSource:
    installed_prefix = os.environ.get("MLX_C_DIR")
    if installed_prefix:
        prefix = pathlib.Path(installed_prefix).resolve()
        if not (prefix / "include" / "mlx" / "c" / "mlx.h").exists():
            raise RuntimeError(f"MLX_C_DIR={prefix} has no include/mlx/c/mlx.h")
        library_dir = prefix / "lib"
        return MlxCSource(
            include_dir=prefix / "include",
            sources=[],
            library_dirs=[str(library_dir)],
            libraries=["mlxc"],
            link_args=[f"-Wl,-rpath,{library_dir}"],
        )
    return MlxCSource(
        include_dir=BUNDLED_MLX_C,
        sources=sorted(
            str(path.relative_to(ROOT)) for path in (BUNDLED_MLX_C / "mlx" / "c").glob("*.cpp")
        ),
        library_dirs=[],
        libraries=[],
        link_args=[],
    )


def assemble_cdef() -> str:
    """The cffi declarations of every area, in dependency order."""
    sys.path.insert(0, str(CSRC))
    try:
        cdefs = importlib.import_module("cdefs")
        areas = [importlib.import_module(f"cdefs.{area}") for area in cdefs.AREAS]
    finally:
        sys.path.remove(str(CSRC))
    return "\n".join(area.TYPES for area in areas) + "\n".join(
        area.FUNCTIONS for area in areas
    )


def make_ffibuilder() -> FFI:
    mlx = find_mlx_install()
    mlx_c = find_mlx_c()
    builder = FFI()
    builder.cdef(assemble_cdef())
    builder.set_source(
        NATIVE_MODULE,
        '#include "dual_head_norm.h"\n',
        sources=["csrc/dual_head_norm.c", *mlx_c.sources],
        include_dirs=[str(CSRC), str(mlx_c.include_dir)],
        library_dirs=[*mlx_c.library_dirs, str(mlx.library_dir)],
        libraries=[*mlx_c.libraries, "mlx", "stdc++"],
        extra_compile_args=["-isystem", str(mlx.include_dir)],
        extra_link_args=[*mlx_c.link_args, *mlx.link_args],
    )
    return builder


def make_interop_extension():
    """The nanobind bridge, compiled with nanobind's single-file build."""
    import nanobind
    from setuptools import Extension

    mlx = find_mlx_install()
    mlx_c = find_mlx_c()
    nanobind_dir = pathlib.Path(nanobind.source_dir()).parent
    return Extension(
        INTEROP_MODULE,
        sources=[
            "csrc/interop/array_bridge.cpp",
            "csrc/interop/nanobind_runtime.cpp",
        ],
        include_dirs=[
            str(CSRC),
            str(mlx_c.include_dir),
            nanobind.include_dir(),
            nanobind.source_dir(),
            str(nanobind_dir / "ext" / "robin_map" / "include"),
        ],
        define_macros=[("NB_DOMAIN", "mlx")],
        library_dirs=[str(mlx.library_dir)],
        libraries=["mlx", "stdc++"],
        extra_compile_args=["-isystem", str(mlx.include_dir), "-O2"],
        extra_link_args=mlx.link_args,
    )


ffibuilder = make_ffibuilder()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
