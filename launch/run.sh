#!/usr/bin/env bash
# The main job on the embedded default (sets up .venv first if it is missing; no GPU needed):
#   launch/run.sh                       # tune the default model on the default cluster: plan files in outputs/
#   launch/run.sh model=llama2-7b cluster=a100-80g cluster.nodes=2
# Any arguments are Hydra overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
launch/setup.sh
exec .venv/bin/mist-ds tune "$@"
