#!/usr/bin/env bash
# Create or reuse .venv and install torchtune_ac with its dependencies (sourced by quickstart.sh and test.sh).
# torch is installed first and pinned (constraints.txt): unpinned, pip would fetch a multi-GB CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV="$ROOT/.venv"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
STAMP="$VENV/.torchtune_ac-installed"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "setup: installing dependencies into $VENV (torch 2.13.0 CPU first)"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c "$ROOT/constraints.txt" torch
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c "$ROOT/constraints.txt" -e "$ROOT[dev]"
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
