#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py's docstring): on a lent GPU machine, from the repository's root, with the
# wheels and commit.txt of benchmarks/gpu/wheels.sh carried in .whl/:
#   bash benchmarks/gpu/check.sh [gpu_check's options]     # device call: carry=[".whl"], timeout_s=500
# Writes into $OUT (the device tool returns at most 8 files from it) gpu_check.md, gpu_check.tgz (the steps' files
# and logs) and nvidia-smi.txt, the first two again after every step; prints a line per step and the results last.
# The steps end by MIST_DS_DEADLINE_S seconds (default 450), inside the device call's timeout.
set -uo pipefail
started=$(date +%s)  # the deadline counts the install too
out=${OUT:-outputs/gpu_check}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mist_ds_site \
  .whl/*.whl || { echo "check.sh: installing the carried wheels failed (run benchmarks/gpu/wheels.sh here first)"; exit 1; }
export PYTHONPATH="/tmp/mist_ds_site:$PWD" PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/mist_ds_torch_extensions
export MIST_DS_COMMIT="${MIST_DS_COMMIT:-$(cat .whl/commit.txt 2>/dev/null)}"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
rm -rf /tmp/mist_ds_gpu_check  # a rerun on the same machine reports only its own steps
python3 -m benchmarks.gpu_check --out /tmp/mist_ds_gpu_check --results "$out" \
  --deadline-s "$(( ${MIST_DS_DEADLINE_S:-450} - ($(date +%s) - started) ))" "$@"
