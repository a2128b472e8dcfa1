#!/usr/bin/env bash
# Set up .venv (created or reused) and run the whole test suite, slow and distributed tests included.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -m "not slow" -x
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
exec python -m pytest "$@"
