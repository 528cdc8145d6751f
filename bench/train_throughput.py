"""Training tokens/s in fp32 and bf16 side by side (forward + backward + Adagrad step, sampled softmax), with FLOPs
per token and the fraction of a `torch.matmul` roofline measured in the same run; and (``--quality``) heldout
perplexity after the same number of steps in both precisions on real text.

    .venv/bin/python bench/train_throughput.py [--shapes mini,2x512_128,small] [--batches 32,128] [--steps 3]
                                               [--threads N] [--device cpu] [--quality] [--main-job]
                                               [--against REV] [--training-kernel]

Shapes: the presets (``mini`` is the main job's model) and ``2x512_128`` (the published char CNN, one highway, a
2-layer LSTM of 512 cells projected to 128). Each runs at every batch of ``--batches`` rows x 20 steps (bilm-tf
trained 128 x 20 per GPU; the main job 32 x 20).
Throughput: batches from the real batch generator over a generated Zipfian corpus (100k-word vocabulary; 8192
negatives as bilm-tf, 512 for ``mini`` as the main job); the two precisions alternate in rounds so that both see
the same machine. bf16 is autocast
for the forward with float32 master weights, optimizer state, LSTM cell and softmax loss (``precision: bf16``).
Main job (``--main-job``): ``train.train_step`` with the main job's defaults against its recipe before bench/cpu_recipe.py,
on this code. ``--against REV``: the main job's training as a user runs it, this checkout against the code at git
revision REV (each with its own defaults then), on the same data: one worker process per tree, stepping in
alternating rounds. ``--training-kernel`` (instead of the precision table): whole training steps with the reference
against the training kernels, one autograd node per LSTM step (``elmo_core/bilm/kernels/trained_step.py``) and then the
char CNN's sparse backward too (``elmo_core/bilm/kernels/char_cnn.py``), same model and batches, alternating.
Quality: the main job's recipe (Python's pydoc topics, the mini model, CPU_TRAIN_OPTIONS) trained by
``elmo_core.train.loop.train`` for ``--quality-steps`` steps in each precision, same seed and data.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
os.environ.setdefault("ELMO_ALLOW_EMULATED_BF16", "1")  # a bench times bf16 where it is emulated too (the slowdown)

from corpus_gen import main_job_data, write_token_id_corpus  # noqa: E402
from cpu_recipe import TODAY  # noqa: E402  (the main job's recipe before bench/cpu_recipe.py)
from embed_throughput import describe_machine, matmul_roofline  # noqa: E402

from elmo_core import BiLM  # noqa: E402
from elmo_core.bilm.initialization import init_bilm_tf  # noqa: E402
from elmo_core.bilm.softmax import LogUniformSampler  # noqa: E402
from elmo_core.config import ModelConfig, preset  # noqa: E402
from elmo_core.data.batches import LMBatcher  # noqa: E402
from elmo_core.precision import autocast  # noqa: E402
from elmo_core.train.loop import _clip_global_norm  # noqa: E402
from elmo_core.train.objective import LMObjective  # noqa: E402

# isort: split
import torch  # noqa: E402  (after elmo_core: under ELMO_CPU_ISA=avx2 it holds torch to AVX2 as torch loads)

VOCAB = 100_000
NEGATIVES = {"mini": 512}  # the main job's; bilm-tf's 8192 for the rest


def bench_shape(name: str) -> ModelConfig:
    """A preset, or ``2x512_128``: the published char CNN with one highway and a 2x512_128 LSTM."""
    if name == "2x512_128":
        base = preset("small")
        return base.model_copy(update={"lstm": base.lstm.model_copy(update={"dim": 512, "projection_dim": 128})})
    return preset(name)  # type: ignore[arg-type]


def train_flops_per_token(config: ModelConfig, n_negatives: int) -> float:
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


class Trainer:
    """One model in one precision, stepping through the batch generator as the trainer does."""

    def __init__(
        self,
        config: ModelConfig,
        data: str,
        rows: int,
        device: torch.device,
        precision: str,
        negatives: int,
        kernels: dict[str, bool] | None = None,
    ) -> None:
        torch.manual_seed(0)
        self.bilm = BiLM(config)
        init_bilm_tf(self.bilm)
        self.bilm.to(device).train()
        self.bilm.prepare_training(**(kernels or {}))  # none forced: what train.setup chooses
        self.device, self.precision = device, precision
        self.objective = LMObjective(self.bilm, 0.1, sparse=device.type == "cpu")
        self.params = [p for p in self.bilm.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adagrad(self.params, lr=0.2, initial_accumulator_value=1.0)
        self.sampler = LogUniformSampler(VOCAB)
        self.batches = iter(LMBatcher(data, rows, 20, seed=0))
        self.negatives = negatives
        self.state = None

    def step(self) -> float:
        batch = next(self.batches)
        keys = ("tokens_characters", "tokens_characters_reverse", "next_token_id", "next_token_id_reverse")
        tensors = [torch.from_numpy(batch[k]).long().to(self.device) for k in keys]
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        sampled, tries = self.sampler.sample(self.negatives)
        with autocast(self.device, self.precision):
            loss, _, _, state = self.objective(*tensors, self.state, sampled, tries, self.sampler)
        self.optimizer.zero_grad(set_to_none=True)
        (loss * 20).backward()
        _clip_global_norm(self.params, 10.0)
        self.optimizer.step()
        self.state = tuple(s.detach() for s in state)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start


def _cases(args: argparse.Namespace) -> Iterator[tuple[str, str, ModelConfig, int, int]]:
    """(corpus folder, shape, config, negatives, rows) for each shape and batch asked for, on one generated Zipfian
    corpus."""
    with tempfile.TemporaryDirectory() as tmp:
        write_token_id_corpus(Path(tmp), 400_000, n_types=VOCAB - 3)
        for shape in args.shapes.split(","):
            config = bench_shape(shape).model_copy(update={"n_tokens_vocab": VOCAB})
            for rows in (int(b) for b in args.batches.split(",")):
                yield tmp, shape, config, NEGATIVES.get(shape, 8192), rows


def _alternate(trainers: dict[str, Trainer], steps: int, rows: int) -> dict[str, float]:
    """Tokens/s of each trainer: one warm-up step each, then ``steps`` rounds of one step each, alternating so that
    all see the same machine; medians."""
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for trainer in trainers.values():
        trainer.step()
    for _ in range(steps):
        for name, trainer in trainers.items():
            times[name].append(trainer.step())
    return {name: rows * 20 / sorted(t)[len(t) // 2] for name, t in times.items()}


def throughput(args: argparse.Namespace, device: torch.device) -> None:
    roofline = matmul_roofline() if device.type == "cpu" else _cuda_roofline()
    print(
        f"matmul roofline {roofline:,.0f} GFLOP/s ({'float32' if device.type == 'cpu' else 'bf16'}), {torch.get_num_threads()} threads"
    )
    header = (
        f"{'shape':<11}{'batch':>9}{'negatives':>10}{'fp32 tok/s':>12}{'bf16 tok/s':>12}{'bf16/fp32':>11}"
        f"{'GFLOP/token*':>13}{'fp32 roofline*':>16}"
    )
    print(header)
    print("-" * len(header))
    for tmp, shape, config, negatives, rows in _cases(args):
        trainers = {p: Trainer(config, tmp, rows, device, p, negatives) for p in ("fp32", "bf16")}
        tps = _alternate(trainers, args.steps, rows)
        flops = train_flops_per_token(config, negatives)
        print(
            f"{shape:<11}{f'{rows} x 20':>9}{negatives:>10}{tps['fp32']:>12,.0f}{tps['bf16']:>12,.0f}"
            f"{tps['bf16'] / tps['fp32']:>10.2f}x{flops / 1e9:>13.3f}"
            f"{100 * tps['fp32'] * flops / 1e9 / roofline:>15.1f}%"
        )
        del trainers
    print("* nominal: the char CNN counted over all 50 positions for every token; the model runs it once per distinct")
    print("  word of a batch over the positions its longest word needs, so the nominal rate overstates the real one")


def training_kernel(args: argparse.Namespace, device: torch.device) -> None:
    """Whole training steps with the reference against the training kernels (``kernels/trained_step.py``, then also
    ``kernels/char_cnn.py``: what training chooses on a CPU), alternating, same model, data and precision."""
    print("\ntraining steps (tok/s): the reference; each LSTM step one node with the gates in C; and the char CNN's")
    print("sparse backward too (training's choice)")
    variants = {
        "reference": {"one_node": False, "sparse_char_cnn": False},
        "one node": {"one_node": True, "sparse_char_cnn": False},
        "+ char CNN": {"one_node": True, "sparse_char_cnn": True},
    }
    header = f"{'shape':<11}{'batch':>9}{'precision':>10}" + "".join(f"{name:>12}" for name in variants)
    print(header + f"{'speed-up':>10}")
    print("-" * (len(header) + 10))
    for tmp, shape, config, negatives, rows in _cases(args):
        for precision in ("fp32", "bf16"):
            trainers = {
                name: Trainer(config, tmp, rows, device, precision, negatives, kernels=kernels)
                for name, kernels in variants.items()
            }
            tps = _alternate(trainers, args.steps, rows)
            print(
                f"{shape:<11}{f'{rows} x 20':>9}{precision:>10}"
                + "".join(f"{tps[name]:>12,.0f}" for name in variants)
                + f"{tps['+ char CNN'] / tps['reference']:>9.2f}x"
            )
            del trainers


def quality(args: argparse.Namespace) -> None:
    """Heldout perplexity after the same steps, fp32 against bf16, same data and seed (the main job's recipe)."""
    from elmo_core.options import CPU_TRAIN_OPTIONS, TrainConfig
    from elmo_core.train.loop import train

    with tempfile.TemporaryDirectory() as tmp:
        data = main_job_data(Path(tmp))
        print(
            f"\nheldout perplexity after {args.quality_steps} steps (pydoc topics, mini model, CPU_TRAIN_OPTIONS, seed 0)"
        )
        results = {}
        for precision in ("fp32", "bf16"):
            options = CPU_TRAIN_OPTIONS.model_dump(exclude={"bf16", "resume"})
            options.update(max_steps=args.quality_steps, tracking="none", precision=precision, device="cpu")
            options["export"] = "last"  # the weights after exactly these steps in both precisions
            started = time.perf_counter()
            result = train(TrainConfig(data=str(data), out=f"{tmp}/{precision}", **options))
            results[precision] = result.perplexity["perplexity"]
            print(
                f"  {precision}: perplexity {results[precision]:.2f} (forward {result.perplexity['perplexity_forward']:.2f}, "
                f"backward {result.perplexity['perplexity_backward']:.2f}) in {time.perf_counter() - started:.0f} s"
            )
        print(
            f"  bf16 / fp32 perplexity: {results['bf16'] / results['fp32']:.4f} ({100 * (results['bf16'] / results['fp32'] - 1):+.2f}%)"
        )


def main_job(args: argparse.Namespace) -> None:
    """The main job's training as a user runs it (its defaults, torch's threads) against its defaults before, on
    its own data (pydoc topics): tokens/s of ``train.train_step`` in alternating rounds, in one run."""
    from elmo_core.options import CPU_TRAIN_OPTIONS, TrainConfig
    from elmo_core.train.loop import setup
    from elmo_core.train.loop import train_step as step

    with tempfile.TemporaryDirectory() as tmp:
        data = main_job_data(Path(tmp))
        now = CPU_TRAIN_OPTIONS.model_dump(exclude={"bf16", "resume"})
        runs = {}
        for name, options in (("before", {**now, **TODAY, "precision": "fp32"}), ("now", now)):
            options = {**options, "tracking": "none", "device": "cpu", "max_steps": 10**9}
            runs[name] = setup(TrainConfig(data=str(data), out=f"{tmp}/{name}", **options))
            for _ in range(5):
                step(runs[name])
        rates: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.main_job_rounds):
            for name, run in runs.items():
                start = time.perf_counter()
                for _ in range(20):
                    step(run)
                rates[name].append(20 * run.tokens_per_step / (time.perf_counter() - start))
        median = {name: sorted(r)[len(r) // 2] for name, r in rates.items()}
        print(
            f"\nthe main job's training (pydoc topics, {torch.get_num_threads()} threads, medians of {args.main_job_rounds} rounds of 20 steps)"
        )
        for name, run in runs.items():
            c = run.config
            print(
                f"  {name:<7} {run.precision} batch {c.batch_size} x {c.unroll_steps}, {c.n_negative_samples_batch} negatives, "
                f"{c.optimizer} {c.learning_rate:g}: {median[name]:,.0f} tok/s"
            )
        print(f"  now / before: {median['now'] / median['before']:.2f}x")


# The worker of --against: the main job's training (its defaults in that tree) stepped in rounds of 20 on "go".
_MAIN_JOB_WORKER = """
import sys, time
from elmo_core.options import CPU_TRAIN_OPTIONS, TrainConfig
try:
    import elmo_core.train.loop as train
except ImportError:  # before the trainer was a package
    import elmo_core.train as train
setup = train.setup
step = getattr(train, "train_step", None) or train.step  # named step before it was train_step
options = CPU_TRAIN_OPTIONS.model_dump(exclude={"bf16", "resume"})
options.update(tracking="none", device="cpu", max_steps=10**9)
run = setup(TrainConfig(data=sys.argv[1], out=sys.argv[2], **options))
for _ in range(5):
    step(run)
print(run.precision, flush=True)
for _ in sys.stdin:
    start = time.perf_counter()
    for _ in range(20):
        step(run)
    print(20 * run.tokens_per_step / (time.perf_counter() - start), flush=True)
"""


def main_job_against(args: argparse.Namespace) -> None:
    """This checkout's main-job training against the code at ``args.against``: the revision is extracted with
    ``git archive`` (nothing in the checkout changes) and each tree trains in its own process on the same data."""
    with tempfile.TemporaryDirectory() as tmp:
        data = main_job_data(Path(tmp))
        baseline = Path(tmp) / "baseline"
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.against], capture_output=True, check=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(baseline, filter="data")
        workers = {}
        for name, tree in ((args.against, baseline), ("this checkout", ROOT)):
            env = {**os.environ, "PYTHONPATH": str(tree)}
            workers[name] = subprocess.Popen(
                [sys.executable, "-c", _MAIN_JOB_WORKER, str(data), f"{tmp}/{len(workers)}"],
                cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
        precisions = {name: worker.stdout.readline().strip() for name, worker in workers.items()}  # type: ignore[union-attr]
        rates: dict[str, list[float]] = {name: [] for name in workers}
        for _ in range(args.main_job_rounds):  # one at a time, alternating: both see the same machine
            for name, worker in workers.items():
                worker.stdin.write("go\n")  # type: ignore[union-attr]
                worker.stdin.flush()  # type: ignore[union-attr]
                rates[name].append(float(worker.stdout.readline()))  # type: ignore[union-attr]
        for worker in workers.values():
            worker.stdin.close()  # type: ignore[union-attr]
            worker.kill()
            worker.wait()
    median = {name: sorted(r)[len(r) // 2] for name, r in rates.items()}
    print(
        f"\nthe main job's training as a user runs it (pydoc topics, its defaults in each tree, "
        f"{torch.get_num_threads()} threads, medians of {args.main_job_rounds} rounds of 20 steps)"
    )
    for name in workers:
        print(f"  {name:<14} precision {precisions[name]}: {median[name]:,.0f} tok/s")
    before, now = median[args.against], median["this checkout"]
    paired = sorted(n / b for n, b in zip(rates["this checkout"], rates[args.against]))  # each round's own ratio
    print(
        f"  this checkout / {args.against}: {now / before:.2f}x (median of the rounds' ratios "
        f"{paired[len(paired) // 2]:.2f}x, range {paired[0]:.2f}-{paired[-1]:.2f}x)"
    )


def main() -> None:
    from elmo_core import cpu

    print(cpu.describe())  # which CPU these figures come from (AVX-512, avx512_bf16, AMX)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="mini,2x512_128,small", help="presets, or 2x512_128")
    parser.add_argument("--batches", default="32,128", help="rows per step (x 20 steps)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per precision (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quality", action="store_true", help="also train the main job's model in both precisions")
    parser.add_argument("--main-job", action="store_true", help="also the main job's training: now against before")
    parser.add_argument("--main-job-rounds", type=int, default=7)
    parser.add_argument("--against", metavar="REV", help="also the main job's training against the code at git REV")
    parser.add_argument(
        "--training-kernel", action="store_true", help="whole steps: the reference against the training kernels"
    )
    parser.add_argument("--quality-steps", type=int, default=600)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(describe_machine(device))
    if args.shapes and not args.training_kernel:
        throughput(args, device)
    if args.main_job:
        main_job(args)
    if args.against:
        main_job_against(args)
    if args.training_kernel and device.type == "cpu":
        training_kernel(args, device)
    if args.quality:
        quality(args)


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
