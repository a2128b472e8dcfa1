#!/usr/bin/env bash
# From a fresh clone: create or reuse .venv, install everything (torch 2.13.0 CPU first), write the embedded
# tiny checkpoint if it is missing, fine-tune it on the embedded data with the default config (tiny/full),
# then show that the loss fell and that transformers loads the checkpoint the run wrote, and how to try it.
# Extra arguments are config overrides, e.g. ./scripts/quickstart.sh ac_mode=selective ac_option=op
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
python scripts/make_tiny_checkpoint.py
OUT="outputs/quickstart-$(date +%Y%m%d-%H%M%S)"
tune run full_finetune --config tiny/full output_dir="$OUT" "$@"
python scripts/check_run.py "$OUT"
echo "try it: tune generate --checkpoint $OUT --alpaca --prompt \"What is 33 + 65?\""
