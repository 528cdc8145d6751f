#!/usr/bin/env bash
# Installs everything into .venv: torch 2.13.0 first (the CPU wheel on these machines; an unpinned torch
# would pull a multi-GB CUDA build), then the project with its test extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==${ELMO_TORCH_VERSION:-2.13.0}" 2>&1 | grep -v "^WARNING: Location" || true
fi
# pip's output is filtered of the registry-mirror notices; its exit status still decides
set -o pipefail
.venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | { grep -v "^WARNING: Location" || true; }
# the project's own modules compiled once: where PYTHONDONTWRITEBYTECODE is set (these machines set it) Python
# never caches them, and every process a job or a test starts compiled ~22k lines again (0.7-1 s a process here)
.venv/bin/python -m compileall -q -j 0 elmo_core flows tests bench >/dev/null
.venv/bin/python -c "import torch, elmo_core; print(f'setup: torch {torch.__version__}, elmo_core ready in .venv')"
