#!/usr/bin/env bash
# On the GPU device (see ../shared/gpu/README.md): unpack MLX CUDA, build the
# package in place, run the test suite and the device checks given as
# arguments (default: bench/gpu_probe.py). Output under $OUT when set.
set -uo pipefail
source .gpu/env.sh || exit 1
export PYTHONUNBUFFERED=1
# fmt headers for MLX's CUDA headers (libfmt-dev, carried in .gpu/fmt on the device).
export MLX_DUALNORM_FMT_INCLUDE=${MLX_DUALNORM_FMT_INCLUDE:-$PWD/.gpu/fmt}
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . 2>&1 | grep -v "^ *$" | tail -5
readelf -d /tmp/site/mlx/lib/libmlx.so | grep -i nvrtc
for script in "${@:-bench/gpu_probe.py}"; do
  echo "=== $script"
  python3 $script
done
