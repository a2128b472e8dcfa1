#!/usr/bin/env bash
# Set up .venv (created or reused) and run the whole test suite, slow and distributed tests included.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -m "not slow" -x
#
# ./scripts/test.sh --numerics [pytest arguments]: the portability check instead. It runs only the tests that
# compare floats (marker `numerics`, the rule in tests/numerics.py) with ATEN_CPU_CAPABILITY=default, PyTorch's
# unvectorised kernels, which add in another order than this CPU's: a tolerance that holds on one instruction
# set only fails here on every machine. Set ATEN_CPU_CAPABILITY yourself (avx2, avx512, ...) to try another.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
# Inductor's C++ cache is keyed without the instruction set ATEN_CPU_CAPABILITY picks: a run under another one gets
# a cache of its own, or compiled tests fail to build against headers made for the other (a C++ error, not a float).
if [ -n "${ATEN_CPU_CAPABILITY:-}" ] && [ -z "${TORCHINDUCTOR_CACHE_DIR:-}" ]; then
  export TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/torchinductor_$(id -un)_${ATEN_CPU_CAPABILITY}"
fi
if [ "${1:-}" = "--numerics" ]; then
  shift
  if [ -z "${ATEN_CPU_CAPABILITY:-}" ]; then
    export ATEN_CPU_CAPABILITY=default
    export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/torchinductor_$(id -un)_default}"
  fi
  echo "test.sh: numerics tests with ATEN_CPU_CAPABILITY=$ATEN_CPU_CAPABILITY"
  exec python -m pytest -m numerics "$@"
fi
exec python -m pytest "$@"
