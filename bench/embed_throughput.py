"""Throughput of ``BiLM.embed_sentences`` next to AllenNLP's ELMo and a matmul roofline, in one run.

    .venv/bin/python bench/embed_throughput.py [--shapes small,original] [--repeats 3] [--no-allennlp]

For each shape: random bilm-tf-initialised weights written as options.json + weights.hdf5, 64 sentences of
10–40 tokens drawn from a Zipfian vocabulary of made-up words, then
* ours: tokens/s of ``embed_sentences`` (stateless, CPU float32, median of the repeats),
* AllenNLP 2.10.1 ``_ElmoBiLm`` on the same files and sentences (its own venv), and the largest absolute
  difference between its activations and ours,
* model GFLOP/s (LSTM, char CNN per distinct word, highway, projection) against ``torch.matmul`` GFLOP/s
  measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from elmo_core import BiLM  # noqa: E402
from elmo_core.config import ModelConfig, preset  # noqa: E402
from elmo_core.model import init_bilm_tf  # noqa: E402


def make_sentences(n: int = 64, seed: int = 0) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, size=rng.integers(1, 12))) for _ in range(5000)]
    ranks = np.arange(1, len(words) + 1)
    p = (1.0 / ranks) / (1.0 / ranks).sum()
    return [[words[i] for i in rng.choice(len(words), size=rng.integers(10, 41), p=p)] for _ in range(n)]


def model_flops(config: ModelConfig, sentences: list[list[str]], batch_size: int) -> float:
    """Floating-point operations the model actually performs, batch by batch as ``embed_sentences`` runs it.

    Per distinct word of a batch: the char CNN over the kept char positions, highway, projection and layer 0's
    input-to-gates product; per token step (boundaries included): the recurrent and projection products of
    every layer and the input product of layers >= 1. Element-wise work is not counted.
    """
    p, h, n_layers = config.lstm.projection_dim, config.lstm.dim, config.lstm.n_layers
    cnn = config.char_cnn
    d, f, max_width = cnn.embedding.dim, cnn.n_filters, max(w for w, _ in cnn.filters)
    input_gates = 2 * p * 4 * h
    per_step = 2 * (p * 4 * h + (h * p if p < h else 0))  # recurrent + projection
    ordered = sorted(sentences, key=len)
    total = 0.0
    for start in range(0, len(ordered), batch_size):
        batch = ordered[start : start + batch_size]
        words = {w for s in batch for w in s}
        n_distinct = len(words) + 2  # + <S>, </S>
        longest = max(len(w.encode()) for w in words) + 2  # + begin/end-of-word markers
        kept = min(cnn.max_characters_per_token, longest + max_width)
        per_word = sum(2 * count * width * d * (kept - width + 1) for width, count in cnn.filters)
        per_word += cnn.n_highway * 2 * (2 * f * f) + (2 * f * p if f != p else 0) + 2 * input_gates
        steps = sum(len(s) + 2 for s in batch)
        total += n_distinct * per_word + steps * 2 * (n_layers * per_step + (n_layers - 1) * input_gates)
    return total


def describe_machine(device: torch.device | str = "cpu") -> str:
    """The CPU model, threads, torch's CPU kernel level and whether bf16 runs natively: which kernels ran."""
    from elmo_core.precision import cpu_capability, cpu_has_native_bf16

    model = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "unknown CPU",
        )
        if Path("/proc/cpuinfo").exists()
        else "unknown CPU"
    )
    text = (
        f"torch {torch.__version__}, {model}, {torch.get_num_threads()} threads, CPU kernels {cpu_capability()}, "
        f"native bf16 {'yes' if cpu_has_native_bf16() else 'no'}"
    )
    if torch.device(device).type == "cuda":
        text += f"; GPU {torch.cuda.get_device_name()}"
    return text


def matmul_roofline(size: int = 2048, repeats: int = 10) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.matmul(a, b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / min(times) / 1e9


def time_ours(bilm: BiLM, sentences: list[list[str]], repeats: int) -> tuple[float, list[np.ndarray]]:
    out = bilm.embed_sentences(sentences)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        bilm.embed_sentences(sentences)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], out


def run_allennlp(model_dir: Path, sentences_file: Path, repeats: int) -> tuple[float, np.ndarray] | str:
    try:
        python = (
            subprocess.run(
                ["bash", str(ROOT / "bench" / "allennlp_venv.sh")], check=True, capture_output=True, text=True
            )
            .stdout.strip()
            .splitlines()[-1]
        )
    except subprocess.CalledProcessError as exc:
        return f"could not set up .venv-allennlp: {exc.stderr.strip()[-300:]}"
    out_file = model_dir / "allennlp.npz"
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
    return seconds, np.load(out_file)["activations"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="small,original")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-allennlp", action="store_true")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    sentences = make_sentences()
    n_tokens = sum(len(s) for s in sentences)
    roofline = matmul_roofline()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}; "
        f"{len(sentences)} sentences, {n_tokens} tokens; torch.matmul roofline {roofline:.1f} GFLOP/s"
    )
    header = f"{'shape':<10}{'ours tok/s':>12}{'AllenNLP tok/s':>16}{'speed-up':>10}{'max |diff|':>12}{'GFLOP/s':>10}{'roofline %':>12}"
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        sentences_file = Path(tmp) / "sentences.json"
        sentences_file.write_text(json.dumps(sentences))
        for shape in args.shapes.split(","):
            torch.manual_seed(0)
            config = preset(shape)
            model_dir = Path(tmp) / shape
            fresh = BiLM(config)
            init_bilm_tf(fresh)
            fresh.save_pretrained(str(model_dir))
            del fresh
            bilm = BiLM.from_pretrained(str(model_dir), device=args.device)
            seconds, ours = time_ours(bilm, sentences, args.repeats)
            ours_tps = n_tokens / seconds
            gflops = model_flops(config, sentences, 64) / seconds / 1e9
            base_tps, diff, note = float("nan"), float("nan"), ""
            if not args.no_allennlp:
                baseline = run_allennlp(model_dir, sentences_file, args.repeats)
                if isinstance(baseline, str):
                    note = baseline
                else:
                    base_seconds, acts = baseline
                    base_tps = n_tokens / base_seconds
                    diff = max(float(np.abs(acts[i, :, : len(s)] - ours[i]).max()) for i, s in enumerate(sentences))
            speedup = ours_tps / base_tps if base_tps == base_tps else float("nan")
            print(
                f"{shape:<10}{ours_tps:>12,.0f}{base_tps:>16,.0f}{speedup:>9.1f}x{diff:>12.1e}{gflops:>10.1f}{100 * gflops / roofline:>11.1f}%"
            )
            if note:
                print(f"  ({note})")


if __name__ == "__main__":
    main()
