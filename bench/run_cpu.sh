#!/usr/bin/env bash
# Full CPU benchmark of mlx_dualnorm into bench-results/ (JSON, PNG chart,
# text table) plus the host-path profile.
#
#   bench/run_cpu.sh [OUTPUT_DIR] [extra benchmark options...]
#
# PYTHON selects the interpreter (default: python). The run takes about a
# minute on 2 cores; keep the machine otherwise idle (the JSON records the
# load average, and the min-max spreads show disturbance).
set -euo pipefail

repository_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
output_dir="${1:-${repository_root}/bench-results}"
shift || true
python="${PYTHON:-python}"

mkdir -p "${output_dir}"
cd "${repository_root}"

# Pin MLX to the CPU, and keep numpy's OpenBLAS threads from competing for
# the cores with MLX's CPU stream.
export OPENBLAS_NUM_THREADS=1

"${python}" -m mlx_dualnorm bench --device cpu --output-dir "${output_dir}" \
    --all-metrics "$@" | tee "${output_dir}/benchmark.txt"
"${python}" bench/targets.py "${output_dir}/benchmark.json" \
    | tee -a "${output_dir}/benchmark.txt" || true
"${python}" bench/chart.py "${output_dir}" || true  # needs matplotlib

"${python}" bench/profile_host_path.py --output-dir "${output_dir}" \
    | tee "${output_dir}/host_path_profile.txt"

echo "results in ${output_dir}"
