"""The batch generator's tokens/s and peak memory at 10M and 100M corpus tokens, next to the biLM's own
training-step speed (forward + backward of the small shape on the same batch) measured in the same run.

    .venv/bin/python bench/batch_throughput.py [--sizes 10000000,100000000] [--batches 400]

Targets: the generator at >= 10x the biLM step's tokens/s (it must never starve training), and flat memory
as the corpus grows (it streams one Parquet row group at a time).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from corpus_gen import peak_rss_mb_of, write_token_id_corpus  # noqa: E402

BATCH, UNROLL = 128, 20  # bilm-tf's per-GPU batch and window

RUN_BATCHER = """
import json, sys, time
from elmo_core.batches import LMBatcher
b = LMBatcher(sys.argv[1], batch_size=%d, unroll_steps=%d, seed=0)
it = iter(b)
next(it)
start = time.perf_counter()
for _ in range(int(sys.argv[2])):
    next(it)
print(json.dumps({"seconds": time.perf_counter() - start}))
""" % (BATCH, UNROLL)


def bilm_step_tokens_per_s(token_id_dir: Path, repeats: int = 3) -> float:
    """Forward + backward of the small biLM's char CNN and LSTMs on a real batch from the generator."""
    import torch

    from elmo_core import BiLM
    from elmo_core.batches import LMBatcher
    from elmo_core.chars import model_ids
    from elmo_core.config import small
    from elmo_core.model import init_bilm_tf

    torch.manual_seed(0)
    bilm = BiLM(small())
    init_bilm_tf(bilm)
    bilm.train()
    batch = next(iter(LMBatcher(token_id_dir, batch_size=BATCH, unroll_steps=UNROLL, seed=0)))
    chars = model_ids(torch.from_numpy(batch["tokens_characters"]).long())
    chars_b = model_ids(torch.from_numpy(batch["tokens_characters_reverse"]).long())
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        outputs = bilm(chars, backward_inputs=chars_b)["activations"][1:]
        sum(layer.sum() for layer in outputs).backward()
        times.append(time.perf_counter() - start)
    return BATCH * UNROLL / sorted(times[1:])[len(times[1:]) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000000,100000000")
    parser.add_argument("--batches", type=int, default=400)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_token_id_corpus(Path(tmp), 200_000)
        step = bilm_step_tokens_per_s(Path(tmp))
    print(f"biLM training step (small shape, forward + backward, batch {BATCH}x{UNROLL}): {step:,.0f} tokens/s")
    print(f"{'corpus tokens':>14}{'batcher tok/s':>15}{'x biLM step':>13}{'peak MB':>10}")
    for size in (int(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            write_token_id_corpus(Path(tmp), size)
            _, peak, out = peak_rss_mb_of(RUN_BATCHER, tmp, str(args.batches))
            seconds = json.loads(out.strip().splitlines()[-1])["seconds"]
            tps = args.batches * BATCH * UNROLL / seconds
            print(f"{size:>14,}{tps:>15,.0f}{tps / step:>12.0f}x{peak:>10.0f}")


if __name__ == "__main__":
    main()
