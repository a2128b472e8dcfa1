#!/usr/bin/env bash
# The GPU check, staged to fit a short loan of a GPU machine (docs/distributed.md, "Running on GPUs").
#
#   ./scripts/gpu/gpu_check.sh [--out DIR] [--full] [--only STAGE,...] [--list]
#   PYTHON=/opt/torch/.venv/bin/python3 ./scripts/gpu/gpu_check.sh --out "$OUT"
#
# Stages, in order; each runs under `timeout -s INT` (pytest still writes its JUnit XML when it is stopped), and a
# stage that fails or runs out of time does not stop the next. A default run is the stages marked *: their limits
# add up to 220 s, 300 s with each stage's 20 s kill margin, so a rerun fits a 15-minute loan too; every other
# stage runs when --only names it or with --full. Limits (--full's in brackets):
#   env *      the machine: torch, CUDA, NCCL, the device (torch against the pinned version, said when they
#              differ), varlen_attn's signature and what VARLEN_SUPPORT detected, a bf16 matmul's rate,
#              the random-init build time of a 1B model                                             30 s
#   fast *     the cuda tests that neither compile nor offload: NCCL + FSDP2, DCP, HF export, varlen, the
#              chunked loss, the cuBLAS workspaces the planner counts                              40 s
#   moe *      mixtures of experts: the kernel this GPU gets (grouped on sm90/sm100 in bf16) against the
#              loop, forward and backward, an expert and a layer without rows; qwen3_moe_tiny in bf16
#              compiled under no, per-op and full AC, graphs and breaks counted, against eager; EP 2 over
#              gloo on this GPU against one process, every gradient (the experts') compared        105 s
#   dpo        tune run full_dpo in bf16, reference resident and precomputed, peaks against the plan; the
#              reference's memory built, dropped and collected                                     40 s
#   two_ranks * 2 ranks on cuda:0 over gloo: a probe of gloo's collectives on CUDA tensors (all_to_all_single
#              with uneven splits among them), then FSDP 2 and TP 2 against 1 rank (bf16 gathers, the step in backward, activation offloading)     45 s
#   world8     a world of 8 simulated with the fake process group: rank 0 of Llama 3.1 8B and 70B as
#              their configs ship, its shards, optimizer state and peak against the plan           60 s
#   planner    compiled bf16 tune runs, no AC and per-op AC, plan against the allocated and reserved
#              peaks, recompiles (default: packed; --full: unpacked too)                     60 s (120)
#   compiled   compiled varlen attention and FlexAttention (Gemma 2's soft-cap); the other tune runs
#              (default: packed full AC compiled;
#              --full: unpacked, and every eager one)                                        40 s  (80)
#   llama8b    scripts/gpu/gpu_peer.py: Llama 3 8B, 8-bit AdamW stepped in backward, full AC, bf16, 2 x 2048:
#              ours (plan against the peaks, MFU) and torchtune 0.6.1's recipe, one after the other,
#              tokens/s and peaks side by side (--full: two rounds, ours/torchtune/torchtune/ours) 140 s (280)
#   bench      bench_train.py on llama3_2_1b, bf16, compiled, packed 4 x 2048, full AC and none: tokens/s,
#              MFU, plan against max_memory_reserved, recompiles, host syncs per step        75 s (150)
#   offload    --full only: fsdp.cpu_offload (with the step after and in backward), activation
#              offloading (passed in both GPU runs so far; the default run needs its time)        (40 s)
# The other stages' limits add up to 415 s (dpo, world8, planner, compiled, llama8b, bench): run them as
# --only dpo,world8,planner,compiled (200 s) and --only llama8b,bench (215 s) on a loan of their own; --full runs
# every stage, adds offload and the unpacked benchmark (150 s) and doubles the limits it names, 1,155 s: more than
# one command's 10 minutes, so run it as three commands (env included): --full --only
# dpo,two_ranks,world8,planner,compiled,offload,moe; --full --only llama8b; --full --only bench.
#
# --only env,compiled,...: those stages alone (a rerun of what failed; env always runs, it is cheap).
# --list: print the tests each pytest stage selects ("STAGE test-id", with --full and --only as given) and
# exit; needs no GPU and writes nothing (tests/integration/test_gpu_check.py checks every cuda test is in one).
#
# Output, at most 8 files, in DIR (default bench_results/): gpu_env.json, gpu_tests.json (every test's outcome
# and recorded figures by stage, the device named; rewritten after each pytest stage from their JUnit XML, kept
# outside DIR), gpu_peer.json, gpu_bench_train.json (--full: gpu_bench_train_unpacked.json), gpu_check.log.
#
# PYTHON: the interpreter with CUDA torch (default: python3). Wheels in .whl/ (./scripts/gpu/gpu_wheels.sh fetches
# them where pip works) are unpacked with `python -m zipfile`, not pip, into a private folder on PYTHONPATH; those
# in .whl/peer/ (torchtune 0.6.1 and its needs) into another, first on the llama8b stage's path alone.
set -uo pipefail
CALLER_DIR="$PWD"  # a relative --out is the caller's; the default, bench_results/, the repository's
cd "$(dirname "$0")/../.."
OUT_DIR=bench_results
FULL=0
ONLY=""
LIST=0
STAGES=",env,fast,moe,dpo,two_ranks,world8,planner,compiled,llama8b,bench,offload,"
DEFAULT_STAGES=",env,fast,moe,two_ranks,"  # a default run's (without --only or --full)
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
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) usage_error "unknown argument $1" ;;
  esac
done
IFS=, read -ra asked <<< "$ONLY"
for stage in "${asked[@]}"; do
  [ -z "$stage" ] || [[ "$STAGES" == *",$stage,"* ]] || usage_error "--only: no stage '$stage' ($(echo "${STAGES:1:-1}" | sed 's/,/, /g'))"
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
PEER_SITE=""
if [ "$LIST" -eq 0 ] && compgen -G ".whl/peer/*.whl" >/dev/null; then
  PEER_SITE="$(mktemp -d /tmp/gpu_check_peer.XXXXXX)"
  for wheel in .whl/peer/*.whl; do
    "$PY" -m zipfile -e "$wheel" "$PEER_SITE" || { say "unpacking $wheel failed"; exit 1; }
  done
  say "unpacked $(ls .whl/peer/*.whl | wc -l) wheel(s) for the llama8b stage into $PEER_SITE"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ "$LIST" -eq 0 ]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device')" 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
fi

scale=$((FULL + 1))
declare -A STATUS
stage_selected() {  # name: whether this run runs the stage (--only's, else --full's every stage, else the default)
  local name="${1%_unpacked}"
  if [ -n "$ONLY" ]; then [ "$name" = env ] || [[ "$ONLY" == *",$name,"* ]]; return; fi
  [ "$FULL" -eq 1 ] || [[ "$DEFAULT_STAGES" == *",$name,"* ]]
}
run_stage() {  # name limit_s command...
  local name="$1" limit="$2"; shift 2
  stage_selected "$name" || return 0
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
    stage_selected "$name" || return 0
    "$PY" -m pytest -m cuda --collect-only -q -p no:cacheprovider -o addopts="" "$@" > "$OUT_DIR/list.txt" 2>&1 \
      || { cat "$OUT_DIR/list.txt" >&2; echo "gpu_check: --list: collecting stage $name failed" >&2; exit 1; }
    sed -n "s|^\(tests/[^ ]*::[^ ]*\)\$|$name \1|p" "$OUT_DIR/list.txt"
    return
  fi
  run_stage "$name" "$limit" "$PY" -m pytest -m cuda -v -p no:cacheprovider -o addopts="" -rfE \
    --junitxml "$XML_DIR/gpu_$name.xml" "$@"
  [ -n "${STATUS[$name]:-}" ] || return 0
  # gpu_tests.json from every pytest stage so far: a command stopped later still leaves the stages before it.
  XMLS+=("$XML_DIR/gpu_$name.xml")
  "$PY" scripts/gpu/gpu_report.py --out "$OUT_DIR/gpu_tests.json" "${XMLS[@]}" 2>&1 | tee -a "$LOG"
}
[ "$LIST" -eq 1 ] || XML_DIR="$(mktemp -d /tmp/gpu_check_xml.XXXXXX)"  # each stage's JUnit XML, merged into gpu_tests.json
XMLS=()

run_stage env 30 "$PY" scripts/gpu/gpu_env.py --out "$OUT_DIR"
pytest_stage fast 40 tests/gpu/test_fsdp_nccl_cuda.py tests/gpu/test_chunked_loss_cuda.py tests/gpu/test_memory_cuda.py \
  tests/gpu/test_packed_attention_cuda.py tests/unit/models/test_packed_attention.py -k "not compiled"
pytest_stage moe 105 tests/gpu/test_moe_cuda.py
pytest_stage dpo 40 tests/gpu/test_dpo_cuda.py
pytest_stage two_ranks 45 tests/gpu/test_two_ranks_cuda.py
pytest_stage world8 60 tests/gpu/test_fake_world_cuda.py
# The compiled planner: no AC and per-op AC, compiled (the test ids are [packed|unpacked]-[ac]-[compiled|eager]).
PLANNER_K="tune_run and ((-none-compiled] or -per_op-compiled])"
if [ "$FULL" -eq 1 ]; then
  pytest_stage planner 120 tests/gpu/test_tune_run_cuda.py -k "$PLANNER_K)"
  pytest_stage compiled 80 tests/gpu/test_packed_attention_cuda.py tests/gpu/test_tune_run_cuda.py \
    tests/gpu/test_softcap_attention_cuda.py -k "(compiled and not tune_run) or (tune_run and not (-none-compiled] or -per_op-compiled]))"
else
  pytest_stage planner 60 tests/gpu/test_tune_run_cuda.py -k "$PLANNER_K) and [packed-"
  pytest_stage compiled 40 tests/gpu/test_packed_attention_cuda.py tests/gpu/test_tune_run_cuda.py \
    tests/gpu/test_softcap_attention_cuda.py -k "(compiled and not tune_run) or [packed-full-compiled]"
fi
PEER=(scripts/gpu/gpu_peer.py --out "$OUT_DIR" --rounds $((FULL + 1)))
run_stage llama8b $((140 * scale)) env PYTHONPATH="${PEER_SITE:+$PEER_SITE:}$PYTHONPATH" "$PY" "${PEER[@]}"
BENCH=(scripts/bench/bench_train.py --device cuda --model "${GPU_CHECK_MODEL:-llama3_2_1b}" --batch-size 4 --seq-len 2048
       --steps 5 --warmup 2 --settings full,none)
run_stage bench $((75 * scale)) "$PY" "${BENCH[@]}" --packed --out-json "$OUT_DIR/gpu_bench_train.json"
if [ "$FULL" -eq 1 ]; then
  run_stage bench_unpacked 150 "$PY" "${BENCH[@]}" --out-json "$OUT_DIR/gpu_bench_train_unpacked.json"
  pytest_stage offload 40 tests/integration/test_offload.py tests/unit/memory/test_activation_offloading.py
fi
[ "$LIST" -eq 0 ] || exit 0

rm -rf "$XML_DIR"
summary=""
for name in env fast moe dpo two_ranks world8 planner compiled llama8b bench bench_unpacked offload; do summary+="$name=${STATUS[$name]:-not run} "; done
say "exit statuses: $summary"
for name in "${!STATUS[@]}"; do [ "${STATUS[$name]}" -eq 0 ] || exit 1; done
