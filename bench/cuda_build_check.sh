#!/usr/bin/env bash
# On a CUDA machine with MLX CUDA unpacked from .gpu/: builds the package with
# MLX_DUALNORM_BACKEND=cuda13 against the CUDA MLX there, with the CUDA
# runtime and fmt headers taken from PyPI's wheels (no toolkit, CUDA_HOME
# unset), installs it outside the source tree and runs the main job and the
# core tests from that install on the GPU.
#
# The device reaches no registry, so the build cannot be isolated there: the
# wheels an isolated build would fetch (nvidia-cuda-runtime, nvidia-cuda-crt,
# cmeel-fmt, setuptools) are carried in WHEELS and the build runs with
# --no-build-isolation against the carried MLX (.gpu). CI proves the isolated
# build compiles and links (scripts/check_cuda_build.sh).
#
#   bench/cuda_build_check.sh [SOURCE_TREE] [WHEELS]   (from the checkout root, .gpu carried)
set -uo pipefail
tree=$(cd "${1:-.}" && pwd)
wheels=$(cd "${2:-.ship/wheels}" && pwd)
source .gpu/env.sh || exit 1
export PYTHONUNBUFFERED=1
unset CUDA_HOME CUDA_PATH MLX_DUALNORM_FMT_INCLUDE

echo "=== $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(nvidia-smi -L 2>/dev/null | head -1)"
python3 --version
tools=/tmp/cuda-build-tools
install=/tmp/mlx_dualnorm-install
rm -rf "$tools" "$install"
python3 -m pip install -q --no-index --no-deps --target "$tools" "$wheels"/*.whl || exit 1
export PYTHONPATH=$tools:$PYTHONPATH

echo "=== the build: MLX_DUALNORM_BACKEND=cuda13 pip install --no-build-isolation"
start=$(date +%s)
MLX_DUALNORM_BACKEND=cuda13 python3 -m pip install --no-build-isolation --no-deps --no-index \
  --target "$install" "$tree" 2>&1 | tail -3
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
echo "built in $(( $(date +%s) - start )) s"
cat "$install/mlx_dualnorm/_built_against.py" | grep MLX_

export PYTHONPATH=$install:$PYTHONPATH
cd /tmp || exit 1
python3 -c 'import mlx_dualnorm as m; print("imported from", m.__file__); print("modes", m.available_modes()); print("auto picks", m.CompiledDualHeadNorm(1e-6).mode)' || exit 1
status=0
echo "=== python -m mlx_dualnorm (installed)"
python3 -m mlx_dualnorm 2>&1 | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "=== core tests against the install"
MLX_DUALNORM_EXPECT_INSTALLED=$install python3 -m pytest -q -p no:cacheprovider -x \
  "$tree/tests/core/test_dual_head_norm.py" "$tree/tests/facade/test_installed_package.py" \
  "$tree/tests/facade/test_mlx_version_guard.py" "$tree/tests/facade/test_readme.py" 2>&1 | tail -8
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
