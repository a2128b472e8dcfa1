#!/usr/bin/env bash
# The GPU check, staged to fit a short loan of a GPU machine (docs/distributed.md, "Running on GPUs").
#
#   ./scripts/gpu_check.sh [--out DIR] [--full] [--only STAGE,...] [--list]
#   PYTHON=/opt/torch/.venv/bin/python3 ./scripts/gpu_check.sh --out "$OUT"
#
# Stages, in order of what each teaches per second; each runs under `timeout -s INT` (pytest still writes its
# JUnit XML when it is stopped), and a stage that fails or runs out of time does not stop the next:
#   1 env       the machine: torch, CUDA, NCCL, the device, varlen_attn's signature and what VARLEN_SUPPORT
#               detected, a bf16 matmul's rate, the random-init build time of a 1B model      (limit  40 s)
#   2 fast      the cuda tests that neither compile nor offload: NCCL + FSDP2, DCP, HF export, varlen, the
#               chunked loss, the cuBLAS workspaces the planner counts                       (limit  60 s)
#   3 offload   fsdp.cpu_offload (with the step after and in backward), activation offloading  (limit  50 s)
#   4 compiled  compiled varlen attention; compiled FlexAttention (Gemma 2's soft-cap); compiled bf16
#               `tune run`s: recompiles, plan against the peaks and eager, the planner's own case (default:
#               packed with full AC and unpacked with per-op AC compiled, unpacked per-op eager; --full: every
#               one of the eight)                                                            (limit 170 s)
#   5 bench     bench_train.py on llama3_2_1b, bf16, compiled, packed 4 x 2048, full AC and none: tokens/s,
#               MFU, plan against max_memory_reserved, recompiles, host syncs per step      (limit 150 s)
# The default run is planned for under 8 minutes on one H100 (the limits add up to 470 s); --full doubles the
# limits of stages 4 and 5 and runs every setting (unpacked benchmark too).
#
# --only env,compiled,...: those stages alone (a rerun of what failed; env always runs, it is cheap).
# --list: print the tests each pytest stage selects ("STAGE test-id", with --full and --only as given) and
# exit; needs no GPU and writes nothing (tests/integration/test_gpu_check.py checks every cuda test is in one).
#
# Output, at most 8 files, in DIR (default bench_results/): gpu_env.json, gpu_tests.json (every test's outcome
# by stage, the device named), gpu_bench_train.json, gpu_check.log, and the JUnit XML of stages 2-4.
#
# PYTHON: the interpreter with CUDA torch (default: python3). Wheels in .whl/ (./scripts/gpu_wheels.sh fetches
# them where pip works) are unpacked with `python -m zipfile`, not pip, into a private folder on PYTHONPATH.
set -uo pipefail
CALLER_DIR="$PWD"  # a relative --out is the caller's; the default, bench_results/, the repository's
cd "$(dirname "$0")/.."
OUT_DIR=bench_results
FULL=0
ONLY=""
LIST=0
STAGES=",env,fast,offload,compiled,bench,"
usage_error() { echo "gpu_check: $* (see --help)" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --out|--only) [ $# -ge 2 ] && [ -n "$2" ] || usage_error "$1 needs a value"
                  if [ "$1" = --out ]; then OUT_DIR="$(cd "$CALLER_DIR" && realpath -m -- "$2")"; else ONLY=",$2,"; fi
                  shift 2 ;;
    --out=*) [ -n "${1#--out=}" ] || usage_error "--out needs a value"
             OUT_DIR="$(cd "$CALLER_DIR" && realpath -m -- "${1#--out=}")"; shift ;;
    --only=*) ONLY=",${1#--only=},"; [ "$ONLY" != ",," ] || usage_error "--only needs a value"; shift ;;
    --full) FULL=1; shift ;;
    --list) LIST=1; shift ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) usage_error "unknown argument $1" ;;
  esac
done
IFS=, read -ra asked <<< "$ONLY"
for stage in "${asked[@]}"; do
  [ -z "$stage" ] || [[ "$STAGES" == *",$stage,"* ]] || usage_error "--only: no stage '$stage' (env, fast, offload, compiled, bench)"
done
PY="${PYTHON:-python3}"
if [ "$LIST" -eq 1 ]; then
  OUT_DIR="$(mktemp -d /tmp/gpu_check_list.XXXXXX)"  # pytest writes nothing here; the stages' plumbing needs a folder
  trap 'rm -rf "$OUT_DIR"' EXIT
fi
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
LOG="$OUT_DIR/gpu_check.log"
: > "$LOG"
say() { echo "gpu_check: $*" | tee -a "$LOG"; }

if compgen -G ".whl/*.whl" >/dev/null; then
  SITE="$(mktemp -d /tmp/gpu_check_site.XXXXXX)"
  for wheel in .whl/*.whl; do
    "$PY" -m zipfile -e "$wheel" "$SITE" || { say "unpacking $wheel failed"; exit 1; }
  done
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  say "unpacked $(ls .whl/*.whl | wc -l) wheel(s) into $SITE"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ "$LIST" -eq 0 ]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device')" 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
fi

scale=$((FULL + 1))
declare -A STATUS
run_stage() {  # name limit_s command...
  local name="$1" limit="$2"; shift 2
  if [ -n "$ONLY" ] && [ "$name" != env ] && [[ "$ONLY" != *",${name%%_*},"* ]]; then return; fi
  [ "$LIST" -eq 0 ] || return 0
  say "stage $name (limit ${limit} s): $*"
  local start=$SECONDS
  timeout -s INT -k 20 "$limit" "$@" 2>&1 | tee -a "$LOG"
  STATUS[$name]=${PIPESTATUS[0]}
  local why=""
  case "${STATUS[$name]}" in 124) why=" (time limit)" ;; 137) why=" (killed: 20 s past its time limit, or out of memory)" ;; esac
  say "stage $name: exit ${STATUS[$name]} after $((SECONDS - start)) s$why"
}
pytest_stage() {  # name limit_s pytest-arguments...
  local name="$1" limit="$2"; shift 2
  if [ "$LIST" -eq 1 ]; then
    if [ -n "$ONLY" ] && [[ "$ONLY" != *",$name,"* ]]; then return; fi
    "$PY" -m pytest -m cuda --collect-only -q -p no:cacheprovider -o addopts="" "$@" > "$OUT_DIR/list.txt" 2>&1 \
      || { cat "$OUT_DIR/list.txt" >&2; echo "gpu_check: --list: collecting stage $name failed" >&2; exit 1; }
    sed -n "s|^\(tests/[^ ]*::[^ ]*\)\$|$name \1|p" "$OUT_DIR/list.txt"
    return
  fi
  run_stage "$name" "$limit" "$PY" -m pytest -m cuda -v -p no:cacheprovider -o addopts="" -rfE \
    --junitxml "$OUT_DIR/gpu_$name.xml" "$@"
}

run_stage env 40 "$PY" scripts/gpu_env.py --out "$OUT_DIR"
pytest_stage fast 60 tests/gpu/test_fsdp_nccl_cuda.py tests/gpu/test_chunked_loss_cuda.py tests/gpu/test_memory_cuda.py \
  tests/gpu/test_packed_attention_cuda.py tests/unit/models/test_packed_attention.py -k "not compiled"
pytest_stage offload 50 tests/integration/test_offload.py tests/unit/memory/test_activation_offloading.py
if [ "$FULL" -eq 1 ]; then
  pytest_stage compiled $((170 * scale)) tests/gpu/test_packed_attention_cuda.py tests/gpu/test_tune_run_cuda.py \
    tests/gpu/test_softcap_attention_cuda.py -k "compiled or tune_run"
else
  pytest_stage compiled 170 tests/gpu/test_packed_attention_cuda.py tests/gpu/test_tune_run_cuda.py \
    tests/gpu/test_softcap_attention_cuda.py -k "(compiled and not tune_run) or [packed-full-compiled] or [unpacked-per_op-compiled] or [unpacked-per_op-eager]"
fi
BENCH=(scripts/bench_train.py --device cuda --model "${GPU_CHECK_MODEL:-llama3_2_1b}" --batch-size 4 --seq-len 2048
       --steps 6 --warmup 2 --settings full,none)
run_stage bench $((150 * scale)) "$PY" "${BENCH[@]}" --packed --out-json "$OUT_DIR/gpu_bench_train.json"
if [ "$FULL" -eq 1 ]; then
  run_stage bench_unpacked 150 "$PY" "${BENCH[@]}" --out-json "$OUT_DIR/gpu_bench_train_unpacked.json"
fi
[ "$LIST" -eq 0 ] || exit 0

"$PY" scripts/gpu_report.py --out "$OUT_DIR/gpu_tests.json" "$OUT_DIR"/gpu_fast.xml "$OUT_DIR"/gpu_offload.xml \
  "$OUT_DIR"/gpu_compiled.xml 2>&1 | tee -a "$LOG"
summary=""
for name in env fast offload compiled bench; do summary+="$name=${STATUS[$name]:-not run} "; done
say "exit statuses: $summary"
for name in "${!STATUS[@]}"; do [ "${STATUS[$name]}" -eq 0 ] || exit 1; done
