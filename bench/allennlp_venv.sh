#!/usr/bin/env bash
# Makes .venv-allennlp: AllenNLP 2.10.1 (no deps) beside torch 2.13.0 and the few packages its ELMo needs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
if ! .venv-allennlp/bin/python -c "import allennlp.version" 2>/dev/null; then
  "$PY" -m venv .venv-allennlp
  .venv-allennlp/bin/python -m pip install -q "torch==2.13.0" numpy h5py tqdm dill base58 lmdb 2>&1 | { grep -v "^WARNING: Location" || true; }
  .venv-allennlp/bin/python -m pip install -q --no-deps "allennlp==2.10.1" 2>&1 | { grep -v "^WARNING: Location" || true; }
fi
echo .venv-allennlp/bin/python
