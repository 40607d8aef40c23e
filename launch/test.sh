#!/usr/bin/env bash
# Run the tests (sets up .venv first if it is missing): the planner lane, then the engine lane.
#   launch/test.sh            # what CI runs: planner lane (no DeepSpeed launch), then the engine lane (fast tests
#                             # of the modules that start DeepSpeed ranks); the first failing lane stops it
#   launch/test.sh --planner  # the planner lane only (under 3 minutes on 2 cores)
#   launch/test.sh --engine   # the engine lane only
#   launch/test.sh --slow     # both lanes with their slow tests too; run before resolving an issue
#   launch/test.sh -k config  # any other arguments go to pytest in each lane
# The planner lane runs on two pytest-xdist workers, test by test (the balance matters more than running a module's
# fixtures once). The engine lane's modules (tests/conftest.py LAUNCHING_MODULES, marked `engine`) run in one
# process whatever the arguments say: no two launches at once.
set -euo pipefail
cd "$(dirname "$0")/.."
launch/setup.sh
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR="$PWD/.torch_extensions"
# sympy's cache holds 1,000 results by default, which a trace's Max evaluations outgrow: 10,000 cut the tracing CPU by
# a fifth (same expressions) for a few MB. Read when sympy is imported, so set here, for every worker and subprocess.
export SYMPY_CACHE_SIZE="${SYMPY_CACHE_SIZE:-10000}"
lanes=()
speed="not slow"
args=()
for arg in "$@"; do
  case "$arg" in
    --slow) speed="" ;;
    --planner | --engine) lanes+=("${arg#--}") ;;
    *) args+=("$arg") ;;
  esac
done
[ "${#lanes[@]}" -gt 0 ] || lanes=(planner engine)
engine_modules=$(.venv/bin/python -c 'from tests.conftest import LAUNCHING_MODULES as m; print(*sorted(m))')
ran=0
for lane in "${lanes[@]}"; do
  if [ "$lane" = planner ]; then
    marker="not engine"; lane_flags=(-n 2 --dist load)
    for module in $engine_modules; do  # not even imported (DeepSpeed's import takes seconds)
      lane_flags+=(--ignore="tests/$module.py")
    done
  else
    marker="engine"; lane_flags=(-n 0)  # after the user's arguments: a -n there cannot run launches side by side
  fi
  [ -n "$speed" ] && marker="$speed and $marker"
  echo "== $lane lane: -m \"$marker\"" >&2
  start=$SECONDS
  rc=0
  .venv/bin/python -m pytest -m "$marker" ${args[@]+"${args[@]}"} "${lane_flags[@]}" || rc=$?
  if [ "$rc" = 5 ]; then echo "== $lane lane: no test selected" >&2; continue; fi  # e.g. -k matching one lane only
  [ "$rc" = 0 ] || exit "$rc"
  ran=$((ran + 1))
  echo "== $lane lane passed in $((SECONDS - start)) s" >&2
done
[ "$ran" -gt 0 ] || { echo "== no lane selected a test" >&2; exit 5; }
