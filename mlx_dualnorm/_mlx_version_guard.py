"""Refuses to load the extension modules under an MLX they were not built for.

MLX's C++ ABI changes between releases, and its CPU and CUDA builds export
different symbols, so an extension compiled against one ``libmlx.so`` fails
under another with a dynamic-linker error that names a mangled symbol and
neither version. The build records which MLX it compiled against (in the
generated module ``mlx_dualnorm._built_against``); :func:`check_installed_mlx`
compares that record with the installed MLX before any extension module,
``mlx.core`` included, is loaded, and raises an ImportError that says both
and how to fix it.

The command line (``python -m mlx_dualnorm``, and the package's console
scripts) gets the same message as one line on stderr and exit status 2,
"cannot run here", in place of the ImportError's traceback: Python imports
the package before it runs its ``__main__`` (or the script's entry point),
so the guard itself tells that start-up apart (by runpy's frame on the
stack, or the script as ``__main__``); every other import gets the
ImportError.

This module reads package metadata only (no MLX import), so ``build_ffi.py``
loads it by path to describe the MLX it builds against in the same terms.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import pathlib
import sys
from types import FrameType
from typing import NamedTuple, Optional

CHECK_OPERATION = "import mlx_dualnorm"
BUILD_RECORD_MODULE = "mlx_dualnorm._built_against"
BUILD_RECORD_FILE = pathlib.Path(__file__).with_name("_built_against.py")

# The distributions that install libmlx.so into the mlx package on Linux,
# by the pip extra that selects each (``mlx[cpu]``, ``mlx[cuda13]``, ...).
BACKEND_DISTRIBUTIONS = {
    "cpu": "mlx-cpu",
    "cuda12": "mlx-cuda-12",
    "cuda13": "mlx-cuda-13",
}
UNKNOWN_BACKEND = "unknown"
MISSING_BACKEND = "no"  # ``mlx`` alone: neither a backend package nor a libmlx beside it
BACKEND_INSTALL_HINT = 'pip install "mlx[cpu]" (or "mlx[cuda13]" for NVIDIA GPUs)'


class MlxBuild(NamedTuple):
    """An MLX release and the backend its libmlx.so was built for."""

    version: str
    backend: str

    def describe(self) -> str:
        return f"mlx {self.version} ({self.backend} backend)"

    @property
    def backend_missing(self) -> bool:
        return self.backend == MISSING_BACKEND

    def requirement(self) -> str:
        """The pip requirement that installs exactly this MLX."""
        if self.backend in BACKEND_DISTRIBUTIONS:
            return f"mlx[{self.backend}]=={self.version}"
        return f"mlx=={self.version}"


def _mlx_site_directory() -> Optional[str]:
    """The folder that holds the importable ``mlx.core`` (found, not loaded),
    so the metadata read is that install's. ``mlx`` is a namespace package:
    any folder named mlx on the path joins it, so ask for ``mlx.core``."""
    try:
        spec = importlib.util.find_spec("mlx.core")
    except ImportError:
        return None
    if spec is None or not spec.origin:
        return None
    return str(pathlib.Path(spec.origin).resolve().parent.parent)


def _installed_version(distribution_name: str, site_directory: str) -> Optional[str]:
    for distribution in importlib.metadata.distributions(
        name=distribution_name, path=[site_directory]
    ):
        return distribution.version
    return None


def installed_mlx() -> Optional[MlxBuild]:
    """The importable MLX and its backend, from the metadata installed beside
    it; None where no ``mlx`` package can be imported."""
    site_directory = _mlx_site_directory()
    if site_directory is None:
        return None
    backend_versions = {
        backend: version
        for backend, distribution_name in BACKEND_DISTRIBUTIONS.items()
        if (version := _installed_version(distribution_name, site_directory)) is not None
    }
    # A CUDA backend installed over the CPU one overwrote its libmlx.so.
    cuda_backends = sorted(backend for backend in backend_versions if backend.startswith("cuda"))
    if cuda_backends:
        backend = cuda_backends[-1]
    elif backend_versions:
        backend = next(iter(backend_versions))
    elif not _has_mlx_library(site_directory):
        backend = MISSING_BACKEND
    else:
        backend = UNKNOWN_BACKEND  # a libmlx of its own, as on macOS or from source
    version = _installed_version("mlx", site_directory) or backend_versions.get(backend)
    return MlxBuild(version or UNKNOWN_BACKEND, backend)


def _has_mlx_library(site_directory: str) -> bool:
    """Whether a libmlx sits in the mlx package (put there by a backend
    package on Linux, or shipped in the mlx wheel itself elsewhere)."""
    return any((pathlib.Path(site_directory) / "mlx" / "lib").glob("libmlx*"))


def _recorded_build() -> Optional[MlxBuild]:
    """The record beside this very file (read by path, not imported: an
    import could be answered by another copy of the package, an editable
    install's finder for one, whose record would not describe these
    extension modules); None where there is none."""
    try:
        source = BUILD_RECORD_FILE.read_text()
    except FileNotFoundError:
        return None
    values = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }
    return MlxBuild(values["MLX_VERSION"], values["MLX_BACKEND"])


REBUILD_HINT = (
    "or rebuild mlx_dualnorm from its source against the installed MLX "
    "(pip install --no-build-isolation --no-deps --force-reinstall <source folder or sdist>; "
    "in a source tree: python setup.py build_ext --inplace)"
)


COMMAND_LINE_PACKAGE = "mlx_dualnorm"
EXIT_CANNOT_RUN_HERE = 2  # the command line's status for "cannot run here"


def _in_this_package(module: str) -> bool:
    return module == COMMAND_LINE_PACKAGE or module.startswith(COMMAND_LINE_PACKAGE + ".")


def _imported_to_run_the_command_line() -> bool:
    """Whether this import is ``python -m mlx_dualnorm`` (or ``-m`` of one
    of its modules) loading the package to run it: runpy's
    ``_run_module_as_main`` for that module is on the stack; or one of the
    package's console scripts (``mlx-lm-dualnorm``) doing so: the script
    is ``__main__``."""
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        if (
            frame.f_code.co_name == "_run_module_as_main"
            and frame.f_globals.get("__name__") == "runpy"
        ):
            return _in_this_package(str(frame.f_locals.get("mod_name", "")))
        frame = frame.f_back
    return _running_a_console_script()


def _running_a_console_script() -> bool:
    """Whether ``__main__`` is a console script of this package: its file
    is named as one whose entry point is in the package (read from the
    installed metadata only on this failure path)."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if not script:
        return False
    name = pathlib.Path(script).name
    for suffix in ("-script.pyw", "-script.py", ".exe"):  # the forms of Windows launchers
        name = name.removesuffix(suffix)
    try:
        scripts = importlib.metadata.entry_points(group="console_scripts", name=name)
    except Exception:  # unreadable metadata: not known to be ours
        return False
    return any(_in_this_package(script.value.split(":")[0].strip()) for script in scripts)


def check_installed_mlx() -> None:
    """Raises ImportError unless the installed MLX is the one the extension
    modules were compiled against (same release, same backend); under
    ``python -m mlx_dualnorm`` and the package's console scripts, prints
    its message as one line on stderr and exits 2 instead."""
    try:
        _check_installed_mlx()
    except ImportError as refusal:
        if not _imported_to_run_the_command_line():
            raise
        print(refusal, file=sys.stderr)
        raise SystemExit(EXIT_CANNOT_RUN_HERE) from None


def _check_installed_mlx() -> None:
    recorded = _recorded_build()
    installed = installed_mlx()
    if recorded is None:
        raise ImportError(
            f"[{CHECK_OPERATION}] this build of mlx_dualnorm has no record of the MLX it "
            f"was compiled against ({BUILD_RECORD_MODULE} is missing): {REBUILD_HINT}"
        )
    if installed is None:
        raise ImportError(
            f"[{CHECK_OPERATION}] mlx_dualnorm was compiled against {recorded.describe()}, "
            f"but no mlx package is installed: pip install \"{recorded.requirement()}\""
        )
    if installed.backend_missing:
        raise ImportError(
            f"[{CHECK_OPERATION}] mlx {installed.version} is installed without a backend "
            "(no libmlx: the mlx package alone does not run on Linux); mlx_dualnorm was "
            f"compiled against {recorded.describe()}: pip install \"{recorded.requirement()}\", "
            f"or in general {BACKEND_INSTALL_HINT}"
        )
    if installed != recorded:
        raise ImportError(
            f"[{CHECK_OPERATION}] mlx_dualnorm was compiled against {recorded.describe()}, "
            f"but {installed.describe()} is installed, and MLX's C++ ABI differs between "
            f"releases and backends. Install the MLX it was built for: "
            f"pip install \"{recorded.requirement()}\"; {REBUILD_HINT}"
        )
