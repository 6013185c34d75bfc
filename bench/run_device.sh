#!/usr/bin/env bash
# On the GPU device (see ../shared/gpu/README.md; carry .gpu): unpack MLX
# CUDA, build the package in place (with the fused mode: CUDA headers from
# the image, fmt headers carried in .gpu/fmt), then run each argument as a
# shell command, logging to $OUT/NN.log when $OUT is set.
# Default: bench/gpu_probe.py.
set -uo pipefail
source .gpu/env.sh || exit 1
export PYTHONUNBUFFERED=1
export MLX_DUALNORM_FMT_INCLUDE=${MLX_DUALNORM_FMT_INCLUDE:-$PWD/.gpu/fmt}
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . 2>&1 | grep -v "^ *$" | tail -5
python3 -c 'import mlx_dualnorm as m; print("modes", m.available_modes())'
status=0
index=0
for command in "${@:-python3 bench/gpu_probe.py}"; do
  index=$((index + 1))
  log=${OUT:-/tmp}/$(printf '%02d' $index).log
  echo "=== $command"
  bash -c "$command" 2>&1 | tee "$log" | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
exit $status
