"""Train (or fine-tune) the biLM as bilm-tf does, with exact resume, MLflow tracking and DDP.

    batches (batches.py) ─► char CNN + highway + projection (shared) ─► forward / backward LSTM stacks
        ─► dropout ─► one shared softmax: sampled (training) or full (evaluation)

* State is carried per row between windows; gradients stop at the window boundary (truncated BPTT).
* The gradient is taken of ``loss × unroll_steps`` and clipped to a global norm, then Adagrad (lr 0.2, initial
  accumulator 1.0) steps: bilm-tf's recipe. AdamW is an option.
* ``precision: bf16`` autocasts the forward (CPU or CUDA); master weights, optimizer state, the LSTM cell and
  the softmax with its loss stay float32. On a CPU each LSTM step is one autograd node with its gates in C, and
  the char CNN's backward reaches each max's position only (``BiLM.prepare_training``, ``kernels.trained_step``,
  ``kernels.char_cnn``), chosen once and logged.
* A checkpoint (``checkpoint.py``) holds everything in ``Checkpoint``: an exact resume continues the same
  batches, samples and dropout masks. Under ``torchrun`` each rank reads disjoint sentences; rank 0 logs and saves.

Read ``train`` at the bottom first: ``setup`` builds a ``Run``, ``train_step`` trains one batch (``run.step`` counts
them), ``run.save``/``run.restore`` move a ``Checkpoint`` in and out, ``finish`` evaluates, exports and
registers the model.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from elmo_core.bilm.fine_tune import for_vocabulary
from elmo_core.bilm.initialization import init_bilm_tf
from elmo_core.bilm.model import BiLM
from elmo_core.bilm.softmax import LogUniformSampler
from elmo_core.data.batches import LMBatcher
from elmo_core.data.prefetch import Prefetcher
from elmo_core.errors import (
    ConfigError,
    InputError,
    TrainingDivergedError,
    TrainingStopped,
)
from elmo_core.fileio import FolderLock, write_text_atomic
from elmo_core.options import TrainConfig
from elmo_core.precision import autocast
from elmo_core.progress import TokenRate, track
from elmo_core.ranks import Rank, this_process
from elmo_core.runtime import place, resolve_model, take_threads
from elmo_core.runtime.onnx_file import write_beside
from elmo_core.tracking import (
    MLflowTracker,
    NodeSystemMetrics,
    NullTracker,
    Tracker,
    check_reachable,
)
from elmo_core.train.budget import now
from elmo_core.train.checkpoint import (
    BestWeights,
    Checkpoint,
    checkpoint_dir,
    load_newest_valid,
)
from elmo_core.train.ddp import StopRequest, agreed_max, check_replicas_agree, gather, init_distributed
from elmo_core.train.evaluate import describe_perplexity, evaluate, heldout_windows, num_rows
from elmo_core.train.export import latest_checkpoint
from elmo_core.train.lineage import facts as dataset_facts
from elmo_core.train.lineage import split_dataset
from elmo_core.train.objective import LMObjective
from elmo_core.train.plan import TrainingPlan, plan_training
from elmo_core.train.recipe import describe_softmax, settle_softmax, sparse_softmax, table_measured
from elmo_core.train.run import Run, TrainResult, restore, save

__all__ = [
    "TrainConfig",
    "TrainResult",
    "TrainingDivergedError",
    "train",
]

log = logging.getLogger(__name__)


# ----- building a run ---------------------------------------------------------------------------------


def _build_model(config: TrainConfig, vocab: list[str], counts: np.ndarray) -> BiLM:
    """A fresh model, or the one to fine-tune (a new softmax where its vocabulary differs); a new softmax's bias from
    the train counts under ``softmax_bias_init: unigram``."""
    unigram = counts if config.softmax_bias_init == "unigram" else None
    if config.init_from is None:
        bilm = BiLM(config.architecture(len(vocab)), vocab=vocab)
        init_bilm_tf(bilm, unigram)
        return bilm
    model = resolve_model(config.init_from)  # the runtime's resolver: folders, published files, models:/ URIs
    model_dir = model.directory
    bilm = BiLM.from_pretrained(str(model.options), str(model.weights), vocab_file=str(model.vocab or "") or None)
    if bilm.vocab is not None and bilm.vocab != vocab:
        raise ConfigError(
            f"{model_dir}/vocab.txt differs from {config.data}/vocab.txt; build the data with "
            f"`elmo vocab --vocab-file {model_dir}/vocab.txt` so fine-tuning keeps the model's vocabulary"
        )
    if bilm.softmax is None or bilm.config.n_tokens_vocab != len(vocab):
        log.warning(
            "%s has no softmax for this %d-word vocabulary: initialising a new one (bilm-tf's N(0, 1/sqrt(P)))",
            model_dir,
            len(vocab),
        )
        bilm = for_vocabulary(bilm, vocab, unigram)  # an ELMoForManyLangs model keeps its dictionaries, grown
    bilm.vocab = vocab
    return bilm


def _make_optimizer(config: TrainConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if config.optimizer == "adagrad":
        return torch.optim.Adagrad(
            params, lr=config.learning_rate, initial_accumulator_value=config.initial_accumulator_value
        )
    return torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)


def learning_rate_at(config: TrainConfig, step: int, total_steps: int | None, budget_spent: float = 0.0) -> float:
    """The rate of step ``step`` (1-based): a linear warm-up, then the schedule. A function of the step and, under a
    ``budget``, of the share of it spent (``budget_spent``, 0..1): the cosine ends at whichever of the last step and
    the budget's end comes first, so a budgeted run anneals by its end (the step count it will reach is unknown). A
    resume needs no scheduler state: both are in the checkpoint."""
    base, warmup = config.learning_rate, config.warmup_steps
    if step <= warmup:
        return base * step / warmup
    if config.lr_schedule == "inverse_sqrt":
        return base * math.sqrt(max(warmup, 1) / step)
    if config.lr_schedule == "cosine":
        by_steps = (step - warmup) / max(total_steps - warmup, 1) if total_steps else 0.0
        done = max(by_steps, budget_spent)
        return base * 0.5 * (1.0 + math.cos(math.pi * min(done, 1.0)))
    return base


def _clip_global_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Global-norm clipping that also handles sparse gradients (TF ``clip_by_global_norm``)."""
    squares = []
    for p in params:
        if p.grad is None:
            continue
        g = p.grad.coalesce() if p.grad.is_sparse else p.grad
        if g.is_sparse:
            p.grad = g
            squares.append(g._values().float().pow(2).sum())
        else:
            squares.append(g.float().pow(2).sum())
    norm = float(torch.sqrt(torch.stack(squares).sum())) if squares else 0.0
    if norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def _device_and_rank(config: TrainConfig) -> tuple[torch.device, Rank]:
    """This process's device and place among the ranks (its GPU under torchrun, its share of the cores on a CPU)."""
    device = place(config.device).torch_device
    ddp = init_distributed(device)
    threads, why = take_threads()  # a launched CPU rank: its share of the machine's cores (launch.py)
    if ddp.main:
        log.info("torch threads: %d (%s; %d ranks on this machine)", threads, why, ddp.world // ddp.nodes)
    if device.type == "cuda" and device.index is None:  # a bare "cuda" under torchrun: this process's GPU
        device = torch.device("cuda", ddp.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device, ddp


def _distributed(objective: LMObjective, device: torch.device, ddp: Rank) -> nn.Module:
    """The objective wrapped in DDP across processes; itself on one."""
    if ddp.world == 1:
        return objective
    return nn.parallel.DistributedDataParallel(objective, device_ids=[device] if device.type == "cuda" else None)


def setup(config: TrainConfig, tracker: Tracker | None = None, plan: TrainingPlan | None = None) -> Run:
    """Device, DDP, vocab, model, optimizer, sampler, batcher and tracker; resumed from a checkpoint if asked.
    ``plan``: the run's decisions as its stage planned them (``launch.TrainStage``; every rank of a launch gets the
    launcher's), else planned here, as ``elmo train --plan`` prints them."""
    torch.manual_seed(config.seed)
    device, ddp = _device_and_rank(config)
    if plan is None:
        plan = plan_training(config, device, ddp.world)
    config, vocab, precision, recipe_why = plan.config, plan.vocab, plan.precision, plan.recipe_why
    out, data = Path(config.out), Path(config.data)
    n_data_tokens, steps_per_epoch = plan.n_data_tokens, plan.steps_per_epoch
    bilm = _build_model(config, vocab, plan.counts).to(device)
    kernels = bilm.prepare_training()  # what runs the steps, chosen once (elmo_core/bilm/kernels)
    objective = LMObjective(bilm, config.dropout, sparse=False).train()
    config, softmax_why = settle_softmax(config, objective, len(vocab), precision, out, ddp, _make_optimizer)
    objective.sparse = sparse = sparse_softmax(config, len(vocab), ddp)
    model = _distributed(objective, device, ddp)
    params = [p for p in bilm.parameters() if p.requires_grad]
    reasons = {"recipe": recipe_why, "softmax": f"{describe_softmax(config, len(vocab), sparse)} ({softmax_why})"}
    if ddp.main:
        for line in (recipe_why, f"precision {precision} ({precision.why})", kernels, reasons["softmax"]):
            log.info("%s", line)
    run = Run(
        config=config,
        out=out,
        data=data,
        device=device,
        ddp=ddp,
        precision=precision,
        precision_reason=precision.why,
        vocab=vocab,
        unigram_counts=plan.counts,
        bilm=bilm,
        model=model,
        params=params,
        optimizer=_make_optimizer(config, params),
        sampler=LogUniformSampler(len(vocab), seed=config.seed + 1000 * ddp.rank),
        batches=Prefetcher(
            LMBatcher(
                data / "token_ids" / "train",
                config.batch_size,
                config.unroll_steps,
                seed=config.seed,
                rank=ddp.rank,
                world=ddp.world,
            ),
            device,
            depth=config.prefetch,
        ),
        tracker=NullTracker(),
        steps_per_epoch=steps_per_epoch,
        total_steps=plan.total_steps,
        budget=plan.budget(),
        reasons=reasons,
    )
    _resume_and_track(run, tracker, n_data_tokens, sparse)
    return run


def _resume_and_track(run: Run, tracker: Tracker | None, n_data_tokens: int, sparse: bool) -> None:
    """Restore the newest valid checkpoint (``resume``), the best weights so far, and the tracking (rank 0; one
    system-metrics logger per other machine)."""
    config, out, ddp = run.config, run.out, run.ddp
    found = load_newest_valid(out) if config.resume else None
    run_id = None  # the MLflow run a resumed training continues
    if found is not None:
        run_id = restore(run, Checkpoint.from_payload(found[1]))
        log.info("resumed from %s at step %d", found[0], run.step)
    elif config.resume:
        log.info("no checkpoint in %s: starting from scratch", checkpoint_dir(out))
    if ddp.main:
        run.best = BestWeights.resume(out, run.step) if config.export == "best" else None
        _start_tracking(run, tracker, n_data_tokens, sparse, run_id)
    if ddp.nodes > 1 and config.tracking == "mlflow":
        run_id, uri = gather(ddp, (run.tracker.run_id, getattr(run.tracker, "tracking_uri", None)))[0]
        if not ddp.main and ddp.local_rank == 0 and run_id and uri:  # one per other machine, into rank 0's run
            run.node_metrics = NodeSystemMetrics(run_id, uri, f"node{ddp.node}")


def _start_tracking(
    run: Run, tracker: Tracker | None, n_data_tokens: int, sparse: bool, run_id: str | None = None
) -> None:
    """Rank 0: the tracker (MLflow unless ``tracking: none``; a resumed run continues its MLflow run), the run's
    params, and config.json in the run folder."""
    config, out, ddp = run.config, run.out, run.ddp
    out.mkdir(parents=True, exist_ok=True)
    if ddp.nodes > 1:  # each machine's system metrics under system/nodeN/… of the one run
        os.environ.setdefault("MLFLOW_SYSTEM_METRICS_NODE_ID", f"node{ddp.node}")
    run.tracker = tracker or (
        MLflowTracker(
            config.mlflow_experiment,
            run_name=out.name,
            tracking_uri=config.tracking_uri,
            run_id=run_id,
            tags={"elmo.stage": "train", **({"elmo.init_from": config.init_from} if config.init_from else {})},
        )
        if config.tracking == "mlflow"
        else NullTracker()
    )
    run.tracker.log_params(
        {
            "config": config.model_dump(mode="json"),
            "architecture": run.bilm.config.model_dump(mode="json"),
            "data": {
                "vocab_size": len(run.vocab),
                "n_train_tokens": config.n_train_tokens or n_data_tokens,
                "steps_per_epoch": run.steps_per_epoch,
                "world_size": ddp.world,
                "sparse_softmax": sparse,
                "softmax": run.reasons["softmax"],
                "recipe": run.reasons["recipe"],
                "device": str(run.device),
                "precision": run.precision,
                "precision_reason": run.precision_reason,
                "kernels": str(run.bilm.runs.training),
            },
        }
    )
    for split in ("train", "heldout"):  # the data that makes the model, in MLflow's dataset panel (lineage.py)
        if (dataset := split_dataset(run.data, split)) is not None:
            run.tracker.log_dataset(dataset_facts(dataset), split)
    write_text_atomic(out / "config.json", config.model_dump_json(indent=2) + "\n")


# ----- one step ---------------------------------------------------------------------------------------


def train_step(run: Run) -> dict[str, float] | None:
    """Train on one batch: forward, backward, clip, update. Returns its losses, or None if a NaN batch was skipped."""
    config = run.config
    batch = run.batches.next()
    if batch is None:  # cannot happen with loop=True unless the split is empty
        raise InputError(f"{run.data}/token_ids/train: no training batches")
    sampled, num_tries = run.sampler.sample(config.n_negative_samples_batch) if config.sample_softmax else (None, 0)
    with autocast(run.device, run.precision):
        loss, loss_f, loss_b, new_state = run.model(
            batch["tokens_characters"],
            batch["tokens_characters_reverse"],
            batch["next_token_id"],
            batch["next_token_id_reverse"],
            run.state,
            sampled,
            num_tries,
            run.sampler,
        )
    run.optimizer.zero_grad(set_to_none=True)
    run.state = tuple(s.detach() for s in new_state)  # type: ignore[assignment]  # truncated BPTT
    run.step += 1
    if not torch.isfinite(loss):
        if config.on_nan == "stop":
            last = latest_checkpoint(run.out)
            raise TrainingDivergedError(
                f"loss is {float(loss.detach())} at step {run.step}; stopped. The last good checkpoint is "
                f"{last or 'none (none written yet)'}; resume from it with a lower learning rate or on_nan=skip"
            )
        run.skipped += 1
        log.warning("loss is %s at step %d: batch skipped (%d so far)", float(loss.detach()), run.step, run.skipped)
        return None
    (loss * config.unroll_steps).backward()  # bilm-tf: summed over time, averaged over the batch
    grad_norm = _clip_global_norm(run.params, config.all_clip_norm_val)
    if config.lr_schedule != "constant" or config.warmup_steps:
        for group in run.optimizer.param_groups:
            group["lr"] = learning_rate_at(config, run.step, run.total_steps, run.budget_spent)
    run.optimizer.step()
    run.loss = float(loss.detach())
    record = {
        "step": run.step,
        "loss": run.loss,
        "loss_forward": float(loss_f.detach()),
        "loss_backward": float(loss_b.detach()),
        "grad_norm": grad_norm,
    }
    if run.ddp.main:
        with open(run.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps({k: record[k] for k in ("step", "loss", "loss_forward", "loss_backward")}) + "\n")
    return record


def log_metrics(run: Run, record: dict[str, float], tokens_per_s: float) -> None:
    metrics = {
        "loss": record["loss"],
        "perplexity_forward": math.exp(min(record["loss_forward"], 50.0)),
        "perplexity_backward": math.exp(min(record["loss_backward"], 50.0)),
        "tokens_per_s": tokens_per_s,
        "learning_rate": run.optimizer.param_groups[0]["lr"],
        "grad_norm": record["grad_norm"],
    }
    run.tracker.log_metrics(metrics, run.step)
    run.history.append({"step": run.step, **metrics})


def _heldout(run: Run) -> Path | None:
    """The heldout split rank 0 evaluates on; None on other ranks and without one."""
    heldout = run.data / "token_ids" / "heldout"
    if not run.ddp.main or not heldout.exists() or not any(num_rows(f) for f in heldout.glob("part-*.parquet")):
        return None
    return heldout


def evaluate_heldout(run: Run) -> dict[str, float]:
    """Heldout perplexity (rank 0), logged as ``heldout_*`` metrics; {} without a heldout split."""
    heldout = _heldout(run)
    if heldout is None:
        return {}
    config = run.config
    result = evaluate(
        run.bilm,
        heldout,
        batch_size=config.eval_batch_size,
        unroll_steps=config.unroll_steps,
        max_batches=config.eval_max_batches,
        unigram_counts=run.unigram_counts,
    )
    run.tracker.log_metrics({f"heldout_{k}": v for k, v in result.items()}, run.step)
    run.heldout = result
    log.info("step %d %s", run.step, describe_perplexity(result))
    return result


PROBE_MARGIN = 1.25  # a probe's ten windows come from the split's start: a full pass ran up to a fifth slower here


def probe_evaluation(run: Run) -> None:
    """Under a budget (rank 0): the final evaluation's cost, known before the first step so that the budget holds it
    back from the start (``Budget.measure``; each full evaluation's own time replaces it): two heldout windows timed,
    then ten, their difference the pace of a window once warm."""
    heldout = _heldout(run)
    if run.budget.seconds is None or heldout is None:
        return
    config = run.config
    windows = heldout_windows(heldout, config.eval_batch_size, config.unroll_steps, config.eval_max_batches)
    seconds = []
    for probe in (2, 10):
        with run.budget.measure("evaluation"):
            evaluate(
                run.bilm,
                heldout,
                batch_size=config.eval_batch_size,
                unroll_steps=config.unroll_steps,
                max_batches=probe,
            )
        seconds.append(run.budget.costs["evaluation"])
    per_window = max(seconds[1] - seconds[0], 0.0) / 8
    run.budget.costs["evaluation"] = PROBE_MARGIN * (seconds[0] + per_window * max(windows - 2, 0))
    line = f"the final evaluation will take about {run.budget.costs['evaluation']:.1f} s ({windows} windows)"
    if run.budget.costs["evaluation"] > 0.5 * run.budget.seconds:
        line += ": over half the budget; a smaller heldout split (or a larger budget) leaves the training more"
    log.info("%s; the budget holds it back", line)


def keep_if_best(run: Run, result: dict[str, float]) -> None:
    """``export: best``: write the weights if this heldout result is the lowest so far (rank 0)."""
    if run.best is None or not run.ddp.main:
        return
    if run.best.offer(run.step, result, lambda: {k: v.detach().cpu() for k, v in run.bilm.state_dict().items()}):
        run.tracker.log_metrics({"best_heldout_perplexity": result["perplexity"]}, run.step)


def _exported(run: Run, final: dict[str, float]) -> tuple[int, dict[str, float]]:
    """Rank 0: the step whose weights are exported and their heldout result; with ``export: best`` the best
    weights (the final evaluation included) are loaded into the model where they are not the final ones."""
    keep_if_best(run, final)
    best = run.best
    if best is None or best.step is None or best.result is None or best.step == run.step:
        return run.step, final
    weights = best.weights()
    if weights is None:
        log.warning("the best weights (step %d) are gone from %s; exporting the final ones", best.step, run.out)
        return run.step, final
    run.bilm.load_state_dict(weights)  # after the final checkpoint: resuming is unaffected
    log.info(
        "exporting the weights of step %d: heldout perplexity %.2f, the lowest of the run (final step %d: %.2f)",
        best.step,
        best.result["perplexity"],
        run.step,
        final["perplexity"],
    )
    return best.step, best.result


def finish(run: Run) -> TrainResult:
    """Final checkpoint, replica check, heldout perplexity, export to OUT/model (the final weights, or the best
    with ``export: best``), MLflow artifacts and registry."""
    final = save(run)
    if run.ddp.world > 1:
        check_replicas_agree(run.bilm, run.ddp, run.out)
    perplexity = evaluate_heldout(run)
    if run.budget.seconds is not None and run.ddp.main:
        log.info("the training's part of the budget ends at %.1f s; exporting", run.budget.spent())
    model_dir, model_uri, exported_step = run.out / "model", None, run.step
    if run.ddp.main:
        exported_step, perplexity = _exported(run, perplexity)
        run.tracker.log_metrics({"exported_step": exported_step}, run.step)
        run.bilm.token_encoder = getattr(run.bilm.token_encoder, "_orig_mod", run.bilm.token_encoder)  # undo compile
        run.bilm.save_pretrained(str(model_dir))  # replaces the folder whole (written beside it, then renamed)
        if run.config.tracking == "mlflow":
            write_beside(run.bilm, model_dir)  # OUT/model.onnx, which the MLflow model carries too
        exported = {**perplexity, "step": exported_step} if perplexity else {}
        write_text_atomic(run.out / "perplexity.json", json.dumps(exported, indent=2) + "\n")
        run.tracker.log_artifact(run.out / "config.json")
        run.tracker.log_artifact(model_dir, "export")
        if final is not None:
            run.tracker.log_artifact(final, "checkpoint")
        model_uri = run.tracker.log_model_dir(model_dir, run.config.register_as)
    return TrainResult(
        steps=run.step,
        final_loss=run.loss,
        perplexity=perplexity,
        model_dir=model_dir,
        run_id=run.tracker.run_id,
        model_uri=model_uri,
        history=run.history,
        exported_step=exported_step,
    )


# ----- the loop ---------------------------------------------------------------------------------------


LOCK_NAME = ".train.lock"  # in the run folder: one training writes it at a time (rank 0 holds it)


def train(config: TrainConfig, tracker: Tracker | None = None, plan: TrainingPlan | None = None) -> TrainResult:
    """Run (or resume) a training, as ``plan`` decided it where one is given (``setup``); returns the final
    perplexity and where the exported model is."""
    began = {clock: now(clock) for clock in ("wall", "cpu")}  # a budget counts the job's time from here
    lock = None
    if this_process().main:  # under torchrun only rank 0 writes the folder and logs
        if config.tracking == "mlflow" and tracker is None:
            check_reachable(config.tracking_uri)  # in seconds, before any work
        lock = FolderLock(Path(config.out) / LOCK_NAME, config.out, wait=config.wait).acquire()
    try:
        return _train(config, tracker, plan, began)
    finally:
        if lock is not None:
            lock.release()


def _budget_spent(run: Run) -> bool:
    """Whether the budget is spent; keeps ``run.budget_spent``, the share spent that the schedule reads, the same on
    every rank (the largest), so every rank steps with the same rate and stops at the same step."""
    if run.budget.seconds is None:
        return False
    run.budget_spent = agreed_max(run.ddp, run.device, run.budget.share_spent())
    return run.budget.exhausted(run.budget_spent)


def _train(
    config: TrainConfig, tracker: Tracker | None, plan: TrainingPlan | None, began: dict[str, float]
) -> TrainResult:
    run = setup(config, tracker, plan)
    status = "FAILED"
    stop = StopRequest()
    try:
        if run.ddp.main and config.budget is not None:
            log.info("%s", run.budget.line(torch.get_num_threads(), table_measured()))
        run.budget.start(began[run.budget.clock])
        probe_evaluation(run)
        total, unit, done = _progress_of(run)
        with track("train", total, unit, done=done()) as progress:
            rate = TokenRate(run.tokens_per_step)
            while _steps_left(run) and not _budget_spent(run):
                record = train_step(run)
                if record is not None:
                    rate.count()
                    progress.update(done(), f"step {run.step:,}, loss {run.loss:.3f}, {rate.rate():,.0f} tok/s")
                    if run.ddp.main and (run.step % config.log_every == 0 or run.step == run.total_steps):
                        log_metrics(run, record, rate.rate(reset=True))
                if run.step % run.steps_per_epoch == 0 and _steps_left(run) and run.budget.allows_evaluation():
                    with run.budget.measure("evaluation", between_epochs=True):
                        keep_if_best(run, evaluate_heldout(run))
                if run.step % config.checkpoint_every == 0 and _steps_left(run):
                    with run.budget.measure("checkpoint"):
                        save(run)
                if stop.agreed(run.ddp, run.device):
                    path = save(run)
                    raise TrainingStopped(f"stopped at step {run.step} on request; checkpoint {path}; rerun to resume")
        if _steps_left(run) and run.ddp.main:
            log.info(
                "budget spent (%.2f s of %s time) at step %d: evaluating and exporting",
                run.budget.spent(),
                run.budget.clock,
                run.step,
            )
        result = finish(run)
        if run.ddp.world > 1:
            dist.barrier()  # every rank leaves together: none tears its process group down under another's export
        status = "FINISHED"
        return result
    except (KeyboardInterrupt, TrainingStopped):
        status = "KILLED"
        raise
    finally:
        stop.restore()
        run.batches.close()
        run.tracker.close(status)
        if run.node_metrics is not None:
            run.node_metrics.close()
        if run.ddp.world > 1 and dist.is_initialized():
            run.model = getattr(run.model, "module", run.model)  # DDP's reducer goes before the group it uses
            dist.destroy_process_group()


def _steps_left(run: Run) -> bool:
    return run.total_steps is None or run.step < run.total_steps


def _progress_of(run: Run) -> tuple[float | None, str, Callable[[], float]]:
    """What the progress bar counts: steps, or, where the budget alone ends the run, the budget's seconds spent."""
    if run.total_steps is None:
        return run.budget.seconds, f"s of the {run.budget.clock} budget", run.budget.spent
    return run.total_steps, "steps", lambda: float(run.step)
