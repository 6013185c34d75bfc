"""setuptools driver: the cffi module comes from build_ffi.py, the nanobind
bridge from build_ffi.make_interop_extension, both against Python's stable
ABI; C and C++ sources get their own language standard (one Extension mixes
both)."""

import os
import pathlib
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import build_ffi  # noqa: E402
from build_backend import long_description  # noqa: E402


class BuildExtWithLanguageFlags(build_ext):
    """Adds C_FLAGS to .c and CXX_FLAGS to .cpp compiles, per file."""

    def build_extensions(self) -> None:
        compile_one = self.compiler._compile

        def compile_with_language_flags(obj, src, ext, cc_args, extra_postargs, pp_opts):
            language_flags = build_ffi.CXX_FLAGS if src.endswith(".cpp") else build_ffi.C_FLAGS
            compile_one(obj, src, ext, cc_args, [*extra_postargs, *language_flags], pp_opts)

        self.compiler._compile = compile_with_language_flags
        # A build against another MLX (release or backend) rewrites the record,
        # so extensions left in build/ by the previous one are rebuilt.
        for extension in self.extensions:
            extension.depends = [*extension.depends, str(build_ffi.BUILD_RECORD)]
        super().build_extensions()


# The import guard's record of the MLX compiled against (every build).
build_ffi.record_mlx_build()

setup(
    # pyproject.toml declares the readme dynamic: it is README.md with
    # absolute links, for a package index.
    long_description=long_description(pathlib.Path(__file__).resolve().parent / "README.md"),
    long_description_content_type="text/markdown",
    cffi_modules=["build_ffi.py:ffibuilder"],
    ext_modules=[build_ffi.make_interop_extension()],
    cmdclass={"build_ext": BuildExtWithLanguageFlags},
    options={
        # The two extension modules compile side by side (each is one long
        # compiler run or several, on machines with few cores).
        "build_ext": {"parallel": max(1, min(2, os.cpu_count() or 1))},
        # Both are built against the stable ABI (build_ffi.py): the wheel is
        # tagged cp310-abi3, one for every CPython from 3.10 on.
        "bdist_wheel": {"py_limited_api": build_ffi.WHEEL_PYTHON_TAG},
    },
)
