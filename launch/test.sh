#!/usr/bin/env bash
# Run the tests (sets up .venv first if it is missing).
#   launch/test.sh            # fast lane: what CI runs (2 cores, a few minutes)
#   launch/test.sh --slow     # the slow lane too (many DeepSpeed launches); run before resolving an issue
#   launch/test.sh -k config  # any other arguments go to pytest (-n 4: more workers; -n 0: one process)
# Two pytest-xdist workers, a test module per worker at a time; the modules that start DeepSpeed ranks share one
# worker (tests/conftest.py LAUNCHING_MODULES), so no two launches run at once.
set -euo pipefail
cd "$(dirname "$0")/.."
launch/setup.sh
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR="$PWD/.torch_extensions"
markers=(-m "not slow")
args=()
for arg in "$@"; do
  if [ "$arg" = "--slow" ]; then markers=(); else args+=("$arg"); fi
done
exec .venv/bin/python -m pytest -n 2 --dist loadgroup "${markers[@]}" "${args[@]}"
