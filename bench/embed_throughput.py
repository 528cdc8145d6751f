"""Throughput of ``BiLM.embed_sentences`` in fp32 and bf16 next to AllenNLP's ELMo and a matmul roofline, in one run.

    .venv/bin/python bench/embed_throughput.py [--shapes small,original] [--repeats 5] [--no-allennlp] [--onednn-verbose]
                                               [--precisions fp32,bf16,int8] [--device cpu|cuda] [--baseline]
                                               [--workloads uniform,long-tailed] [--sentences 96]
                                               [--max-batch-tokens N] [--candidates bf16]

For each shape, random bilm-tf-initialised weights written as options.json + weights.hdf5, and two workloads:
* uniform: 64 sentences of 10-40 tokens drawn from a Zipfian vocabulary of made-up words;
* long-tailed: 96 sentences of real English (Python's pydoc topics, the unicode tokenizer) with their natural
  length spread (a few long sentences among many short ones).
Printed per workload: tokens/s of ours in fp32, bf16 and int8 (median of repeats, the precisions alternating), of
AllenNLP 2.10.1's ``_ElmoBiLm`` on the same files (its own venv; batches of 64 as its ``ElmoEmbedder``), the
largest |difference| between AllenNLP's activations and our fp32 ones, fp32 GFLOP/s against ``torch.matmul``
measured in the same process, and the accuracy of bf16 against fp32 per layer on the real text (worst cosine,
0.1% quantile, max and mean absolute error), and of int8 likewise.

On a GPU (``--device cuda --precisions fp32,bf16 --no-allennlp``): ``--baseline`` also times, alternating with ours
in the same process, the reference LSTM cell (``layer_at_once=False``: what ran on CUDA before
``kernels/layer_steps.py``), and prints its tok/s and ours against it; ``--candidates bf16`` also the
layer-at-a-time cell's parts alone in that precision (CUDA graphs of the uncompiled step; the compiled step without
graphs); ``--sentences N`` real sentences (the pool of 3,025 repeated in a new order past it) feed the GPU;
``--max-batch-tokens`` defaults to the runtime's budget for the
device (``runtime.engine.token_budget``: 8,192 on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("ELMO_ALLOW_EMULATED_BF16", "1")  # a bench times bf16 where it is emulated too (the slowdown)

from elmo_core import BiLM  # noqa: E402
from elmo_core.bilm.inference import length_batches  # noqa: E402
from elmo_core.bilm.initialization import init_bilm_tf  # noqa: E402
from elmo_core.config import ModelConfig, preset  # noqa: E402
from elmo_core.precision import onednn_verbose  # noqa: E402
from elmo_core.runtime.engine import token_budget  # noqa: E402

# isort: split
import torch  # noqa: E402  (after elmo_core: under ELMO_CPU_ISA=avx2 it holds torch to AVX2 as torch loads)

CANDIDATES = ("graphs of PyTorch ops (not compiled)", "compiled steps from Python (no CUDA graphs)")


def make_sentences(n: int = 64, seed: int = 0) -> list[list[str]]:
    """Uniform lengths: n sentences of 10-40 Zipfian made-up words."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, size=rng.integers(1, 12))) for _ in range(5000)]
    ranks = np.arange(1, len(words) + 1)
    p = (1.0 / ranks) / (1.0 / ranks).sum()
    return [[words[i] for i in rng.choice(len(words), size=rng.integers(10, 41), p=p)] for _ in range(n)]


def real_sentences(n: int = 96, seed: int = 0) -> list[list[str]]:
    """Long-tailed lengths: n sentences of real English prose (Python's help topics), as the default corpus has them;
    past the 3,025 there are, the pool again in another order."""
    from pydoc_data.topics import topics

    from elmo_core.text.corpus import _prose_paragraphs
    from elmo_core.text.tokenize import split_sentences, unicode_tokens

    sentences = [
        unicode_tokens(s)
        for name in sorted(topics)
        for p in _prose_paragraphs(topics[name])
        for s in split_sentences(p)
    ]
    pool, rng, drawn = [s for s in sentences if s], random.Random(seed), []
    while len(drawn) < n:
        drawn += rng.sample(pool, min(n - len(drawn), len(pool)))
    return drawn


def describe_machine(device: torch.device | str = "cpu") -> str:
    """The CPU model, threads, torch's CPU kernel level, whether bf16 runs natively, whether oneDNN's packed
    products are on, whether the C gate kernel was built and whether fp32 runs a layer's steps in C: which kernels
    ran."""
    from elmo_core import cpu
    from elmo_core.bilm.kernels.fused_gates import describe as describe_fused_gates
    from elmo_core.bilm.kernels.packed import packing_available
    from elmo_core.bilm.kernels.step_loop import describe as describe_step_loop
    from elmo_core.precision import cpu_has_native_bf16

    text = (
        f"{cpu.describe()}, {torch.get_num_threads()} threads, "
        f"native bf16 {'yes' if cpu_has_native_bf16() else 'no'}, "
        f"inference's packed LSTM step weights {'on (medium and larger shapes)' if packing_available() else 'off'}, "
        f"LSTM gates fused in C {describe_fused_gates()}, fp32 LSTM steps in one C loop {describe_step_loop()}"
    )
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        text += (
            f"; GPU {props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"
        )
    return text


def model_flops(config: ModelConfig, sentences: list[list[str]]) -> float:
    """Floating-point operations the model performs for ``embed_sentences`` (matmuls and convolutions only).

    Per distinct word: the char CNN over the kept char positions, highway, projection and layer 0's input-to-gates
    product; per token step (boundaries included): the recurrent and projection products of every layer and the
    input product of layers >= 1, in both directions.
    """
    p, h, n_layers = config.lstm.projection_dim, config.lstm.dim, config.lstm.n_layers
    cnn = config.char_cnn
    d, f, max_width = cnn.embedding.dim, cnn.n_filters, max(w for w, _ in cnn.filters)
    input_gates = 2 * p * 4 * h
    per_step = 2 * (p * 4 * h + (h * p if p < h else 0))  # recurrent + projection
    words = {w for s in sentences for w in s}
    longest = max(len(w.encode()) for w in words) + 2  # + begin/end-of-word markers
    kept = min(cnn.max_characters_per_token, longest + max_width)
    per_word = sum(2 * count * width * d * (kept - width + 1) for width, count in cnn.filters)
    per_word += cnn.n_highway * 2 * (2 * f * f) + (2 * f * p if f != p else 0) + 2 * input_gates
    steps = sum(len(s) + 2 for s in sentences)
    return (len(words) + 2) * per_word + steps * 2 * (n_layers * per_step + (n_layers - 1) * input_gates)


def matmul_roofline(size: int = 2048, repeats: int = 10, device: str = "cpu") -> float:
    """float32 GFLOP/s of one square ``torch.matmul`` on ``device`` (on CUDA 8,192 wide, synchronized)."""
    cuda = torch.device(device).type == "cuda"
    size = 8192 if cuda else size
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    torch.matmul(a, b)
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        torch.matmul(a, b)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * size**3 / min(times) / 1e9


def time_ours(
    bilm: BiLM,
    sentences: list[list[str]],
    repeats: int,
    precisions: list[str],
    max_batch_tokens: int = 8192,
    baseline: bool = False,
    candidates: str = "",
) -> tuple[dict[str, float], dict[str, list[np.ndarray]]]:
    """Median seconds per precision, the precisions alternating so all see the same machine; and the vectors. With
    ``baseline`` also each precision on the reference LSTM cell (key ``"<precision> reference"``), in the rounds;
    ``candidates`` (a precision): also the layer-at-a-time cell without compiling and without CUDA graphs in it."""
    runs = {p: (p, {}) for p in precisions}
    if baseline:
        runs.update({f"{p} reference": (p, {"layer_at_once": False}) for p in precisions})
    if candidates:
        runs[f"{candidates} {CANDIDATES[0]}"] = (candidates, {"compiled": False})
        runs[f"{candidates} {CANDIDATES[1]}"] = (candidates, {"graphs": False})

    def once(name: str, seconds: list[float] | None = None) -> list[np.ndarray]:
        precision, choices = runs[name]
        bilm.prepare(precision, **choices)  # embed_sentences keeps kernels prepared in its precision
        start = time.perf_counter()
        vectors = bilm.embed_sentences(sentences, precision=precision, max_batch_tokens=max_batch_tokens)
        if seconds is not None:
            seconds.append(time.perf_counter() - start)
        return vectors

    vectors = {name: once(name) for name in runs}  # warm-up: compiles, captures, caches
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name in times:
            once(name, times[name])
    bilm.prepare("fp32")
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}, vectors


def largest_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max(initial=0.0)) for x, y in zip(a, b, strict=True))


def accuracy(exact: list[np.ndarray], fast: list[np.ndarray]) -> list[str]:
    """Per layer: worst and 0.1%-quantile per-token cosine to fp32, max and mean absolute error."""
    lines = []
    for layer in range(exact[0].shape[0]):
        a, b = np.concatenate([x[layer] for x in exact]), np.concatenate([x[layer] for x in fast])
        cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)
        lines.append(
            f"layer {layer}: worst cos {cos.min():.5f}, 0.1% quantile {np.quantile(cos, 0.001):.5f}, "
            f"max |err| {np.abs(a - b).max():.4f}, mean |err| {np.abs(a - b).mean():.5f}"
        )
    return lines


def run_allennlp(model_dir: Path, sentences: list[list[str]], repeats: int) -> tuple[float, list[np.ndarray]] | str:
    try:
        setup = subprocess.run(
            ["bash", str(ROOT / "bench" / "allennlp_venv.sh")], check=True, capture_output=True, text=True
        )
        python = setup.stdout.strip().splitlines()[-1]
    except subprocess.CalledProcessError as exc:
        return f"could not set up .venv-allennlp: {exc.stderr.strip()[-300:]}"
    sentences_file, out_file = model_dir / "sentences.json", model_dir / "allennlp.npz"
    sentences_file.write_text(json.dumps(sentences))
    result = subprocess.run(
        [
            str(ROOT / python),
            str(ROOT / "bench" / "allennlp_embed.py"),
            str(model_dir),
            str(sentences_file),
            str(out_file),
            str(repeats),
        ],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        return f"AllenNLP run failed: {result.stderr.strip()[-500:]}"
    seconds = json.loads(result.stdout.strip().splitlines()[-1])["seconds"]
    data = np.load(out_file)
    return seconds, [data[f"s{i}"] for i in range(len(sentences))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="small,original")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-allennlp", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--onednn-verbose", action="store_true", help="print oneDNN's kernel log of one bf16 batch")
    parser.add_argument("--precisions", default="fp32,bf16,int8", help="ours, timed alternating (fp32 always)")
    parser.add_argument("--baseline", action="store_true", help="also the reference LSTM cell, in the same rounds")
    parser.add_argument("--workloads", default="uniform,long-tailed")
    parser.add_argument("--sentences", type=int, default=96, help="real sentences of the long-tailed workload")
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="default: the runtime's for the device")
    parser.add_argument(
        "--candidates", default="", help="a precision: also LayerCell without compiling, without graphs"
    )
    args = parser.parse_args()
    precisions = ["fp32", *(p for p in args.precisions.split(",") if p and p != "fp32")]

    torch.set_grad_enabled(False)
    made = {"uniform": make_sentences, "long-tailed": lambda: real_sentences(args.sentences)}
    workloads = {name: made[name]() for name in args.workloads.split(",")}
    roofline = matmul_roofline(device=args.device)
    print(describe_machine(args.device))
    print(f"torch.matmul roofline {roofline:.1f} GFLOP/s (float32)")
    for name, sentences in workloads.items():
        lengths = sorted(len(s) for s in sentences)
        batches = length_batches([len(s) for s in sentences], args.max_batch_tokens or 8192)
        print(
            f"{name}: {len(sentences)} sentences, {sum(lengths)} tokens, lengths {lengths[0]}-{lengths[-1]} (median "
            f"{lengths[len(lengths) // 2]}), {len(batches)} batches"
        )
    header = (
        f"{'shape':<9}{'workload':<13}{'fp32 tok/s':>11}{'bf16 tok/s':>11}{'bf16/fp32':>10}{'int8 tok/s':>11}"
        f"{'int8/fp32':>10}{'AllenNLP':>10}{'fp32/AN':>9}{'|fp32-AN|':>11}{'fp32 GF/s':>10}{'roofline':>9}"
    )
    print(header)
    print("-" * len(header))
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            torch.manual_seed(0)
            config = preset(shape)
            model_dir = Path(tmp) / shape
            fresh = BiLM(config)
            init_bilm_tf(fresh)
            fresh.save_pretrained(str(model_dir))
            del fresh
            bilm = BiLM.from_pretrained(str(model_dir), device=args.device)
            notes += [f"{shape} kernels: {bilm.prepare(p)}" for p in [*precisions[1:], "fp32"]]  # fp32 kept
            budget, why = args.max_batch_tokens, "asked for"
            if budget is None:
                budget, why = token_budget(bilm.device, config)
            notes.append(f"{shape}: {budget:,} padded tokens a forward pass ({why})")
            for name, sentences in workloads.items():
                n_tokens = sum(len(s) for s in sentences)
                seconds, vectors = time_ours(
                    bilm, sentences, args.repeats, precisions, budget, args.baseline, args.candidates
                )
                notes += [
                    f"{shape} {name} {args.candidates} layer at a time, {c}: "
                    f"{n_tokens / seconds[f'{args.candidates} {c}']:,.0f} tok/s"
                    for c in (CANDIDATES if args.candidates else ())
                ]
                notes += [
                    f"{shape} {name} {p} without LayerCell (layer_at_once=False: on CUDA the reference cell): "
                    f"{n_tokens / seconds[f'{p} reference']:,.0f} tok/s; ours {seconds[f'{p} reference'] / seconds[p]:.2f}x "
                    f"that (same rounds); max |ours - it| {largest_difference(vectors[p], vectors[f'{p} reference']):.1e}"
                    for p in precisions
                    if args.baseline
                ]
                tps = {p: n_tokens / seconds[p] if p in seconds else float("nan") for p in ("fp32", "bf16", "int8")}
                gflops = model_flops(config, sentences) / seconds["fp32"] / 1e9
                base_tps, diff = float("nan"), float("nan")
                if not args.no_allennlp:
                    baseline = run_allennlp(model_dir, sentences, args.repeats)
                    if isinstance(baseline, str):
                        notes.append(baseline)
                    else:
                        base_tps = n_tokens / baseline[0]
                        diff = max(float(np.abs(a - b).max()) for a, b in zip(baseline[1], vectors["fp32"]))
                print(
                    f"{shape:<9}{name:<13}{tps['fp32']:>11,.0f}{tps['bf16']:>11,.0f}{tps['bf16'] / tps['fp32']:>9.2f}x"
                    f"{tps['int8']:>11,.0f}{tps['int8'] / tps['fp32']:>9.2f}x"
                    f"{base_tps:>10,.0f}{tps['fp32'] / base_tps:>8.1f}x{diff:>11.1e}"
                    f"{gflops:>10.1f}{100 * gflops / roofline:>8.0f}%"
                )
                if name == "long-tailed":
                    notes += [
                        f"{shape} {p} vs fp32 on real text, {line}"
                        for p in precisions[1:]
                        for line in accuracy(vectors["fp32"], vectors[p])
                    ]
            if args.onednn_verbose:
                with onednn_verbose(True):
                    bilm.embed_sentences(workloads["uniform"][:4], precision="bf16")
    for note in notes:
        print(f"  {note}")


if __name__ == "__main__":
    main()
