#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py's docstring): on a lent GPU machine, from the repository's root, with the
# wheels of benchmarks/gpu/wheels.sh carried in .whl/:
#   MIST_DS_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/gpu/check.sh [gpu_check's options]
# Writes $OUT/gpu_check.md (and the steps' logs under $OUT/logs) and prints the results last.
set -uo pipefail
out=${OUT:-outputs/gpu_check}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mist_ds_site \
  .whl/*.whl || { echo "check.sh: installing the carried wheels failed (run benchmarks/gpu/wheels.sh here first)"; exit 1; }
export PYTHONPATH="/tmp/mist_ds_site:$PWD" PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/mist_ds_torch_extensions
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
python3 -m benchmarks.gpu_check --out "$out" "$@"
