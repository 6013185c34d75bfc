"""The PEP 517 build backend: setuptools' own, with the MLX to compile
against chosen by one build setting.

An isolated build (pip's default) sees only the build requirements, so the
MLX the extensions compile and link against must be one of them. By default
that is ``mlx[cpu]``; ``MLX_DUALNORM_BACKEND=cuda13`` makes it the CUDA 13
build of the same release, plus the registry packages whose headers the
fused mode's MLX primitive compiles with (MLX's CUDA headers include the
CUDA runtime's headers and fmt's). Everything else is setuptools' backend
unchanged; setup.py and build_ffi.py do the build.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re

from setuptools import build_meta as _setuptools_backend
from setuptools.build_meta import *  # noqa: F401,F403  (the hooks not redefined here)

# Where the project lives; pyproject.toml's [project.urls] names the same.
PROJECT_URL = "https://github.com/mlx-dualnorm/mlx_dualnorm"
MLX_VERSION = "0.32.4"
BACKEND_SETTING = "MLX_DUALNORM_BACKEND"
DEFAULT_BACKEND = "cpu"

MLX_BUILD_REQUIREMENTS = {
    "cpu": [f"mlx[cpu]=={MLX_VERSION}"],
    "cuda13": [
        # Brings nvidia-cuda-runtime (cuda_runtime.h, cuda.h) as a dependency.
        f"mlx[cuda13]=={MLX_VERSION}",
        # The crt/ headers cuda_runtime.h includes; NVIDIA ships them apart.
        "nvidia-cuda-crt==13.*",
        # fmt's headers, which MLX's CUDA headers include (device.h ->
        # lru_cache.h): header-only use, any fmt 10 or later.
        "cmeel-fmt>=10",
    ],
}


def requested_backend() -> str | None:
    """The backend named by ``MLX_DUALNORM_BACKEND``, or None when unset."""
    value = os.environ.get(BACKEND_SETTING, "").strip().lower()
    if not value:
        return None
    if value not in MLX_BUILD_REQUIREMENTS:
        raise ValueError(
            f"[build mlx_dualnorm] {BACKEND_SETTING}={value!r} is not a backend this build "
            f"knows; use one of: {', '.join(sorted(MLX_BUILD_REQUIREMENTS))}"
        )
    return value


def _mlx_requirements() -> list[str]:
    return list(MLX_BUILD_REQUIREMENTS[requested_backend() or DEFAULT_BACKEND])


# The requirement hooks answer without running setup.py (setuptools' own
# would, and setup.py needs the MLX these very hooks ask for); the project
# has no setup_requires for setuptools to add.


def get_requires_for_build_wheel(config_settings=None):
    return _mlx_requirements()


def get_requires_for_build_editable(config_settings=None):
    return _mlx_requirements()


@contextlib.contextmanager
def _cpu_backend_for_sdist():
    """An sdist compiles nothing, but setup.py reads the installed MLX; it is
    built against the CPU MLX (small) whatever the wheel backend."""
    saved = os.environ.get(BACKEND_SETTING)
    os.environ[BACKEND_SETTING] = DEFAULT_BACKEND
    try:
        yield
    finally:
        if saved is None:
            del os.environ[BACKEND_SETTING]
        else:
            os.environ[BACKEND_SETTING] = saved


def get_requires_for_build_sdist(config_settings=None):
    return list(MLX_BUILD_REQUIREMENTS[DEFAULT_BACKEND])


def build_sdist(sdist_directory, config_settings=None):
    with _cpu_backend_for_sdist():
        return _setuptools_backend.build_sdist(sdist_directory, config_settings)


# A Markdown link's target: `](target)` or `](target "title")`.
_LINK_TARGET = re.compile(r"\]\((?P<target>[^)\s]+)(?P<rest>[^)]*)\)")
_ABSOLUTE = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|//)")


def absolute_link(target: str) -> str:
    """A README link target as it must read away from the repository: a
    path (file or folder, anchor kept) becomes its page under PROJECT_URL,
    an anchor alone the README's own page's anchor; a URL stays."""
    if _ABSOLUTE.match(target):
        return target
    if target.startswith("#"):
        return f"{PROJECT_URL}/blob/main/README.md{target}"
    path, _, anchor = target.partition("#")
    path = path.removeprefix("./")
    kind = "tree" if path.endswith("/") else "blob"
    return f"{PROJECT_URL}/{kind}/main/{path}" + (f"#{anchor}" if anchor else "")


def long_description(readme: "str | os.PathLike[str]") -> str:
    """The package's long description: README.md with its relative links
    made absolute (a package index shows the text without the repository's
    files beside it). Code blocks are left as they are; the file on disk
    keeps its relative links."""
    lines = []
    in_code = False
    for line in pathlib.Path(readme).read_text(encoding="utf-8").splitlines(keepends=True):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code:
            line = _LINK_TARGET.sub(
                lambda match: f"]({absolute_link(match['target'])}{match['rest']})", line
            )
        lines.append(line)
    return "".join(lines)
