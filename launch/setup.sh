#!/usr/bin/env bash
# Create .venv (if missing) with torch, DeepSpeed and mist_ds in editable mode with its test extra.
#
#   launch/setup.sh            # idempotent: does nothing when .venv is complete
#   MIST_PYTHON=python3.11 launch/setup.sh
#
# torch: on a machine whose python already has a torch (e.g. a CUDA build), the venv reuses it
# (--system-site-packages); otherwise torch==2.13.0 is installed first from launch/constraints-cpu.txt,
# before DeepSpeed, so that DeepSpeed's `torch` requirement is already satisfied and pip never
# resolves a CUDA build. On a machine where the pin would fetch a CUDA wheel from PyPI, set
#   MIST_TORCH_INDEX=https://download.pytorch.org/whl/cpu
# to take the CPU-only wheel from PyTorch's own index.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
stamp="$venv/.mist_ds_installed"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi
python=${MIST_PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  if "$python" -c 'import torch' >/dev/null 2>&1; then
    echo "mist_ds setup: reusing the torch of $python ($("$python" -c 'import torch; print(torch.__version__)'))" >&2
    "$python" -m venv --system-site-packages "$venv"
  else
    "$python" -m venv "$venv"
  fi
fi
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
if ! "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
  if [ -n "${MIST_TORCH_INDEX:-}" ]; then
    "${pip[@]}" --index-url "$MIST_TORCH_INDEX" -c launch/constraints-cpu.txt torch
  else
    "${pip[@]}" -c launch/constraints-cpu.txt torch
  fi
fi
torch_version=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)
"${pip[@]}" "torch==$torch_version" -e '.[test]'
touch "$stamp"
