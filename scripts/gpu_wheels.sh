#!/usr/bin/env bash
# Fetch, on a machine with pip access, the wheels the GPU suite needs beyond a CUDA PyTorch image (omegaconf,
# hydra-core and its antlr4 runtime), into .whl/ (git-ignored), for a GPU machine that cannot reach PyPI.
# scripts/gpu_check.sh installs whatever .whl/ holds before it runs. Usage: ./scripts/gpu_wheels.sh [python tag]
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER="${1:-3.12}"
PIP="${PIP:-python3 -m pip}"
mkdir -p .whl
# Pure-Python wheels: any platform. antlr4-python3-runtime 4.9.3 (the version hydra-core 1.3 pins) is published
# as a source archive only, so it is built into a wheel here.
$PIP download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp -d .whl \
  omegaconf==2.3.0 hydra-core==1.3.2
$PIP wheel --quiet --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls -1 .whl
