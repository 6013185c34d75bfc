"""Builds mlx_dualnorm's C extensions against the installed MLX.

Two extension modules, one MLX runtime:

* ``mlx_dualnorm._native`` (cffi, API mode): the mlx-c subset in
  ``csrc/mlxc`` (C++ over ``libmlx.so``), the plain-C composites in
  ``csrc/*.c`` (the dual head norm, and the dual head norm + RoPE), the
  fused CUDA launcher in ``csrc/fused`` (C++, kernel compiled by NVRTC at
  run time), declared to cffi by
  the headers themselves (``CDEF_HEADERS``).
* ``mlx_dualnorm._interop`` (nanobind, MLX's domain): hands ``mx.array``
  objects to the composite without copies, since cffi has no ``PyObject*``.

Both are built against Python's stable ABI, so one wheel serves every
CPython from 3.10 on (``make_interop_extension`` says how).

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

import importlib.util
import os
import pathlib
import sys
from typing import NamedTuple

from cffi import FFI

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import build_backend  # noqa: E402  (the backend setting and MLX release, one place)

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


class CudaPrimitiveBuild(NamedTuple):
    """What compiling the fused mode's MLX primitive takes: MLX's CUDA
    backend headers (shipped by the mlx[cuda13] wheel), the CUDA runtime's
    headers and fmt's headers (MLX's CUDA headers include both). Its
    sources include the fused backend tables, one file for a build with the
    primitives and one for a build without (as MLX splits backend/cuda and
    backend/no_gpu): the source list chooses, not the preprocessor."""

    sources: list[str]
    compile_args: list[str]
    define_macros: list[tuple[str, str]]


# A build without MLX's CUDA backend: tables that report the fused mode
# unavailable, nothing else.
BUILD_WITHOUT_CUDA = CudaPrimitiveBuild(
    sources=["csrc/fused/fused_dual_head_norm_no_cuda.c"], compile_args=[], define_macros=[]
)


# What MLX's CUDA headers include from the CUDA toolkit: cuda_runtime.h
# (which includes crt/host_config.h) and cuda.h.
CUDA_HEADERS_NEEDED = ("cuda_runtime.h", "crt/host_config.h", "cuda.h")
# MLX's mlx/backend/cuda/lru_cache.h (included by device.h, which declares
# the command encoder the primitive records its launch into) includes it.
FMT_HEADER_NEEDED = "fmt/format.h"


def _first_dir_with(candidates: list[str | None], relative_file: str) -> pathlib.Path | None:
    for candidate in candidates:
        if candidate and (pathlib.Path(candidate) / relative_file).exists():
            return pathlib.Path(candidate)
    return None


def mlx_has_cuda_backend() -> bool:
    """Whether the installed MLX is a CUDA build (mlx[cuda12] / mlx[cuda13]
    install an mlx-cuda-* distribution). The CPU wheel ships the CUDA
    headers too, so the headers alone do not tell."""
    return installed_mlx_build().backend.startswith("cuda")


def _site_dirs_with(relative_dir: str) -> list[str]:
    """Each import-path folder's ``relative_dir``, where it exists (the
    registry packages that carry headers install them under site-packages)."""
    return [
        str(pathlib.Path(entry) / relative_dir)
        for entry in sys.path
        if entry and (pathlib.Path(entry) / relative_dir).is_dir()
    ]


def cuda_include_candidates() -> list[str]:
    """Where the CUDA runtime's headers may be, in order: CUDA_HOME (or
    CUDA_PATH) when set, NVIDIA's header wheels (nvidia-cuda-runtime, a
    dependency of mlx[cuda13], and nvidia-cuda-crt), the usual toolkit."""
    explicit_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    return [
        *([f"{explicit_home}/include"] if explicit_home else []),
        *_site_dirs_with("nvidia/cu13/include"),
        "/usr/local/cuda/include",
    ]


def fmt_include_candidates() -> list[str]:
    """Where fmt's headers may be: MLX_DUALNORM_FMT_INCLUDE, the cmeel-fmt
    wheel (PyPI's fmt headers), then the OS (libfmt-dev)."""
    return [
        os.environ.get("MLX_DUALNORM_FMT_INCLUDE") or "",
        *_site_dirs_with("cmeel.prefix/include"),
        "/usr/include",
        "/usr/local/include",
    ]


def missing_cuda_build_pieces() -> tuple[list[str], pathlib.Path | None, pathlib.Path | None]:
    """(what is missing, in words; the CUDA include dir; the fmt include dir)."""
    missing = []
    cuda_candidates = cuda_include_candidates()
    cuda_include = None
    for candidate in cuda_candidates:
        if all((pathlib.Path(candidate) / header).exists() for header in CUDA_HEADERS_NEEDED):
            cuda_include = pathlib.Path(candidate)
            break
    if cuda_include is None:
        missing.append(
            "the CUDA runtime's headers (" + ", ".join(CUDA_HEADERS_NEEDED) + ") in none of "
            + ", ".join(cuda_candidates)
            + ": pip install 'nvidia-cuda-runtime==13.*' 'nvidia-cuda-crt==13.*', or set CUDA_HOME"
        )
    fmt_include = _first_dir_with(fmt_include_candidates(), FMT_HEADER_NEEDED)
    if fmt_include is None:
        missing.append(
            f"fmt's headers ({FMT_HEADER_NEEDED}): pip install cmeel-fmt, or apt install "
            "libfmt-dev, or set MLX_DUALNORM_FMT_INCLUDE"
        )
    return missing, cuda_include, fmt_include


def find_cuda_primitive_build(mlx: MlxInstall) -> CudaPrimitiveBuild | None:
    """The fused-mode build where everything it needs is found, else None
    (the package then reports mode 'fused' unavailable; 'auto' compiles).
    With MLX_DUALNORM_BACKEND=cuda13 the fused mode is required: anything
    missing stops the build with what to install, before any compiler runs."""
    requested = build_backend.requested_backend()
    if requested == "cpu":
        return None
    cuda_mlx = mlx_has_cuda_backend() and (
        mlx.include_dir / "mlx" / "backend" / "cuda" / "device.h"
    ).exists()
    if not cuda_mlx:
        if requested is not None:
            raise RuntimeError(
                f"[build mlx_dualnorm] {build_backend.BACKEND_SETTING}={requested}, but the MLX "
                f"found is {installed_mlx_build().describe()}: install "
                f"'mlx[{requested}]=={build_backend.MLX_VERSION}' (an isolated pip build does)"
            )
        return None
    missing, cuda_include, fmt_include = missing_cuda_build_pieces()
    if missing:
        problem = "MLX has a CUDA backend, but the fused mode needs " + "; and ".join(missing)
        if requested is not None:
            raise RuntimeError(f"[build mlx_dualnorm] {problem}")
        print(f"mlx_dualnorm: {problem}. Building without the fused mode.", file=sys.stderr)
        return None
    return CudaPrimitiveBuild(
        sources=[
            "csrc/fused/fused_dual_head_norm_cuda.cpp",
            "csrc/fused/fused_kernel_host.cpp",
            "csrc/fused/output_memory.cpp",
            "csrc/fused/fused_dual_head_norm_primitive.cpp",
            "csrc/fused/fused_dual_head_norm_rope_primitive.cpp",
        ],
        compile_args=["-isystem", str(cuda_include), "-isystem", str(fmt_include)],
        define_macros=[("FMT_HEADER_ONLY", "1")],
    )


# ---- The record of the MLX this build compiles against ---------------------
# mlx_dualnorm/_mlx_version_guard.py compares it with the installed MLX at
# import, before any extension module loads.

BUILD_RECORD = ROOT / "mlx_dualnorm" / "_built_against.py"
VERSION_GUARD_SOURCE = ROOT / "mlx_dualnorm" / "_mlx_version_guard.py"


def _load_version_guard():
    """The package's guard module, loaded by path (importing the package
    would load the very extensions being built)."""
    spec = importlib.util.spec_from_file_location("_mlx_dualnorm_version_guard", VERSION_GUARD_SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def installed_mlx_build():
    """The MLX being compiled against, as the import guard describes it."""
    installed = _load_version_guard().installed_mlx()
    if installed is None:
        find_mlx_install()  # raises its message on how to install MLX
    return installed


def record_mlx_build() -> None:
    """Writes mlx_dualnorm/_built_against.py (git-ignored, in every wheel and
    in-place build) with the MLX release and backend being compiled against,
    and the build-id of its libmlx.so (so that another libmlx.so of the same
    release changes the record, which rebuilds the extensions: setup.py)."""
    installed = installed_mlx_build()
    record = (
        '"""The MLX this build of mlx_dualnorm compiled against; written by\n'
        'build_ffi.py at build time (see _mlx_version_guard.py)."""\n\n'
        f"MLX_VERSION = {installed.version!r}\n"
        f"MLX_BACKEND = {installed.backend!r}\n"
        f"MLX_LIBRARY_BUILD_ID = {libmlx_build_id(find_mlx_install().library_dir / 'libmlx.so')!r}\n"
    )
    if not BUILD_RECORD.exists() or BUILD_RECORD.read_text() != record:
        BUILD_RECORD.write_text(record)


# ---- The identity of the libmlx.so compiled against ------------------------
# csrc/fused/mlx_build_identity.cpp compares it, with the version in
# mlx/version.h, against the libmlx.so loaded at run time; the fused mode
# relies on MLX's private layout only where they are the same build.

BUILD_ID_DEFINE = "MLX_DUALNORM_MLX_BUILD_ID"
_PT_NOTE = 4
_NT_GNU_BUILD_ID = 3


def libmlx_build_id(library: pathlib.Path) -> str:
    """The GNU build-id (lowercase hex) of a 64-bit little-endian ELF shared
    library, read from its PT_NOTE segments as the dynamic linker maps them
    (the same notes the run-time check reads); empty where it has none, and
    the fused mode then never relies on MLX's private layout."""
    import struct

    data = library.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise RuntimeError(f"[build mlx_dualnorm] {library} is not a 64-bit little-endian ELF file")
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for index in range(phnum):
        p_type, _flags, p_offset, _vaddr, _paddr, p_filesz, _memsz, p_align = struct.unpack_from(
            "<IIQQQQQQ", data, phoff + index * phentsize
        )
        if p_type != _PT_NOTE:
            continue
        alignment = 8 if p_align == 8 else 4
        notes = data[p_offset : p_offset + p_filesz]
        offset = 0
        while len(notes) - offset >= 12:
            name_size, description_size, note_type = struct.unpack_from("<III", notes, offset)
            name_at = offset + 12
            # The descriptor, then the next note, at the segment's alignment
            # from its start, as the dynamic linker reads them.
            description_at = -(-(name_at + name_size) // alignment) * alignment
            end = -(-(description_at + description_size) // alignment) * alignment
            if description_at + description_size > len(notes):
                break
            if note_type == _NT_GNU_BUILD_ID and notes[name_at : name_at + name_size] == b"GNU\0":
                return notes[description_at : description_at + description_size].hex()
            offset = end
    return ""


def mlx_build_id_define(mlx: MlxInstall) -> tuple[str, str]:
    """The -D define that carries the linked libmlx.so's build-id, as the C
    string literal mlx_build_identity.cpp expects."""
    return (BUILD_ID_DEFINE, f'"{libmlx_build_id(mlx.library_dir / "libmlx.so")}"')


# The headers cffi reads, in dependency order: each C area is declared once,
# in its header, and cffi compiles the module against those same headers.
CDEF_HEADERS = (
    "mlxc/mlx/c/error.h",
    "mlxc/mlx/c/array.h",
    "mlxc/mlx/c/vector.h",
    "mlxc/mlx/c/device.h",
    "mlxc/mlx/c/stream.h",
    "mlxc/mlx/c/closure.h",
    "mlxc/mlx/c/compile.h",
    "mlxc/mlx/c/optional.h",
    "mlxc/mlx/c/fast.h",
    # Internal, for the bridge only (it takes int offsets' scalars there).
    "private/position_scalar.h",
    "mlx_dualnorm/dual_head_norm_common.h",
    "mlx_dualnorm/dual_head_norm.h",
    "mlx_dualnorm/dual_head_norm_rope.h",
    "mlx_dualnorm/dual_head_norm_rope_cache.h",
    "fused/fused_dual_head_norm.h",
    "fused/mlx_build_identity.h",
)


def header_declarations(header: pathlib.Path) -> str:
    """A header's declarations as cffi's cdef takes them: without
    preprocessor lines and the extern "C" wrapper they guard (cffi drops
    comments itself)."""
    kept = []
    for line in header.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or stripped in ('extern "C" {', "}") and not kept_open(kept):
            continue
        kept.append(line)
    return "\n".join(kept)


def kept_open(lines: list[str]) -> bool:
    """Whether a '}' closes a brace opened in the declarations kept so far
    (rather than the extern "C" block)."""
    text = "\n".join(lines)
    return text.count("{") > text.count("}")


def assemble_cdef() -> str:
    """The cffi declarations of every area, read from the headers."""
    return "\n".join(header_declarations(CSRC / header) for header in CDEF_HEADERS)


def composite_sources() -> list[str]:
    """The plain-C composite: every .c file directly in csrc/ (the public
    headers in csrc/mlx_dualnorm/, the helpers' own in csrc/private/)."""
    return sorted(str(path.relative_to(ROOT)) for path in CSRC.glob("*.c"))


def make_ffibuilder() -> FFI:
    mlx = find_mlx_install()
    mlx_c = find_mlx_c()
    cuda_primitive = find_cuda_primitive_build(mlx) or BUILD_WITHOUT_CUDA
    builder = FFI()
    builder.cdef(assemble_cdef())
    builder.set_source(
        NATIVE_MODULE,
        '#include "mlx_dualnorm/dual_head_norm.h"\n'
        '#include "mlx_dualnorm/dual_head_norm_rope.h"\n'
        '#include "mlx_dualnorm/dual_head_norm_rope_cache.h"\n'
        '#include "fused/fused_dual_head_norm.h"\n'
        '#include "fused/mlx_build_identity.h"\n'
        '#include "private/position_scalar.h"\n',
        sources=[
            *composite_sources(),
            "csrc/fused/mlx_build_identity.cpp",
            *cuda_primitive.sources,
            *mlx_c.sources,
        ],
        define_macros=[*cuda_primitive.define_macros, mlx_build_id_define(mlx)],
        include_dirs=[str(CSRC), str(mlx_c.include_dir)],
        library_dirs=[*mlx_c.library_dirs, str(mlx.library_dir)],
        libraries=[*mlx_c.libraries, "mlx", "stdc++", "dl"],
        extra_compile_args=["-isystem", str(mlx.include_dir), *cuda_primitive.compile_args],
        extra_link_args=[*mlx_c.link_args, *mlx.link_args],
    )
    return builder


# The nanobind bridge is built in nanobind's split mode: the module holds
# only nanobind's headers' code, compiled against Python's stable ABI from
# STABLE_ABI_FLOOR on (one _interop.abi3.so for every later CPython), and
# reaches nanobind's runtime through the nanobind-backend package, which
# PyPI carries per interpreter. That runtime is not limited-API, so it shares
# MLX's nanobind domain with mlx.core's own runtime (the same internals key);
# a runtime compiled into this module under the stable ABI would keep a type
# registry apart from MLX's and never see mx.array.
STABLE_ABI_FLOOR = (3, 10)
PY_LIMITED_API = f"0x{STABLE_ABI_FLOOR[0]:02X}{STABLE_ABI_FLOOR[1]:02X}0000"
WHEEL_PYTHON_TAG = f"cp{STABLE_ABI_FLOOR[0]}{STABLE_ABI_FLOOR[1]}"
NANOBIND_BACKEND_MODULE = "nanobind_backend"
NANOBIND_BACKEND_DISTRIBUTION = "nanobind-backend"


def stable_abi_problem() -> str | None:
    """Why this interpreter cannot build the stable-ABI modules, or None."""
    import platform
    import sysconfig

    if platform.python_implementation() != "CPython":
        return f"{platform.python_implementation()}: the extensions target CPython's stable ABI"
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return (
            "a free-threaded CPython: the extensions target the stable ABI of the "
            "GIL build (abi3)"
        )
    return None


def make_interop_extension():
    """The nanobind bridge: one stable-ABI module, nanobind's split mode."""
    import nanobind
    from setuptools import Extension

    problem = stable_abi_problem()
    if problem:
        raise RuntimeError(f"[build mlx_dualnorm] {problem}")
    mlx = find_mlx_install()
    mlx_c = find_mlx_c()
    return Extension(
        INTEROP_MODULE,
        sources=["csrc/interop/array_bridge.cpp"],
        include_dirs=[str(CSRC), str(mlx_c.include_dir), nanobind.include_dir()],
        define_macros=[
            ("NB_DOMAIN", "mlx"),
            ("NB_BACKEND_MODULE", NANOBIND_BACKEND_MODULE),
            ("NB_BACKEND_PYPI", NANOBIND_BACKEND_DISTRIBUTION),
            ("Py_LIMITED_API", PY_LIMITED_API),
        ],
        py_limited_api=True,
        library_dirs=[str(mlx.library_dir)],
        libraries=["mlx", "stdc++"],
        extra_compile_args=["-isystem", str(mlx.include_dir), "-O2"],
        extra_link_args=mlx.link_args,
    )


ffibuilder = make_ffibuilder()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
