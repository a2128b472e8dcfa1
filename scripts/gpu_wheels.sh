#!/usr/bin/env bash
# Fetch, on a machine with pip access, the wheels the GPU check needs beyond a CUDA PyTorch image (omegaconf,
# hydra-core and its antlr4 runtime; torchao, so that the low-bit optimizers are checked on the GPU too), into
# .whl/ (git-ignored), for a GPU machine that cannot reach PyPI. scripts/gpu_check.sh unpacks whatever .whl/ holds
# (python -m zipfile, no pip needed there) before it runs. Usage: ./scripts/gpu_wheels.sh [python version]
# The versions are constraints.txt's; torchao 0.18 loads on torch 2.11 (its low-bit optimizers are pure Python).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER="${1:-3.12}"
PIP="${PIP:-python3 -m pip}"
mkdir -p .whl
pin() { grep -E "^$1==" constraints.txt; }
# omegaconf and hydra-core are pure Python; torchao's wheel is for this machine's platform (x86-64 Linux, as the
# GPU machine's). antlr4-python3-runtime 4.9.3 (the version hydra-core 1.3 pins) is published as a source archive
# only, so it is built into a wheel here.
$PIP download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp -d .whl \
  "$(pin omegaconf)" "$(pin hydra-core)" "$(pin torchao)"
$PIP wheel --quiet --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls -1 .whl
