#!/usr/bin/env bash
# Run the tests (sets up .venv first if it is missing): the planner lane, then the engine lane.
#   launch/test.sh            # what CI runs: planner lane (no DeepSpeed launch), then the engine lane (fast tests
#                             # of the modules that start DeepSpeed ranks); the first failing lane stops it
#   launch/test.sh --planner  # the planner lane only (a few minutes on 2 cores)
#   launch/test.sh --engine   # the engine lane only
#   launch/test.sh --slow     # both lanes with their slow tests too; run before resolving an issue
#   launch/test.sh -k config  # any other arguments go to pytest in each lane (-n 0: one process)
# The planner lane runs on two pytest-xdist workers, test by test (the balance matters more than running a module's
# fixtures once). The engine lane's modules (tests/conftest.py LAUNCHING_MODULES, marked `engine`) run in one
# process: no two launches at once.
set -euo pipefail
cd "$(dirname "$0")/.."
launch/setup.sh
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR="$PWD/.torch_extensions"
lanes=(planner engine)
speed="not slow"
args=()
for arg in "$@"; do
  case "$arg" in
    --slow) speed="" ;;
    --planner) lanes=(planner) ;;
    --engine) lanes=(engine) ;;
    *) args+=("$arg") ;;
  esac
done
for lane in "${lanes[@]}"; do
  marker="engine"; workers=(-n 0)
  if [ "$lane" = planner ]; then  # the engine lane's modules are not even imported (DeepSpeed's import is seconds)
    marker="not engine"; workers=(-n 2 --dist load)
    for module in $(.venv/bin/python -c 'from tests.conftest import LAUNCHING_MODULES as m; print(*sorted(m))'); do
      workers+=(--ignore="tests/$module.py")
    done
  fi
  [ -n "$speed" ] && marker="$speed and $marker"
  echo "== $lane lane: -m \"$marker\"" >&2
  start=$SECONDS
  rc=0
  .venv/bin/python -m pytest "${workers[@]}" -m "$marker" "${args[@]}" || rc=$?
  if [ "$rc" = 5 ]; then echo "== $lane lane: no test selected" >&2; continue; fi  # e.g. -k matching one lane only
  [ "$rc" = 0 ] || exit "$rc"
  echo "== $lane lane passed in $((SECONDS - start)) s" >&2
done
