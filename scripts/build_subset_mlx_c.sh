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
# default python3), CXX (default g++), CXXFLAGS (default -O2), JOBS
# (parallel compiles, default 2: the build machines are small).
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

source "$REPO/scripts/mlx_wheel.sh"
MLX_DIR="$(mlx_wheel_dir "$PYTHON")"
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
