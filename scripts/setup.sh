#!/usr/bin/env bash
# Installs everything into .venv: torch 2.13.0 (the CPU wheel on these machines; an unpinned torch would pull a
# multi-GB CUDA build) and the project with its test extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# a torch already in .venv (a GPU user's own CUDA build) is kept: pyproject.toml asks only for torch>=2.4,<3
TORCH=$(.venv/bin/python -c "import torch" 2>/dev/null || echo "torch==${ELMO_TORCH_VERSION:-2.13.0}")
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }  # pip's registry-mirror notices; status kept

# uv installs the same packages as pip from the same sources in about half the time (a fresh .venv and empty
# caches on a 2-vCPU AVX2 EPYC: 106-124 s against pip's 201 s, bytecode compiled by both). It reads none of pip's
# configuration, so pip's sources are handed to it (scripts/pip_sources.py), and it weighs every index as pip does
# (unsafe-best-match: the highest version wherever it lies). Where uv cannot be had or fails, pip does the whole
# install.
install_with_uv() {
  quiet .venv/bin/python -m pip install -q uv || return 1
  local sources
  mapfile -t sources < <(.venv/bin/python scripts/pip_sources.py) || return 1
  # bytecode compiled at install: these machines set PYTHONDONTWRITEBYTECODE, so no process would ever cache it
  .venv/bin/uv pip install -q --python .venv/bin/python --compile-bytecode --index-strategy unsafe-best-match \
    "${sources[@]}" $TORCH -e ".[dev]"
}
install_with_pip() {
  [ -z "$TORCH" ] || quiet .venv/bin/python -m pip install -q "$TORCH"
  quiet .venv/bin/python -m pip install -q -e ".[dev]"
}
install_with_uv || { echo "setup: uv could not install; pip installs instead"; install_with_pip; }
# the project's own modules compiled once: where PYTHONDONTWRITEBYTECODE is set (these machines set it) Python
# never caches them, and every process a job or a test starts compiled ~22k lines again (0.7-1 s a process here)
.venv/bin/python -m compileall -q -j 0 elmo_core flows tests bench >/dev/null
.venv/bin/python -c "import torch, elmo_core; print(f'setup: torch {torch.__version__}, elmo_core ready in .venv')"
