"""Training tokens/s (forward + backward + Adagrad step, sampled softmax) for the small and original shapes, with
FLOPs per token from the config and the fraction of a `torch.matmul` roofline measured in the same run.

    .venv/bin/python bench/train_throughput.py [--shapes small,original] [--steps 3] [--device cpu]

Batches come from the real batch generator over a generated Zipfian corpus (100k-word vocabulary, 8192
negatives as bilm-tf). On CUDA the step runs under bf16 autocast, as the trainer does.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from corpus_gen import write_token_id_corpus  # noqa: E402
from embed_throughput import matmul_roofline  # noqa: E402

from elmo_core import BiLM  # noqa: E402
from elmo_core.batches import LMBatcher  # noqa: E402
from elmo_core.config import ModelConfig, preset  # noqa: E402
from elmo_core.model import init_bilm_tf  # noqa: E402
from elmo_core.softmax import LogUniformSampler  # noqa: E402
from elmo_core.train import LMObjective, _clip_global_norm  # noqa: E402

VOCAB = 100_000
NEGATIVES = 8192
BATCH = {"small": 128, "medium": 64, "original": 64}  # bilm-tf used 128 rows per GPU


def train_flops_per_token(config: ModelConfig, n_negatives: int, batch_tokens: int) -> float:
    """Forward multiply-adds x 2, times 3 for forward + backward: char CNN (50 positions), highway, projection,
    both LSTM directions (input, recurrent, projection products) and the sampled softmax."""
    cnn, lstm = config.char_cnn, config.lstm
    p, h, f, d = lstm.projection_dim, lstm.dim, cnn.n_filters, cnn.embedding.dim
    c = cnn.max_characters_per_token
    encoder = (
        sum(2 * n * w * d * (c - w + 1) for w, n in cnn.filters)
        + cnn.n_highway * 4 * f * f
        + (2 * f * p if f != p else 0)
    )
    per_direction = lstm.n_layers * 2 * (p * 4 * h + p * 4 * h + (h * p if p < h else 0))
    softmax = 2 * p * (n_negatives + 1)
    forward = 2 * encoder + 2 * per_direction + 2 * softmax  # encoder runs on both streams' tokens
    return 3.0 * forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="small,original")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=None, help="rows per step (default: per shape)")
    args = parser.parse_args()
    device = torch.device(args.device)
    roofline = matmul_roofline() if device.type == "cpu" else _cuda_roofline()
    print(
        f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} threads; matmul roofline {roofline:,.0f} GFLOP/s"
        f"{' (bf16)' if device.type == 'cuda' else ' (float32)'}"
    )
    print(f"{'shape':<10}{'batch':>7}{'tok/s':>10}{'GFLOP/token':>13}{'GFLOP/s':>10}{'roofline %':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        write_token_id_corpus(Path(tmp), 300_000, n_types=VOCAB - 3)
        for shape in args.shapes.split(","):
            config = preset(shape).model_copy(update={"n_tokens_vocab": VOCAB})
            rows = args.batch or BATCH.get(shape, 16)
            torch.manual_seed(0)
            bilm = BiLM(config)
            init_bilm_tf(bilm)
            bilm.to(device).train()
            objective = LMObjective(bilm, 0.1, sparse=device.type == "cpu")
            params = [p for p in bilm.parameters() if p.requires_grad]
            optimizer = torch.optim.Adagrad(params, lr=0.2, initial_accumulator_value=1.0)
            sampler = LogUniformSampler(VOCAB)
            batcher = iter(LMBatcher(tmp, rows, 20, seed=0))
            state = None
            times = []
            for step in range(args.steps + 1):
                batch = next(batcher)
                tensors = [
                    torch.from_numpy(batch[k]).long().to(device)
                    for k in (
                        "tokens_characters",
                        "tokens_characters_reverse",
                        "next_token_id",
                        "next_token_id_reverse",
                    )
                ]
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                sampled, tries = sampler.sample(NEGATIVES)
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    loss, _, _, state = objective(*tensors, state, sampled, tries, sampler)
                optimizer.zero_grad(set_to_none=True)
                (loss * 20).backward()
                _clip_global_norm(params, 10.0)
                optimizer.step()
                state = tuple(s.detach() for s in state)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if step:  # the first step warms up
                    times.append(time.perf_counter() - start)
            seconds = sorted(times)[len(times) // 2]
            tps = rows * 20 / seconds
            flops = train_flops_per_token(config, NEGATIVES, rows * 20)
            print(
                f"{shape:<10}{rows:>7}{tps:>10,.0f}{flops / 1e9:>13.3f}{tps * flops / 1e9:>10,.1f}{100 * tps * flops / 1e9 / roofline:>11.1f}%"
            )
            del bilm, objective, optimizer


def _cuda_roofline(size: int = 8192) -> float:
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * size**3 / (time.perf_counter() - start) / 1e9


if __name__ == "__main__":
    main()
