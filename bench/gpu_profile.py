"""Where an embedding pass spends its time on a GPU: torch.profiler over one warm ``embed_sentences`` call.

    python bench/gpu_profile.py [--device cuda] [--shape original] [--precision bf16] [--sentences 3025]

Prints the wall time of the call, the time the GPU was busy (the sum of its kernels' own times) and the ops that took
the most GPU time and the most host time. A GPU busy for a small part of the wall time says the host (Python,
tokens to ids, copies of the answers) holds the job back, not the recurrence; issue 55's 500k tok/s needs the GPU
busy. Random weights of the preset shape, the real long-tailed sentences of bench/embed_throughput.py.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from embed_throughput import describe_machine, real_sentences  # beside this file
from torch.profiler import ProfilerActivity, profile

from elmo_core import BiLM
from elmo_core.bilm.initialization import init_bilm_tf
from elmo_core.config import preset
from elmo_core.runtime.engine import token_budget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="original")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--sentences", type=int, default=3025)
    parser.add_argument("--rows", type=int, default=18, help="ops listed per table")
    args = parser.parse_args()
    cuda = torch.device(args.device).type == "cuda"
    sentences = real_sentences(args.sentences)
    tokens = sum(len(s) for s in sentences)
    print(describe_machine(args.device))
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        fresh = BiLM(preset(args.shape))
        init_bilm_tf(fresh)
        fresh.save_pretrained(str(Path(tmp) / "m"))
        bilm = BiLM.from_pretrained(str(Path(tmp) / "m"), device=args.device)
    print(f"kernels: {bilm.prepare(args.precision)}")
    budget, why = token_budget(bilm.device, bilm.config)  # as bench/embed_throughput.py's figures ran
    print(f"{budget:,} padded tokens a pass ({why})")

    def call() -> None:
        bilm.embed_sentences(sentences, precision=args.precision, max_batch_tokens=budget)

    for _ in range(2):  # warm: compiles, captures
        call()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    call()
    sync()
    plain = time.perf_counter() - start
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        call()
        sync()
        profiled = time.perf_counter() - start
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) if cuda else 0.0
    host_ops_us = sum(e.self_cpu_time_total for e in events)
    print(
        f"{args.shape} {args.precision}: {len(sentences)} sentences, {tokens:,} tokens; {plain:.3f} s a call "
        f"({tokens / plain:,.0f} tok/s), {profiled:.3f} s profiled; GPU busy {device_us / 1e6:.3f} s "
        f"({device_us / 1e6 / profiled:.0%} of the profiled call); host in torch ops {host_ops_us / 1e6:.3f} s, the rest "
        f"({profiled - host_ops_us / 1e6:.3f} s) in Python and numpy around them"
    )
    if cuda:
        print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
