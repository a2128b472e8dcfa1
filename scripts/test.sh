#!/usr/bin/env bash
# Set up .venv (created or reused) and run the whole test suite, slow and distributed tests included, in 2
# pytest-xdist workers of one OpenMP thread each (tests/conftest.py), a file to a worker (--dist loadfile: a file's
# module fixtures are built once). Extra arguments go to pytest, e.g. ./scripts/test.sh -m "not slow" -x;
# TEST_WORKERS=1 runs the tests in this one process instead (no xdist), TEST_WORKERS=4 in 4 workers.
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
  set -- -m numerics "$@"
fi
WORKERS="${TEST_WORKERS:-2}"
if [ "$WORKERS" -gt 1 ]; then
  set -- -n "$WORKERS" --dist loadfile "$@"
fi
exec python -m pytest "$@"
