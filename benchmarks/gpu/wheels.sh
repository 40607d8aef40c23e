#!/usr/bin/env bash
# Put into .whl/ (git-ignored) the packages the lent GPU machine lacks for benchmarks/gpu/check.sh: its image has
# Python 3.12 with a CUDA torch, numpy, scipy, sympy, numba, matplotlib, psutil, ninja, py-cpuinfo, msgpack, einops,
# tqdm and packaging, and reaches no registry. Run here, from the repository's root, before the device call:
#   benchmarks/gpu/wheels.sh            # then run(command="bash benchmarks/gpu/check.sh", carry=[".whl"],
#                                       #          timeout_s=500)
# It also writes .whl/commit.txt, this checkout's commit (the lent machine has no git history), for the results.
# Versions are this checkout's .venv's (the ones the tests ran). python-mip and its CBC (cbcbox, 191 MB, over the
# device tool's 64 MiB carry) stay behind: the check tunes one GPU, where the tuner never solves a MILP (it loads
# CBC only for tuner.partition_solver=milp). transformers stays behind too: the zoo's models never import it.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=.venv/bin/python
version() { "$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
rm -rf .whl && mkdir -p .whl
# typing-extensions: the image has one, of a version not recorded; the pydantic carried needs >= 4.16
binary=(pydantic pydantic_core annotated-types typing-inspection typing-extensions hjson hydra-core omegaconf)
pins=()
for name in "${binary[@]}"; do pins+=("$name==$(version "$name")"); done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
# published as source only: built here into pure-Python wheels (DeepSpeed without its compiled ops, as pip installs it)
"$py" -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==$(version antlr4-python3-runtime)" \
  "deepspeed==$(version deepspeed)"
"$py" -c "from benchmarks.common import source_tree; print(source_tree())" > .whl/commit.txt
du -sh .whl && ls .whl && cat .whl/commit.txt
