#!/usr/bin/env bash
# The GPU suite: run on a machine with a CUDA GPU (see the README, "Running on GPUs").
#
#   ./scripts/gpu_check.sh                 # tests/gpu, then the CUDA benchmark; results in bench_results/gpu_*.json
#   GPU_CHECK_MODEL=llama3_2_1b GPU_CHECK_SEQ=2048 ./scripts/gpu_check.sh
#
# Uses .venv if there is one, else python3 (a CUDA PyTorch image's own). Wheels in .whl/ (./scripts/gpu_wheels.sh
# fetches them where pip works) are installed to a private folder first, for a machine that cannot reach PyPI.
# Writes bench_results/gpu_tests.json (each test's outcome, the device named) and
# bench_results/gpu_bench_train.json (tokens/s, MFU, peaks against tune plan's estimate).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site .whl/*.whl \
    || { echo "gpu_check: installing .whl/ failed" >&2; exit 1; }
  export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device')" || exit 1
mkdir -p bench_results
LOG_DIR="${OUT:-/tmp/gpu_check}"
mkdir -p "$LOG_DIR"
$PY -m pytest tests/gpu -m cuda -v -s -p no:cacheprovider --junitxml "$LOG_DIR/gpu_tests.xml" 2>&1 | tee "$LOG_DIR/gpu_tests.log"
tests_status=${PIPESTATUS[0]}
$PY scripts/gpu_report.py "$LOG_DIR/gpu_tests.xml" bench_results/gpu_tests.json
$PY scripts/bench_train.py --device cuda --model "${GPU_CHECK_MODEL:-llama3_2_1b}" --batch-size "${GPU_CHECK_BATCH:-4}" \
  --seq-len "${GPU_CHECK_SEQ:-2048}" --steps "${GPU_CHECK_STEPS:-8}" --warmup 2 \
  --out-json bench_results/gpu_bench_train.json 2>&1 | tee "$LOG_DIR/gpu_bench_train.log"
bench_status=${PIPESTATUS[0]}
echo "gpu_check: tests exit $tests_status, benchmark exit $bench_status"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
