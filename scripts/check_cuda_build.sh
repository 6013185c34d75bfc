#!/usr/bin/env bash
# Builds the package's wheel from an sdist the way the README's CUDA command
# does (MLX_DUALNORM_BACKEND=cuda13, isolated: mlx[cuda13] and PyPI's CUDA
# runtime and fmt headers as build requirements), on a machine with no GPU,
# and checks the fused mode is compiled in and links against the CUDA
# libmlx.so. The module is not imported: MLX's CUDA build cannot be imported
# without NVIDIA's driver (libcuda.so.1), which a machine without a GPU lacks.
#
#   scripts/check_cuda_build.sh SDIST WORK_DIR
set -euo pipefail
sdist=$1
work=$2
python=${PYTHON:-python3}
mkdir -p "$work"
rm -rf "$work/cuda-venv" "$work/cuda-wheel" "$work/cuda-wheel-files" "$work/cuda-mlx"
"$python" -m venv "$work/cuda-venv"
pip="$work/cuda-venv/bin/pip"
"$pip" install -q --upgrade pip

echo "--- building the wheel with MLX_DUALNORM_BACKEND=cuda13 (isolated build)"
MLX_DUALNORM_BACKEND=cuda13 "$pip" wheel -q --no-deps -w "$work/cuda-wheel" "$sdist"
wheel=$(ls "$work"/cuda-wheel/mlx_dualnorm-*.whl)
"$work/cuda-venv/bin/python" -m zipfile -e "$wheel" "$work/cuda-wheel-files"
native=$(ls "$work"/cuda-wheel-files/mlx_dualnorm/_native*.so)

echo "--- the build record"
cat "$work/cuda-wheel-files/mlx_dualnorm/_built_against.py"
grep -qx "MLX_BACKEND = 'cuda13'" "$work/cuda-wheel-files/mlx_dualnorm/_built_against.py"

echo "--- the fused primitive is compiled in"
# Symbols go to a file first: `nm | grep -q` would fail under pipefail
# whenever grep stops reading early and nm dies of SIGPIPE.
nm -C "$native" > "$work/native-symbols"
# Both primitives' eval_gpu comes from their shared base, RowKernelPrimitive.
for primitive in FusedDualRmsNorm FusedDualRmsNormRope; do
  grep -q "RowKernelPrimitive<.*::$primitive>::eval_gpu(" "$work/native-symbols" \
    || { echo "FAIL: no $primitive eval_gpu (a fused primitive) in $native"; exit 1; }
done
cuda_backend_calls=$(nm -D -C --undefined-only "$native" | grep -c "mlx::core::cu::" || true)
echo "references into MLX's CUDA backend (mlx::core::cu::): $cuda_backend_calls"
[ "$cuda_backend_calls" -gt 0 ] || { echo "FAIL: the fused primitive calls no mlx::core::cu:: function"; exit 1; }

echo "--- every MLX symbol it needs is defined by the CUDA libmlx.so"
"$pip" download -q --no-deps -d "$work/cuda-mlx" "mlx-cuda-13==0.32.4"
"$work/cuda-venv/bin/python" -m zipfile -e "$work"/cuda-mlx/mlx_cuda_13-*.whl "$work/cuda-mlx/unpacked"
libmlx="$work/cuda-mlx/unpacked/mlx/lib/libmlx.so"
nm -D --defined-only "$libmlx" | awk '{print $NF}' | sort -u > "$work/cuda-mlx/defined"
nm -D --undefined-only "$native" | awk '{print $NF}' | grep -E '^_ZN(K)?3mlx' | sort -u > "$work/cuda-mlx/needed"
unresolved=$(comm -23 "$work/cuda-mlx/needed" "$work/cuda-mlx/defined")
if [ -n "$unresolved" ]; then
  echo "FAIL: symbols libmlx.so (CUDA) does not define:"; echo "$unresolved" | c++filt; exit 1
fi
echo "OK: $(wc -l < "$work/cuda-mlx/needed") MLX symbols, all defined by the CUDA libmlx.so"

echo "--- MLX's stream-ordered allocator is in libmlx.so's symbol table"
# The fused outputs come from cu::malloc_async, which libmlx.so builds
# hidden; csrc/fused/output_memory.cpp finds it in .symtab at run time and
# falls back to unified memory without it (docs/cuda-build.md).
nm "$libmlx" > "$work/cuda-mlx/all-symbols"
grep -q " t _ZN3mlx4core2cu12malloc_asyncEmRNS1_14CommandEncoderE$" "$work/cuda-mlx/all-symbols" \
  || { echo "FAIL: no cu::malloc_async in $libmlx's symbol table: fused outputs would take unified memory"; exit 1; }
echo "OK: cu::malloc_async found"

echo "--- the module is keyed to this very libmlx.so build"
# The fused mode uses cu::malloc_async and MLX's private shared_ptr layout
# only where the loaded libmlx.so has the build-id compiled in
# (csrc/fused/mlx_build_identity.cpp); the module keeps that build-id in
# its read-only data behind a fixed prefix.
libmlx_id=$(readelf -n "$libmlx" | sed -n 's/^ *Build ID: \([0-9a-f]*\)$/\1/p')
[ -n "$libmlx_id" ] || { echo "FAIL: $libmlx has no GNU build-id"; exit 1; }
strings -a "$native" > "$work/native-strings"
# (Debug information may repeat it: one distinct value is wanted.)
compiled_id=$(sed -n 's/^mlx_dualnorm compiled against libmlx build-id \([0-9a-f]*\)$/\1/p' "$work/native-strings" | sort -u)
echo "libmlx.so (CUDA wheel) build-id: $libmlx_id; compiled in: ${compiled_id:-none}"
[ "$compiled_id" = "$libmlx_id" ] \
  || { echo "FAIL: the module is keyed to build-id '${compiled_id}', not the CUDA libmlx.so's: fused outputs would take unified memory"; exit 1; }
grep -qx "MLX_LIBRARY_BUILD_ID = '$libmlx_id'" "$work/cuda-wheel-files/mlx_dualnorm/_built_against.py" \
  || { echo "FAIL: the build record names another libmlx.so build"; exit 1; }
echo "OK: compiled against the CUDA libmlx.so's build"
rm -rf "$work/cuda-venv" "$work/cuda-mlx"
