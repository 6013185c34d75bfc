#!/usr/bin/env bash
# Installs the project's bundled mlx-c subset (csrc/mlxc) as an mlx-c
# prefix, laid out as upstream installs one, so a C program builds the same
# way against the subset or against upstream mlx-c (scripts/build_mlx_c.sh):
#
#   scripts/build_subset_mlx_c.sh PREFIX
#
#   PREFIX/include/mlx/c/*.h   the public headers (never private/)
#   PREFIX/lib/libmlxc.so      csrc/mlxc/mlx/c/*.cpp, built against the
#                              installed MLX wheel, with an rpath to its
#                              mlx/lib so linkers and loaders find the very
#                              libmlx.so it was built against
#
# Environment: PYTHON (the interpreter whose `mlx` is built against,
# default the python3 on PATH: give a virtual environment's, e.g.
# PYTHON=.venv/bin/python, when MLX is installed there), CXX (default g++),
# CXXFLAGS (default -O2), JOBS (parallel compiles, default 2: the build
# machines are small). The script says which Python it uses, and stops
# with one line when that Python has no MLX.
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 PREFIX" >&2
  exit 2
fi
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="$(realpath -m "$1")"
PYTHON="${PYTHON:-python3}"
CXX="${CXX:-g++}"
CXXFLAGS="${CXXFLAGS:--O2}"
JOBS="${JOBS:-2}"
SUBSET="$REPO/csrc/mlxc"

PYTHON_PATH="$(command -v "$PYTHON" || true)"
if [[ -z "$PYTHON_PATH" ]]; then
  echo "mlx-c subset: no Python '$PYTHON' found; set PYTHON= to the interpreter that has MLX installed (e.g. PYTHON=.venv/bin/python)" >&2
  exit 2
fi
# Absolute (it runs from / below), symlinks kept: a venv's python is one.
PYTHON_PATH="$(realpath -s "$PYTHON_PATH")"
echo "mlx-c subset: using Python $PYTHON_PATH (set PYTHON= to use another)"
# From /, so the caller's folder cannot add a stray `mlx` portion.
if ! (cd / && "$PYTHON_PATH" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("mlx.core") is None)') 2>/dev/null; then
  echo "mlx-c subset: $PYTHON_PATH has no MLX (import mlx.core fails); set PYTHON= to the interpreter that has it (e.g. PYTHON=.venv/bin/python), or install it there: pip install 'mlx[cpu]'" >&2
  exit 2
fi

source "$REPO/scripts/mlx_wheel.sh"
MLX_DIR="$(mlx_wheel_dir "$PYTHON_PATH")"
echo "mlx-c subset: building $SUBSET against $MLX_DIR"

OBJECTS="$(mktemp -d "${TMPDIR:-/tmp}/build_subset_mlx_c.XXXXXX")"
trap 'rm -rf "$OBJECTS"' EXIT

# One compiler per source, JOBS at a time; xargs fails if any of them does.
# The C functions need default visibility: they are the library's API.
# shellcheck disable=SC2086  # CXXFLAGS is a list of flags
printf '%s\0' "$SUBSET"/mlx/c/*.cpp |
  xargs -0 -P "$JOBS" -I{} sh -c '"$0" -std=c++20 -fPIC -Wall $1 -I"$2" -isystem "$3/include" \
      -c "$4" -o "$5/$(basename "$4" .cpp).o"' \
      "$CXX" "$CXXFLAGS" "$SUBSET" "$MLX_DIR" {} "$OBJECTS"

mkdir -p "$PREFIX/include/mlx/c" "$PREFIX/lib"
# CXXFLAGS at the link as well: -fsanitize=... needs its runtime there.
# shellcheck disable=SC2086
"$CXX" -shared $CXXFLAGS -o "$PREFIX/lib/libmlxc.so" "$OBJECTS"/*.o \
  -L"$MLX_DIR/lib" -lmlx -Wl,-rpath,"$MLX_DIR/lib"
install -m 644 "$SUBSET"/mlx/c/*.h "$PREFIX/include/mlx/c/"
echo "mlx-c subset: installed to $PREFIX (libmlxc.so with rpath $MLX_DIR/lib)"
