"""Train (or fine-tune) the biLM as bilm-tf does, with exact resume, MLflow tracking and DDP.

    batches (batches.py) ─► char CNN + highway + projection (shared) ─► forward / backward LSTM stacks
        ─► dropout ─► one shared softmax: sampled (training) or full (evaluation)

* State is carried per row between windows; gradients stop at the window boundary (truncated BPTT).
* The gradient is taken of ``loss × unroll_steps`` and clipped to a global norm, then Adagrad (lr 0.2, initial
  accumulator 1.0) steps: bilm-tf's recipe. AdamW is an option.
* A checkpoint holds the model (softmax included), optimizer, RNG states, the sampler, every rank's batcher
  position and carried LSTM state, and the step; it is written atomically and read with
  ``torch.load(weights_only=True)``. ``resume=True`` continues from the newest one exactly.
* Under ``torchrun`` each rank reads disjoint sentences; rank 0 logs and saves.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from elmo_core.batches import LMBatcher
from elmo_core.config import ModelConfig, load_config_file, preset
from elmo_core.errors import ConfigError, ElmoError
from elmo_core.model import BiLM, LstmState, init_bilm_tf
from elmo_core.softmax import LogUniformSampler, full_softmax_loss, sampled_softmax_loss
from elmo_core.tracking import MLflowTracker, NullTracker, Tracker, resolve_model_dir
from elmo_core.vocab import VOCAB_NAME_IN_DATA, check_training_vocab, read_vocab_file

log = logging.getLogger(__name__)


class TrainConfig(BaseModel):
    """Everything ``elmo train`` needs; bilm-tf's option names where it has one. Loadable from YAML/JSON."""

    model_config = ConfigDict(extra="forbid")

    data: str = Field(description="folder written by `elmo vocab` (vocab.txt, token_ids/train, token_ids/heldout)")
    out: str = Field(description="run folder: checkpoints/, model/ (the export), metrics.jsonl")
    preset: Literal["tiny", "small", "medium", "original"] = Field("tiny", description="published ELMo size")
    model: ModelConfig | None = Field(None, description="explicit architecture; overrides the preset")
    init_from: str | None = Field(None, description="fine-tune: a model directory or runs:/ or models:/ URI")
    batch_size: int = Field(128, gt=0, description="rows per step (per process); bilm-tf used 128 per GPU")
    unroll_steps: int = Field(20, gt=0, description="truncated-BPTT window")
    n_epochs: float = Field(10.0, gt=0)
    max_steps: int | None = Field(None, gt=0, description="stop after this many steps (overrides epochs)")
    n_train_tokens: int | None = Field(None, gt=0, description="fixes steps per epoch; default: counted")
    n_negative_samples_batch: int = Field(8192, gt=0)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    optimizer: Literal["adagrad", "adamw"] = "adagrad"
    learning_rate: float = Field(0.2, gt=0.0, description="0.2 for Adagrad (bilm-tf); ~1e-3 for AdamW")
    initial_accumulator_value: float = Field(1.0, ge=0.0)
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW only")
    all_clip_norm_val: float = Field(10.0, gt=0.0, description="global gradient-norm clip")
    sparse_softmax: bool | None = Field(None, description="sparse softmax gradients; default: large vocab, Adagrad, one process")
    seed: int = 0
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N")
    bf16: bool = Field(True, description="bf16 autocast on CUDA (ignored on CPU)")
    compile: bool = Field(False, description="torch.compile the token encoder")
    log_every: int = Field(10, gt=0)
    checkpoint_every: int = Field(1250, gt=0)
    keep_checkpoints: int = Field(2, gt=0)
    eval_batch_size: int = Field(64, gt=0)
    eval_max_batches: int | None = Field(None, gt=0)
    on_nan: Literal["stop", "skip"] = "stop"
    resume: bool = Field(False, description="continue from the newest checkpoint in out/")
    tracking: Literal["mlflow", "none"] = "mlflow"
    mlflow_experiment: str = "elmo"
    tracking_uri: str | None = None
    register_as: str | None = Field("elmo", description="MLflow registered-model name; null: log only")

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> "TrainConfig":
        data = load_config_file(path)
        data.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.model_validate(data)
        except Exception as exc:  # pydantic's message names the field
            raise ConfigError(f"{path}: {exc}") from None

    def architecture(self, n_tokens_vocab: int) -> ModelConfig:
        base = self.model or preset(self.preset)
        return base.model_copy(update={"n_tokens_vocab": n_tokens_vocab})


class TrainingDivergedError(ElmoError):
    """The loss became NaN or infinite."""


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    perplexity: dict[str, float]
    model_dir: Path
    run_id: str | None = None
    model_uri: str | None = None
    history: list[dict[str, float]] = field(default_factory=list)


# ----- the model under training ---------------------------------------------------------------------


class LMObjective(nn.Module):
    """The biLM plus its training loss, one module so DDP can wrap it."""

    def __init__(self, bilm: BiLM, dropout: float, sparse: bool) -> None:
        super().__init__()
        if bilm.softmax is None:
            raise ConfigError("training needs a softmax: the model config must set n_tokens_vocab")
        self.bilm, self.dropout, self.sparse = bilm, dropout, sparse

    def hidden(self, chars_f: Tensor, chars_b: Tensor, state: LstmState | None) -> tuple[Tensor, Tensor, LstmState]:
        """Raw char ids (B, T, C) of both streams ─► top-layer outputs (B, T, P) each, and the new state."""
        x_f = self.bilm.embed_chars(chars_f + 1)  # the model reads the +1 inference scheme
        x_b = self.bilm.embed_chars(chars_b + 1)
        lengths = torch.full((chars_f.shape[0],), chars_f.shape[1], dtype=torch.long)
        outputs, new_state = self.bilm.lstm((x_f, x_b), lengths, state, dropout=self.dropout)
        top_f, top_b = outputs[-1]
        if self.training and self.dropout > 0:
            top_f = nn.functional.dropout(top_f, self.dropout)
            top_b = nn.functional.dropout(top_b, self.dropout)
        return top_f, top_b, new_state

    def forward(self, chars_f: Tensor, chars_b: Tensor, targets_f: Tensor, targets_b: Tensor, state: LstmState | None,
                sampled: Tensor, num_tries: int, sampler: LogUniformSampler) -> tuple[Tensor, Tensor, Tensor, LstmState]:
        top_f, top_b, new_state = self.hidden(chars_f, chars_b, state)
        softmax = self.bilm.softmax
        p = top_f.shape[-1]
        loss_f = sampled_softmax_loss(top_f.reshape(-1, p), targets_f.reshape(-1), softmax.weight, softmax.bias, sampled, num_tries, sampler, self.sparse)
        loss_b = sampled_softmax_loss(top_b.reshape(-1, p), targets_b.reshape(-1), softmax.weight, softmax.bias, sampled, num_tries, sampler, self.sparse)
        return 0.5 * (loss_f + loss_b), loss_f, loss_b, new_state


# ----- evaluation -------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(bilm: BiLM, token_id_dir: str | Path, batch_size: int = 64, unroll_steps: int = 20,
             max_batches: int | None = None, unigram_counts: np.ndarray | None = None) -> dict[str, float]:
    """Heldout perplexity with the full softmax, state carried across windows (bilm-tf ``run_test``).

    With the state carried, predictions do not depend on the window length, so windows of 20 give the numbers
    bilm-tf's unroll-1 evaluation gives. Returns forward, backward and average perplexity (exp of the mean
    loss) and, given train counts, the add-one unigram baseline on the same forward targets.
    """
    was_training = bilm.training
    bilm.eval()
    objective = LMObjective(bilm, 0.0, False)
    device = bilm.device
    n_sentences = sum(_num_rows(f) for f in Path(token_id_dir).glob("part-*.parquet"))
    if n_sentences == 0:
        raise ConfigError(f"{token_id_dir}: no heldout sentences to evaluate on")
    rows = max(1, min(batch_size, n_sentences // 4))
    batcher = LMBatcher(token_id_dir, rows, unroll_steps, shuffle=False, loop=False)
    total_f = total_b = 0.0
    unigram = 0.0
    tokens = batches = 0
    state = None
    log_p = None
    if unigram_counts is not None:
        log_p = np.log((unigram_counts + 1.0) / (unigram_counts.sum() + len(unigram_counts)))
    for batch in batcher:
        top_f, top_b, state = objective.hidden(_tensor(batch["tokens_characters"], device), _tensor(batch["tokens_characters_reverse"], device), state)
        p = top_f.shape[-1]
        softmax = bilm.softmax
        total_f += float(full_softmax_loss(top_f.reshape(-1, p), _tensor(batch["next_token_id"], device).reshape(-1), softmax.weight, softmax.bias))
        total_b += float(full_softmax_loss(top_b.reshape(-1, p), _tensor(batch["next_token_id_reverse"], device).reshape(-1), softmax.weight, softmax.bias))
        if log_p is not None:
            unigram += float(-log_p[batch["next_token_id"]].mean())
        batches += 1
        tokens += batch["next_token_id"].size
        if max_batches and batches >= max_batches:
            break
    bilm.train(was_training)
    if batches == 0:
        raise ConfigError(f"{token_id_dir}: too little heldout text for one {rows}x{unroll_steps} window")
    result = {
        "perplexity_forward": math.exp(total_f / batches),
        "perplexity_backward": math.exp(total_b / batches),
        "perplexity": math.exp(0.5 * (total_f + total_b) / batches),
        "eval_tokens": float(tokens),
    }
    if log_p is not None:
        result["perplexity_unigram"] = math.exp(unigram / batches)
    return result


def _num_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


def train_token_counts(data: Path, n_vocab: int) -> tuple[np.ndarray, int]:
    """Counts of every vocab id as a forward target in the train split (</S> once per sentence), and tokens."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    counts = np.zeros(n_vocab, dtype=np.float64)
    tokens = 0
    for path in sorted((data / "token_ids" / "train").glob("part-*.parquet")):
        ids = pq.read_table(path, columns=["ids"]).column("ids").combine_chunks()
        flat = pc.list_flatten(ids).to_numpy(zero_copy_only=False)
        counts += np.bincount(flat, minlength=n_vocab)[:n_vocab]
        counts[1] += len(ids)
        tokens += len(flat)
    return counts, tokens


def _tensor(array: np.ndarray, device: torch.device) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).long().to(device, non_blocking=True)


# ----- checkpoints ------------------------------------------------------------------------------------


def checkpoint_dir(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def latest_checkpoint(out: str | Path) -> Path | None:
    found = sorted(checkpoint_dir(out).glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    return found[-1] if found else None


def export_checkpoint(checkpoint_or_run: str | Path, out: str | Path) -> tuple[int, Path]:
    """A checkpoint (or a run folder's newest) ─► a bilm-tf/AllenNLP model directory; returns (step, checkpoint)."""
    source = Path(checkpoint_or_run)
    checkpoint = latest_checkpoint(source) if source.is_dir() else source
    if checkpoint is None or not checkpoint.exists():
        raise ConfigError(f"{source}: no checkpoint found")
    payload = torch.load(checkpoint, map_location="cpu", weights_only=True)
    config = TrainConfig.model_validate_json(payload["config"])
    vocab = read_vocab_file(Path(config.data) / VOCAB_NAME_IN_DATA)
    bilm = BiLM(config.architecture(payload["model"]["softmax.weight"].shape[0]), vocab=vocab)
    bilm.load_state_dict(payload["model"])
    bilm.save_pretrained(str(out))
    return int(payload["step"]), checkpoint


def _save_checkpoint(out: Path, step: int, payload: dict[str, Any], keep: int) -> Path:
    directory = checkpoint_dir(out)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step-{step:09d}.pt"
    tmp = path.with_suffix(".pt.tmp")
    torch.save(payload, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for old in sorted(directory.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))[:-keep]:
        old.unlink()
    return path


# ----- distributed ------------------------------------------------------------------------------------


@dataclass
class _Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def _init_distributed(device: torch.device) -> _Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return _Dist()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return _Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        log.warning("CUDA is not available; training on the CPU")
        return torch.device("cpu")
    return device


# ----- the training loop -------------------------------------------------------------------------------


def _build_model(config: TrainConfig, vocab: list[str]) -> BiLM:
    if config.init_from is None:
        bilm = BiLM(config.architecture(len(vocab)), vocab=vocab)
        init_bilm_tf(bilm)
        return bilm
    model_dir = resolve_model_dir(config.init_from)
    bilm = BiLM.from_pretrained(str(model_dir))
    if bilm.vocab is not None and bilm.vocab != vocab:
        raise ConfigError(f"{model_dir}/vocab.txt differs from {config.data}/vocab.txt; build the data with "
                          f"`elmo vocab --vocab-file {model_dir}/vocab.txt` so fine-tuning keeps the model's vocabulary")
    if bilm.softmax is None or bilm.config.n_tokens_vocab != len(vocab):
        log.warning("%s has no softmax for this %d-word vocabulary: initialising a new one (bilm-tf's N(0, 1/sqrt(P)))",
                    model_dir, len(vocab))
        fresh = BiLM(bilm.config.model_copy(update={"n_tokens_vocab": len(vocab)}), vocab=vocab)
        missing = fresh.load_state_dict({k: v for k, v in bilm.state_dict().items() if not k.startswith("softmax.")}, strict=False)
        assert all(k.startswith("softmax.") for k in missing.missing_keys)
        p = fresh.config.lstm.projection_dim
        with torch.no_grad():
            nn.init.normal_(fresh.softmax.weight, 0.0, 1.0 / math.sqrt(p))
            fresh.softmax.bias.zero_()
        bilm = fresh
    bilm.vocab = vocab
    return bilm


def _make_optimizer(config: TrainConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if config.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=config.learning_rate, initial_accumulator_value=config.initial_accumulator_value)
    return torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)


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


def train(config: TrainConfig, tracker: Tracker | None = None) -> TrainResult:
    """Run (or resume) a training; returns the final perplexity and where the exported model is."""
    torch.manual_seed(config.seed)
    device = _pick_device(config.device)
    ddp = _init_distributed(device)
    if device.type == "cuda":
        device = torch.device("cuda", ddp.local_rank if config.device in ("auto", "cuda") else device.index or 0)
        torch.cuda.set_device(device)
    out = Path(config.out)
    data = Path(config.data)
    vocab_path = data / VOCAB_NAME_IN_DATA
    vocab = read_vocab_file(vocab_path)
    check_training_vocab(vocab, str(vocab_path))
    counts, n_data_tokens = train_token_counts(data, len(vocab))
    n_train_tokens = config.n_train_tokens or n_data_tokens
    steps_per_epoch = max(1, n_train_tokens // (config.batch_size * config.unroll_steps * ddp.world))
    total_steps = config.max_steps or max(1, int(config.n_epochs * steps_per_epoch))

    bilm = _build_model(config, vocab).to(device)
    if config.compile:
        bilm.token_encoder = torch.compile(bilm.token_encoder)  # type: ignore[assignment]
    sparse = config.sparse_softmax if config.sparse_softmax is not None else (
        len(vocab) > 50_000 and config.optimizer == "adagrad" and ddp.world == 1)
    if sparse and (config.optimizer != "adagrad" or ddp.world > 1):
        raise ConfigError("sparse_softmax needs the Adagrad optimizer and a single process")
    objective = LMObjective(bilm, config.dropout, sparse).train()
    model: nn.Module = objective
    if ddp.world > 1:
        model = nn.parallel.DistributedDataParallel(objective, device_ids=[device] if device.type == "cuda" else None)
    params = [p for p in bilm.parameters() if p.requires_grad]
    optimizer = _make_optimizer(config, params)
    sampler = LogUniformSampler(len(vocab), seed=config.seed + 1000 * ddp.rank)
    batcher = LMBatcher(data / "token_ids" / "train", config.batch_size, config.unroll_steps, seed=config.seed, rank=ddp.rank, world=ddp.world)
    state: LstmState | None = None
    step = 0
    run_id = None

    checkpoint = latest_checkpoint(out) if config.resume else None
    if checkpoint is not None:
        payload = torch.load(checkpoint, map_location="cpu", weights_only=True)
        bilm.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
        sampler = LogUniformSampler(len(vocab), seed=0)
        sampler.load_state_dict(payload["samplers"][ddp.rank])
        batcher.load_state_dict(json.loads(payload["batchers"][ddp.rank]))
        torch.set_rng_state(payload["torch_rng"][ddp.rank])
        if device.type == "cuda" and payload.get("cuda_rng"):
            torch.cuda.set_rng_state(payload["cuda_rng"][ddp.rank], device)
        state = tuple(s.to(device) for s in payload["lstm_states"][ddp.rank])  # type: ignore[assignment]
        step = int(payload["step"])
        run_id = payload.get("run_id") or None
        log.info("resumed from %s at step %d", checkpoint, step)
    elif config.resume:
        log.info("no checkpoint in %s: starting from scratch", checkpoint_dir(out))
    if ddp.main:
        out.mkdir(parents=True, exist_ok=True)
        if tracker is None:
            tracker = (MLflowTracker(config.mlflow_experiment, run_name=out.name, tracking_uri=config.tracking_uri, run_id=run_id,
                                     tags={"elmo.stage": "train"})
                       if config.tracking == "mlflow" else NullTracker())
        tracker.log_params({"config": config.model_dump(mode="json"), "architecture": bilm.config.model_dump(mode="json"),
                            "data": {"vocab_size": len(vocab), "n_train_tokens": n_train_tokens, "steps_per_epoch": steps_per_epoch,
                                     "world_size": ddp.world, "sparse_softmax": sparse, "device": str(device)}})
        (out / "config.json").write_text(config.model_dump_json(indent=2) + "\n")
    else:
        tracker = NullTracker()

    use_bf16 = config.bf16 and device.type == "cuda"
    metrics_file = out / "metrics.jsonl"
    history: list[dict[str, float]] = []
    last_loss = float("nan")
    tokens_per_step = config.batch_size * config.unroll_steps * ddp.world
    window_start, window_tokens = time.perf_counter(), 0
    started = time.perf_counter()
    skipped = 0

    def save(step: int) -> Path | None:
        gathered = _gather(ddp, {
            "sampler": sampler.state_dict(), "batcher": json.dumps(batcher.state_dict()),
            "torch_rng": torch.get_rng_state(), "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "lstm_state": tuple(s.detach().cpu() for s in state) if state is not None else None,
        })
        if not ddp.main:
            return None
        payload = {
            "model": {k: v.detach().cpu() for k, v in bilm.state_dict().items()},
            "optimizer": optimizer.state_dict(),
            "samplers": [g["sampler"] for g in gathered],
            "batchers": [g["batcher"] for g in gathered],
            "torch_rng": [g["torch_rng"] for g in gathered],
            "cuda_rng": [g["cuda_rng"] for g in gathered] if device.type == "cuda" else [],
            "lstm_states": [g["lstm_state"] if g["lstm_state"] is not None else tuple(bilm.lstm.zero_state(config.batch_size, torch.device("cpu")))
                            for g in gathered],
            "step": step,
            "run_id": tracker.run_id or "",
            "config": config.model_dump_json(),
        }
        return _save_checkpoint(out, step, payload, config.keep_checkpoints)

    status = "FAILED"
    try:
        while step < total_steps:
            batch = batcher.next_batch()
            if batch is None:  # cannot happen with loop=True unless the split is empty
                raise ConfigError(f"{data}/token_ids/train: no training batches")
            sampled, num_tries = sampler.sample(config.n_negative_samples_batch)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_bf16):
                loss, loss_f, loss_b, new_state = model(
                    _tensor(batch["tokens_characters"], device), _tensor(batch["tokens_characters_reverse"], device),
                    _tensor(batch["next_token_id"], device), _tensor(batch["next_token_id_reverse"], device),
                    state, sampled, num_tries, sampler)
            if not torch.isfinite(loss):
                if config.on_nan == "stop":
                    last = latest_checkpoint(out)
                    raise TrainingDivergedError(f"loss is {float(loss.detach())} at step {step + 1}; stopped. The last good checkpoint is "
                                                f"{last or 'none (none written yet)'}; resume from it with a lower learning rate or on_nan=skip")
                skipped += 1
                log.warning("loss is %s at step %d: batch skipped (%d so far)", float(loss.detach()), step + 1, skipped)
                optimizer.zero_grad(set_to_none=True)
                state = tuple(s.detach() for s in new_state)  # type: ignore[assignment]
                step += 1
                continue
            optimizer.zero_grad(set_to_none=True)
            (loss * config.unroll_steps).backward()  # bilm-tf: summed over time, averaged over the batch
            grad_norm = _clip_global_norm(params, config.all_clip_norm_val)
            optimizer.step()
            state = tuple(s.detach() for s in new_state)  # type: ignore[assignment]  # truncated BPTT
            step += 1
            last_loss = float(loss.detach())
            window_tokens += tokens_per_step
            loss_f, loss_b = float(loss_f.detach()), float(loss_b.detach())
            record = {"step": step, "loss": last_loss, "loss_forward": loss_f, "loss_backward": loss_b}
            if ddp.main:
                with open(metrics_file, "a") as f:
                    f.write(json.dumps(record) + "\n")
            if ddp.main and (step % config.log_every == 0 or step == total_steps):
                elapsed = time.perf_counter() - window_start
                tps = window_tokens / max(elapsed, 1e-9)
                metrics = {"loss": last_loss, "perplexity_forward": math.exp(min(loss_f, 50.0)),
                           "perplexity_backward": math.exp(min(loss_b, 50.0)), "tokens_per_s": tps,
                           "learning_rate": optimizer.param_groups[0]["lr"], "grad_norm": grad_norm}
                tracker.log_metrics(metrics, step)
                history.append({"step": step, **metrics})
                eta = (total_steps - step) * tokens_per_step / max(tps, 1e-9)
                _progress(step, total_steps, last_loss, tps, eta)
                window_start, window_tokens = time.perf_counter(), 0
            if step % steps_per_epoch == 0 and step < total_steps and (data / "token_ids" / "heldout").exists():
                _log_eval(bilm, data, config, counts, tracker, step, ddp)
            if step % config.checkpoint_every == 0 and step < total_steps:
                path = save(step)
                if path is not None:
                    log.info("checkpoint %s", path)
        final = save(step)
        if ddp.world > 1:
            _check_replicas_agree(bilm, ddp, out)
        perplexity = _log_eval(bilm, data, config, counts, tracker, step, ddp)
        model_dir = out / "model"
        model_uri = None
        if ddp.main:
            bilm_for_export = bilm
            if config.compile:
                bilm_for_export.token_encoder = getattr(bilm.token_encoder, "_orig_mod", bilm.token_encoder)
            if model_dir.exists():
                shutil.rmtree(model_dir)
            bilm_for_export.save_pretrained(str(model_dir))
            (out / "perplexity.json").write_text(json.dumps(perplexity, indent=2) + "\n")
            tracker.log_artifact(out / "config.json")
            tracker.log_artifact(model_dir, "export")
            if final is not None:
                tracker.log_artifact(final, "checkpoint")
            model_uri = tracker.log_model_dir(model_dir, config.register_as)
            seconds = time.perf_counter() - started
            sys.stderr.write("\n")
            log.info("train: %d steps, loss %.3f, %s in %.0f s -> %s", step, last_loss, describe_perplexity(perplexity), seconds, model_dir)
        status = "FINISHED"
        return TrainResult(step, last_loss, perplexity, model_dir, tracker.run_id, model_uri, history)
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        tracker.close(status)
        if ddp.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _check_replicas_agree(bilm: BiLM, ddp: _Dist, out: Path) -> None:
    """Every rank hashes its weights; rank 0 writes them to out/ddp_weights.json and fails if they differ."""
    digest = hashlib.sha256()
    for name, tensor in sorted(bilm.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    digests = [g["sha256"] for g in _gather(ddp, {"sha256": digest.hexdigest()})]
    if ddp.main:
        (out / "ddp_weights.json").write_text(json.dumps(digests) + "\n")
        if len(set(digests)) != 1:
            raise ElmoError(f"DDP replicas diverged: weight digests {digests}")


def _gather(ddp: _Dist, item: dict[str, Any]) -> list[dict[str, Any]]:
    if ddp.world == 1:
        return [item]
    gathered: list[Any] = [None] * ddp.world
    dist.all_gather_object(gathered, item)
    return gathered


def _log_eval(bilm: BiLM, data: Path, config: TrainConfig, counts: np.ndarray, tracker: Tracker, step: int, ddp: _Dist) -> dict[str, float]:
    heldout = data / "token_ids" / "heldout"
    if not ddp.main or not heldout.exists() or not any(_num_rows(f) for f in heldout.glob("part-*.parquet")):
        return {}
    result = evaluate(bilm, heldout, config.eval_batch_size, config.unroll_steps, config.eval_max_batches, counts)
    tracker.log_metrics({f"heldout_{k}": v for k, v in result.items()}, step)
    log.info("step %d heldout perplexity %.2f (forward %.2f, backward %.2f; unigram %.2f)", step, result["perplexity"],
             result["perplexity_forward"], result["perplexity_backward"], result.get("perplexity_unigram", float("nan")))
    return result


def describe_perplexity(result: dict[str, float]) -> str:
    if not result:
        return "no heldout split to evaluate"
    text = (f"heldout perplexity {result['perplexity']:.2f} (forward {result['perplexity_forward']:.2f}, "
            f"backward {result['perplexity_backward']:.2f}")
    if "perplexity_unigram" in result:
        text += f"; unigram baseline {result['perplexity_unigram']:.2f}"
    return text + ")"


def _progress(step: int, total: int, loss: float, tps: float, eta: float) -> None:
    width = 30
    done = int(width * step / total)
    line = f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} loss {loss:.3f} {tps:,.0f} tok/s ETA {eta / 60:.1f} min"
    if sys.stderr.isatty():
        sys.stderr.write(line)
        sys.stderr.flush()
    else:
        log.info(line.strip())
