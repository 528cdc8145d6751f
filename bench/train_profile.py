"""Where a training step's time goes: each part of the step timed on its own, forward and backward, beside the whole.

    .venv/bin/python bench/train_profile.py [--shapes mini,2x512_128] [--batches 32,128] [--threads 1] [--repeats 7]

Parts, each run on the step's own batch and shapes, with gradients, in the step's precision (medians of
``--repeats`` rounds of CPU time, so other processes on the machine count less):

* batch: taking the next window (made ahead by the prefetch thread, ``prefetch: 0`` to make it here) and the
  sampler's negatives;
* encoder: distinct words of the window, char CNN, highway and projection (``BiLM._tokens``);
* LSTM: both directions' stacks over the window (``ElmoLstm``), with dropout;
* softmax: the sampled softmax and its loss for both directions;
* optimizer: global-norm clipping and the Adagrad step.

"other" is the whole step (``train.train_step``) less the parts: the glue between them (the top-layer dropout, the
stacking of the layer inputs, the state's detach, the loss scaling, the metrics line). "casts" is, from a profiler
pass over whole steps, the share of the step spent in dtype conversions and copies (inside the parts above).
Data: the main job's corpus (Python's pydoc topics), ingested and counted as the main job does.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from corpus_gen import main_job_data  # noqa: E402
from train_throughput import bench_shape  # noqa: E402

from elmo_core.bilm.packing import Packing  # noqa: E402
from elmo_core.bilm.softmax import sampled_softmax_loss  # noqa: E402
from elmo_core.data.prefetch import KEYS  # noqa: E402
from elmo_core.options import CPU_TRAIN_OPTIONS, TrainConfig  # noqa: E402
from elmo_core.precision import autocast  # noqa: E402
from elmo_core.text.chars import model_ids  # noqa: E402
from elmo_core.train.loop import _clip_global_norm, setup  # noqa: E402
from elmo_core.train.loop import train_step as step  # noqa: E402

# isort: split
import torch  # noqa: E402  (after elmo_core: under ELMO_CPU_ISA=avx2 it holds torch to AVX2 as torch loads)

PARTS = ("batch", "encoder", "LSTM", "softmax", "optimizer")


def _cpu(fn) -> float:  # noqa: ANN001
    start = time.process_time()
    fn()
    return time.process_time() - start


class Parts:
    """One run (``train.setup``) and closures that run each part of its step on its own."""

    def __init__(self, data: Path, out: Path, shape: str, rows: int, precision: str) -> None:
        options = CPU_TRAIN_OPTIONS.model_dump(exclude={"bf16", "resume", "preset", "model"})
        options.update(tracking="none", precision=precision, device="cpu", max_steps=10**9, batch_size=rows)
        options.update(dropout=0.1, optimizer="adagrad", learning_rate=0.2, lr_schedule="constant", warmup_steps=0)
        if shape != "mini":
            options["n_negative_samples_batch"] = 8192
        self.run = setup(TrainConfig(data=str(data), out=str(out), model=bench_shape(shape), **options))
        for _ in range(3):
            step(self.run)  # warm caches, allocator and the sampler

    def _inputs(self) -> tuple[list[torch.Tensor], torch.Tensor, int]:
        run = self.run
        batch = run.batches.next()
        sampled, tries = run.sampler.sample(run.config.n_negative_samples_batch)
        return [batch[k] for k in KEYS], sampled, tries

    def measure(self) -> dict[str, tuple[float, float]]:
        """Each part: (forward CPU seconds, forward + backward CPU seconds)."""
        run, bilm = self.run, self.run.bilm
        times: dict[str, tuple[float, float]] = {}
        times["batch"] = (_cpu(self._inputs), 0.0)
        tensors, sampled, tries = self._inputs()
        chars_f, chars_b = model_ids(tensors[0]), model_ids(tensors[1])

        def encoder() -> torch.Tensor:
            with autocast(run.device, run.precision):
                return bilm._tokens(chars_f, None, chars_b, None).table

        table = encoder()
        grad_table = torch.randn_like(table)
        times["encoder"] = (_cpu(encoder), _cpu(lambda: encoder().backward(grad_table.to(table.dtype))))
        tokens = bilm._tokens(chars_f, None, chars_b, None)
        packing = Packing.of(tokens.lengths)
        ids = packing.read(tokens.forward, tokens.backward)
        leaf = tokens.table.detach().float().requires_grad_()
        state = run.state

        def lstm() -> torch.Tensor:
            with autocast(run.device, run.precision):
                outputs, _ = bilm.lstm(
                    leaf,
                    ids,
                    packing,
                    state,
                    make_cell=bilm.runs.cell_of_call(None, bilm.device),
                    dropout=run.config.dropout,
                )  # the cell training runs (the C gates on a CPU)
            return outputs[-1]

        top = lstm()
        grad_top = torch.randn(top.shape)
        times["LSTM"] = (_cpu(lstm), _cpu(lambda: lstm().float().backward(grad_top)))
        p = bilm.config.lstm.projection_dim
        hidden = torch.randn(2, tensors[2].numel(), p, requires_grad=True)
        targets = (tensors[2].reshape(-1), tensors[3].reshape(-1))

        def softmax() -> torch.Tensor:
            with autocast(run.device, run.precision):
                losses = [
                    sampled_softmax_loss(
                        hidden[d],
                        targets[d],
                        bilm.softmax.weight,
                        bilm.softmax.bias,
                        sampled,
                        tries,
                        run.sampler,
                        self.run.model.sparse,
                    )
                    for d in (0, 1)
                ]
            return 0.5 * (losses[0] + losses[1])

        times["softmax"] = (_cpu(softmax), _cpu(lambda: softmax().backward()))
        step(run)  # leaves real gradients in place for the optimizer part

        def optimizer() -> None:
            _clip_global_norm(run.params, run.config.all_clip_norm_val)
            run.optimizer.step()

        times["optimizer"] = (0.0, _cpu(optimizer))
        times["step"] = (0.0, _cpu(lambda: step(run)))
        return times

    def cast_share(self, steps: int = 5) -> float:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step(self.run)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        casts = sum(e.self_cpu_time_total for e in events if e.key in ("aten::copy_", "aten::_to_copy", "aten::to"))
        return casts / max(total, 1e-9)


def main() -> None:
    from elmo_core import cpu

    print(cpu.describe())  # which CPU these figures come from (AVX-512, avx512_bf16, AMX)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="mini,2x512_128")
    parser.add_argument("--batches", default="32,128")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"CPU time per training step, ms (median of {args.repeats}; forward / forward+backward); {args.threads} thread(s)"
    )
    header = (
        f"{'shape':<11}{'batch':>8}{'prec':>6}"
        + "".join(f"{p:>15}" for p in PARTS)
        + f"{'other':>9}{'step':>9}{'casts':>7}{'tok/s':>9}"
    )
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        data = main_job_data(Path(tmp))
        for shape in args.shapes.split(","):
            for rows in (int(b) for b in args.batches.split(",")):
                for precision in args.precisions.split(","):
                    parts = Parts(data, Path(tmp) / f"run-{shape}-{rows}-{precision}", shape, rows, precision)
                    rounds = [parts.measure() for _ in range(args.repeats)]
                    med = {
                        k: tuple(sorted(r[k][i] for r in rounds)[len(rounds) // 2] * 1000 for i in (0, 1))
                        for k in rounds[0]
                    }
                    total = med["step"][1]
                    summed = sum(med[p][1] if p != "batch" else med[p][0] for p in PARTS)
                    cells = []
                    for p in PARTS:
                        fwd, both = med[p]
                        cells.append(
                            f"{fwd:>15.1f}"
                            if p == "batch"
                            else (f"{both:>15.1f}" if p == "optimizer" else f"{f'{fwd:.1f} / {both:.1f}':>15}")
                        )
                    print(
                        f"{shape:<11}{f'{rows}x20':>8}{precision:>6}"
                        + "".join(cells)
                        + f"{total - summed:>9.1f}{total:>9.1f}{100 * parts.cast_share():>6.0f}%{rows * 20 / total * 1000:>9,.0f}"
                    )
                    sys.stdout.flush()


if __name__ == "__main__":
    main()
