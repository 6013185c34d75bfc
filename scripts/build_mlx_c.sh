#!/usr/bin/env bash
# Builds the upstream mlx-c C API against the INSTALLED MLX wheel and
# installs it (shared libmlxc.so, public headers, CMake package) to PREFIX,
# so the package can be built and tested against the real mlx-c
# (`MLX_C_DIR=PREFIX`, see build_ffi.py; scripts/test_against_mlx_c.sh).
#
#   scripts/build_mlx_c.sh SOURCE PREFIX
#
# SOURCE is an mlx-c source archive (.tar.gz, one top folder) or checkout;
# it is never modified: the build works on a copy. PYTHON selects the
# interpreter whose importable `mlx` is built against (default: python3).
# No network: mlx-c's CMake option MLX_C_USE_SYSTEM_MLX finds the wheel's
# own CMake package (<mlx>/share/cmake/MLX) instead of downloading MLX.
#
# API drift: an mlx-c release targets one MLX release, and a newer MLX may
# change a C++ signature mlx-c calls. Each known change is fixed below ONLY
# when the installed MLX's headers show it, by adding the one argument the
# newer signature takes at that position (the value that keeps the older
# behaviour). When a fix is needed but mlx-c's call no longer looks as
# expected, the build stops and says which: the fix must then be revisited.
#
# libmlxc.so gets an rpath to the wheel's mlx/lib, so whoever links it finds
# the very libmlx.so it was built against without LD_LIBRARY_PATH.
#
# Environment: PYTHON, JOBS (default 2: the build machines are small),
# KEEP_BUILD=1 keeps the build folder (its path is printed).
set -euo pipefail

if [[ $# -ne 2 ]]; then
  echo "usage: $0 SOURCE PREFIX  (SOURCE: mlx-c .tar.gz or checkout)" >&2
  exit 2
fi
SOURCE="$(realpath "$1")"
PREFIX="$(realpath -m "$2")"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-2}"

# Run from / so a folder named `mlx` in the caller's directory (an mlx-c
# checkout has one) cannot shadow the installed package.
MLX_DIR="$(cd / && "$PYTHON" -c 'import mlx, os; print(mlx.__path__[0])')"
MLX_VERSION="$(cd / && "$PYTHON" -c 'import mlx.core as mx; print(mx.__version__)')"
if [[ ! -f "$MLX_DIR/lib/libmlx.so" || ! -f "$MLX_DIR/share/cmake/MLX/MLXConfig.cmake" ]]; then
  echo "error: $MLX_DIR has no lib/libmlx.so or share/cmake/MLX: install an MLX" \
       "backend wheel (pip install 'mlx[cpu]')" >&2
  exit 1
fi
echo "mlx-c: building $SOURCE against MLX $MLX_VERSION at $MLX_DIR"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/build_mlx_c.XXXXXX")"
if [[ "${KEEP_BUILD:-0}" == 1 ]]; then
  echo "mlx-c: build folder kept at $WORK"
else
  trap 'rm -rf "$WORK"' EXIT
fi

if [[ -d "$SOURCE" ]]; then
  cp -a "$SOURCE" "$WORK/src"
elif [[ -f "$SOURCE" ]]; then
  mkdir "$WORK/src"
  tar -xzf "$SOURCE" -C "$WORK/src" --strip-components=1
else
  echo "error: $SOURCE is neither an archive nor a folder" >&2
  exit 1
fi
if [[ ! -f "$WORK/src/mlx/c/mlx.h" || ! -f "$WORK/src/CMakeLists.txt" ]]; then
  echo "error: $SOURCE is not an mlx-c source tree (no mlx/c/mlx.h)" >&2
  exit 1
fi

# Each fix: the mlx-c source file, the C++ function it calls, the installed
# MLX header declaring it, the index of the parameter the newer MLX added, a
# word naming that parameter in the declaration, and the argument passed
# there. A call is patched only when it passes one argument fewer than the
# installed declaration has; one that already passes them all is left alone.
"$PYTHON" - "$WORK/src" "$MLX_DIR/include/mlx" <<'PY'
import pathlib
import re
import sys

source_root = pathlib.Path(sys.argv[1])
mlx_headers = pathlib.Path(sys.argv[2])

FIXES = [
    # MLX 0.32: the compile cache is per thread and named by a handle.
    ("mlx/c/compile.cpp", "compile_erase", "compile_impl.h", 0,
     "CompileCacheWeakPtr", "mlx::core::detail::compile_cache()"),
    ("mlx/c/compile.cpp", "compile_clear_cache", "compile_impl.h", 0,
     "CompileCacheWeakPtr", "mlx::core::detail::compile_cache()"),
    # MLX 0.32: sdpa gained `bool force_fused = false` before the stream.
    ("mlx/c/fast.cpp", "scaled_dot_product_attention", "fast.h", 7,
     "force_fused", "false"),
    # MLX 0.32: gather_qmm gained `global_scale` (optional) after `mode`.
    ("mlx/c/ops.cpp", "gather_qmm", "ops.h", 10,
     "global_scale", "std::nullopt"),
]


def fail(message):
    sys.exit(f"error: mlx-c API drift fix no longer applies: {message}")


def openings(text, callee):
    """Offsets just past each `callee(` in `text`."""
    return [m.end() for m in re.finditer(rf"\b{re.escape(callee)}\s*\(", text)]


def argument_spans(text, after_open):
    """(start, end) of each top-level argument of the parenthesized list
    opening just before `after_open`, and the offset of its `)`."""
    depth, argument_start, spans = 1, after_open, []
    for position in range(after_open, len(text)):
        char = text[position]
        depth += char in "([{"
        depth -= char in ")]}"
        if (char == "," and depth == 1) or depth == 0:
            if text[argument_start:position].strip():
                spans.append((argument_start, position))
            argument_start = position + 1
        if depth == 0:
            return spans, position
    raise ValueError("unbalanced parentheses")


for source_name, callee, header_name, index, marker, argument in FIXES:
    header_text = (mlx_headers / header_name).read_text()
    declarations = openings(header_text, callee)
    if not declarations:
        fail(f"the installed MLX's {header_name} no longer declares {callee}")
    spans, _ = argument_spans(header_text, declarations[0])
    parameters = [header_text[start:end].strip() for start, end in spans]
    if not any(marker in parameter for parameter in parameters):
        print(f"mlx-c: {callee}: the installed MLX has the signature mlx-c targets")
        continue
    if index >= len(parameters) or marker not in parameters[index]:
        fail(f"{callee}'s new parameter '{marker}' is no longer parameter "
             f"{index} in the installed {header_name}: {parameters}")

    source_path = source_root / source_name
    text = source_path.read_text()
    calls = openings(text, callee)
    if len(calls) != 1:
        fail(f"{source_name} has {len(calls)} calls to {callee}, expected one")
    spans, close = argument_spans(text, calls[0])
    if len(spans) == len(parameters):
        print(f"mlx-c: {callee}: the call already passes every parameter")
        continue
    if len(spans) != len(parameters) - 1 or len(spans) < index:
        fail(f"{source_name} calls {callee} with {len(spans)} arguments; the "
             f"installed MLX takes {len(parameters)} with '{marker}' at {index}")
    if index < len(spans):
        insert_at, inserted = spans[index][0], f" {argument},"
    else:
        insert_at, inserted = close, (", " if spans else "") + argument
    source_path.write_text(text[:insert_at] + inserted + text[insert_at:])
    print(f"mlx-c: {callee}: passing {argument} for the installed MLX's '{marker}'")
PY

cmake -S "$WORK/src" -B "$WORK/build" \
  -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=ON \
  -DMLX_C_USE_SYSTEM_MLX=ON \
  -DMLX_C_BUILD_EXAMPLES=OFF \
  -DMLX_DIR="$MLX_DIR/share/cmake/MLX" \
  -DCMAKE_INSTALL_PREFIX="$PREFIX" \
  -DCMAKE_INSTALL_LIBDIR=lib \
  -DCMAKE_INSTALL_RPATH="$MLX_DIR/lib" \
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON
cmake --build "$WORK/build" -j "$JOBS"
cmake --install "$WORK/build"
echo "mlx-c: installed to $PREFIX (libmlxc.so with rpath $MLX_DIR/lib)"
