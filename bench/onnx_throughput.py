"""ONNX Runtime on the exported file (``elmo onnx``) against our runtime, fp32 on the CPU, in one run.

    .venv/bin/python bench/onnx_throughput.py [--shapes small,original] [--sentences 96] [--repeats 3]
                                              [--threads 2] [--out bench_onnx.json]

For each shape: random bilm-tf-initialised weights written as options.json + weights.hdf5, exported with
``elmo onnx``; the same long-tailed real sentences (Python's help topics, ``embed_throughput.real_sentences``) cut
into the same batches (sorted by length, at most the runtime's token budget of padded tokens a batch: 8,192 on a
CPU) for both. Ours: ``Runtime.embed`` in this process. ONNX Runtime: the CPU provider in a process of its own that
never imports torch, ``intra_op_num_threads`` = ``--threads`` (torch has the same), the timing inside it. The
rounds alternate (ours, ONNX Runtime, ours, ...); printed: the median tokens/s of each, their ratio, the file's
size against the parameters', and the largest difference of the layers on the first batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from embed_throughput import real_sentences  # noqa: E402

from elmo_core import cpu  # noqa: E402
from elmo_core.allennlp import batch_to_ids  # noqa: E402
from elmo_core.bilm.inference import length_batches  # noqa: E402
from elmo_core.bilm.initialization import init_bilm_tf  # noqa: E402
from elmo_core.bilm.model import BiLM  # noqa: E402
from elmo_core.config import preset  # noqa: E402
from elmo_core.options import OnnxConfig  # noqa: E402
from elmo_core.runtime import Runtime  # noqa: E402
from elmo_core.runtime.onnx_file import export_onnx  # noqa: E402

# isort: split
import torch  # noqa: E402

# times ONNX Runtime over the batches (``.npy`` files), each round after one warm-up pass; prints JSON
ORT_TIMER = """
import json, sys, time
import numpy as np
import onnxruntime as ort
path, batches, threads, rounds = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
options = ort.SessionOptions()
options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
inputs = [np.load(b) for b in batches]
session.run(None, {"char_ids": inputs[0]})
seconds = []
for _ in range(rounds):
    start = time.perf_counter()
    for ids in inputs:
        session.run(None, {"char_ids": ids})
    seconds.append(time.perf_counter() - start)
first = session.run(None, {"char_ids": inputs[0]})[0]
np.save(sys.argv[5], first)
assert "torch" not in sys.modules
print(json.dumps(seconds))
"""


def bench_shape(shape: str, sentences: list[list[str]], args: argparse.Namespace, tmp: Path) -> dict:
    torch.manual_seed(0)
    bilm = BiLM(preset(shape))
    init_bilm_tf(bilm)
    bilm.save_pretrained(str(tmp / shape))
    exported = export_onnx(OnnxConfig(model=str(tmp / shape), out=str(tmp / f"{shape}.onnx")))
    runtime = Runtime.open(str(tmp / shape), device="cpu", precision="fp32", threads=args.threads)
    batches = length_batches([len(s) for s in sentences], runtime.max_batch_tokens)
    files = []
    for i, batch in enumerate(batches):
        np.save(tmp / f"{shape}-{i}.npy", batch_to_ids([sentences[j] for j in batch]).numpy())
        files.append(str(tmp / f"{shape}-{i}.npy"))
    tokens = sum(len(s) for s in sentences)
    runtime.embed(sentences[:8])  # warm: kernels chosen, caches made
    ours, theirs = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for batch in batches:
            runtime.embed([sentences[j] for j in batch])
        ours.append(time.perf_counter() - start)
        timer = [sys.executable, "-c", ORT_TIMER, str(exported.path), json.dumps(files), str(args.threads), "1"]
        done = subprocess.run([*timer, str(tmp / "first.npy")], capture_output=True, text=True, check=True)
        theirs += json.loads(done.stdout.strip().splitlines()[-1])
    first = np.load(tmp / "first.npy")
    expected = runtime.embed([sentences[j] for j in batches[0]])
    diff = max(float(np.abs(first[:, i, : e.shape[1]] - e).max()) for i, e in enumerate(expected))
    ours_tps, theirs_tps = tokens / statistics.median(ours), tokens / statistics.median(theirs)
    return {
        "shape": shape,
        "tokens": tokens,
        "batches": len(batches),
        "ours_tokens_per_s": round(ours_tps, 1),
        "onnxruntime_tokens_per_s": round(theirs_tps, 1),
        "onnxruntime_against_ours": round(theirs_tps / ours_tps, 3),
        "file_bytes": exported.file_bytes,
        "file_against_parameters": round(exported.file_bytes / exported.parameter_bytes, 4),
        "largest_difference": diff,
        "runtime": runtime.line(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="small,original")
    parser.add_argument("--sentences", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench_onnx.json")
    args = parser.parse_args()
    import onnxruntime

    sentences = real_sentences(args.sentences)
    machine = f"{cpu.describe()}; torch {torch.__version__}, onnxruntime {onnxruntime.__version__}"
    print(f"# {machine}; {args.threads} threads each; {sum(map(len, sentences)):,} tokens of real text")
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for shape in args.shapes.split(","):
            found = bench_shape(shape, sentences, args, Path(folder))
            results.append(found)
            print(
                f"{shape:9s} ours {found['ours_tokens_per_s']:>9,.0f} tok/s   ONNX Runtime "
                f"{found['onnxruntime_tokens_per_s']:>9,.0f} tok/s ({found['onnxruntime_against_ours']:.2f}x)   "
                f"file {found['file_against_parameters']:.3f}x the parameters   "
                f"largest difference {found['largest_difference']:.1e}"
            )
    Path(args.out).write_text(json.dumps({"machine": machine, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
