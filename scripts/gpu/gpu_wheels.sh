#!/usr/bin/env bash
# Fetch, on a machine with pip access, the wheels the GPU check needs beyond a CUDA PyTorch image, for a GPU machine
# that cannot reach PyPI. scripts/gpu/gpu_check.sh unpacks them (python -m zipfile, no pip needed there) before it runs.
#   Usage: ./scripts/gpu/gpu_wheels.sh [python version]
# .whl/ (git-ignored): what this project needs (omegaconf, hydra-core and its antlr4 runtime; torchao, so that the
#   low-bit optimizers are checked on the GPU too), at constraints.txt's versions. torchao 0.18 loads on torch 2.11
#   (its low-bit optimizers are pure Python).
# .whl/peer/: torchtune 0.6.1 and what it needs that the GPU image lacks, for the llama8b stage (scripts/gpu/gpu_peer.py),
#   which puts them first on both sides' path, so that both step the same optimizer code. torchtune 0.6.1 imports
#   torchao.dtypes.nf4tensor and torchao.quantization.int4_weight_only: 0.14.1 is the newest torchao with both (0.17
#   and 0.18 lack them). kagglehub 0.3.12 is the last without the kagglesdk dependency. datasets (with dill and
#   multiprocess) serves torchtune's text_completion_dataset. Checked on a CPU (torch 2.13): torchtune's
#   full_finetune_single_device trains with these (scripts/gpu/gpu_peer.py --model tiny --device cpu).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYVER="${1:-3.12}"
PIP="${PIP:-python3 -m pip}"
mkdir -p .whl/peer
pin() { grep -E "^$1==" constraints.txt; }
BINARY=(--quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform any)
# omegaconf and hydra-core are pure Python; torchao's wheel is for x86-64 Linux, as the GPU machine's.
# antlr4-python3-runtime 4.9.3 (the version hydra-core 1.3 pins) is published as a source archive only, so it is
# built into a wheel here.
$PIP download "${BINARY[@]}" -d .whl "$(pin omegaconf)" "$(pin hydra-core)" "$(pin torchao)"
$PIP wheel --quiet --no-deps -w .whl antlr4-python3-runtime==4.9.3
$PIP download "${BINARY[@]}" -d .whl/peer torchtune==0.6.1 torchao==0.14.1 torchdata==0.11.0 kagglehub==0.3.12 \
  blobfile==3.3.0 pycryptodomex==3.23.0 "$(pin datasets)" dill==0.4.0 multiprocess==0.70.18
ls -1 .whl .whl/peer
