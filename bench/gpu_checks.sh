#!/usr/bin/env bash
# Issue 55's GPU checks in one call, on a lent H100/H200 (the device tool's `run`), at most 9.7 minutes:
#
#   1. the GPU, its driver, torch, CUDA, cuDNN and Triton versions;
#   2. `pytest -m gpu` (tests/test_gpu.py): the layer-at-a-time LSTM against the reference cell on CUDA (fp32 1e-5 and
#      the TF fixture, bf16 by cosine), an embedding job on CUDA against the CPU's table, a CUDA server against
#      `Runtime.embed`, and the older CUDA checks;
#   3. bench/embed_throughput.py --device cuda: the original shape, fp32 and bf16, ours against the reference cell
#      (the code before kernels/layer_steps.py) in the same rounds, on the 3,025 real help-topic sentences;
#   4. bench/train_throughput.py: the original shape, 512 rows x 20 steps, fp32 and bf16;
#   5. the small shape's batch job on CUDA (fp32, 3,000 real sentences), then bench/serve_load.py at 64 clients:
#      serve_load's own "batch job" ceiling runs on the CPU (BiLM.from_pretrained's default device), so set the
#      server's tok/s beside step 5's GPU figure as well.
#
# There (the GPU machine: python3 3.12 with a CUDA torch and Triton, no registry), the project's missing packages
# travel as wheels. Here, once, where pip works:   bash bench/gpu_checks.sh wheels
# then the device tool's run, with carry [".whl"] and timeout_s 600:   bash bench/gpu_checks.sh
# Every step has its own time limit (together 9 minutes at most) and the script goes on past a failed one; logs land
# in $OUT (or bench/results/). A rerun can name the steps it wants: bash bench/gpu_checks.sh pytest_gpu serve_64
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "wheels" ]]; then  # the versions this project's .venv runs, built for the GPU image's Python 3.12
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
    exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
        pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 \
        pydantic-extra-types==2.11.1 duckdb==2.0.1 fastapi==0.150.0 starlette==1.10.0 uvicorn==0.55.0 \
        httptools==0.9.0 orjson==3.13.0 opentelemetry-api==1.45.2  # 28 MB: the tree (4 MB) and these fit the 64 MiB that travels
fi

PY=python3
[[ -x .venv/bin/python ]] && PY=.venv/bin/python
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 ELMO_ALLOW_EMULATED_BF16=1
OUT="${OUT:-bench/results/gpu_checks}"
mkdir -p "$OUT"

ONLY=" $* "
step() {  # step NAME SECONDS COMMAND...: its output to the screen and to $OUT/NAME.log, its status to the summary
    local name=$1 seconds=$2 started=$SECONDS
    shift 2
    [[ "$ONLY" == "  " || "$ONLY" == *" $name "* ]] || return 0
    echo "=== $name ($(date -u +%H:%M:%S), at most ${seconds}s): $*"
    timeout "$seconds" "$@" 2>&1 | tee "$OUT/$name.log"
    local status=$?
    echo "$name: exit $status after $((SECONDS - started))s" | tee -a "$OUT/summary.txt"
}

step versions 30 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; $PY -c '
import torch
from torch.utils._triton import has_triton
print(\"torch\", torch.__version__, \"CUDA\", torch.version.cuda, \"cuDNN\", torch.backends.cudnn.version(),
      \"GPU\", torch.cuda.get_device_name(), \"Triton\", has_triton())'"
step pytest_gpu 220 $PY -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -rs
step embed_original 120 $PY bench/embed_throughput.py --device cuda --shapes original --precisions fp32,bf16 \
    --baseline --candidates bf16 --no-allennlp --workloads long-tailed --sentences 3025 --repeats 3
step train_original_512 80 $PY bench/train_throughput.py --device cuda --shapes original --batches 512 --steps 20
step embed_small 40 $PY bench/embed_throughput.py --device cuda --shapes small --precisions fp32 --no-allennlp \
    --workloads long-tailed --sentences 3000 --repeats 3
step serve_64 90 $PY bench/serve_load.py --shape small --seconds 5 --concurrency 64 \
    --skip mlflow,off,burst,synthetic --sentences 2000
[[ -f "$OUT/summary.txt" ]] && cat "$OUT/summary.txt"
