"""Training checkpoints: written atomically with their SHA-256, verified before any use.

    OUT/checkpoints/step-000001250.pt          the payload (``torch.save``; loads with ``weights_only=True``)
    OUT/checkpoints/step-000001250.pt.sha256   its digest, in ``sha256sum`` format (``sha256sum -c`` checks it)
    OUT/checkpoints/best-000000800.pt (+ .sha256)   ``export: best``: the weights of the lowest heldout perplexity yet

The digest file is written first and the checkpoint renamed into place after it, so a checkpoint that exists is
complete and has its digest. Resume and export take the newest checkpoint whose bytes still match and that
loads; a damaged one (truncated, zeroed, replaced) is named in one warning and the one before it is used.

Before a write the folder must have room for it (and, until ``keep`` checkpoints exist, for the rest of them); a
write refused or failed for lack of space stops the run in one line naming the last verified checkpoint, which a
rerun resumes from.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from elmo_core.errors import CheckpointError, NoSpaceError, disk_full
from elmo_core.fileio import (
    atomic_path,
    disk_full_error,
    file_sha256,
    free_bytes,
    require_space,
    write_text_atomic,
)

log = logging.getLogger(__name__)

PATTERN = "step-*.pt"
BEST_PATTERN = "best-*.pt"
# what files written before a checkpoint kept one record per rank held instead: parallel lists, by rank
PER_RANK_LISTS = {"samplers": "sampler", "batchers": "batcher", "torch_rng": "torch_rng", "lstm_states": "lstm_state"}


@dataclass
class RankState:
    """What differs between DDP ranks: each reads its own sentences and samples its own negatives."""

    sampler: dict[str, Tensor]
    batcher: str  # the batcher's position as JSON
    torch_rng: Tensor
    cuda_rng: Tensor | None  # None on the CPU
    lstm_state: tuple[Tensor, Tensor]


@dataclass
class Checkpoint:
    """The keys of a checkpoint file (``torch.save`` of these fields): the model and optimizer, and one record per
    rank of what differs between ranks."""

    step: int
    config: str  # the TrainConfig as JSON
    run_id: str  # the MLflow run a resume continues ("" without tracking)
    model: dict[str, Tensor]  # the BiLM's state dict, softmax included
    optimizer: dict[str, Any]
    ranks: list[RankState]
    spent_seconds: float = 0.0  # of the run's time budget, on its clock (``budget.py``); 0 in older checkpoints
    # the biLM as built (``ModelConfig`` JSON) and a ManyLangs model's dictionaries (``Dictionaries.state``): what
    # export builds, since a fine-tuned release's token layer is not the TrainConfig's; "" / None in older files
    architecture: str = ""
    dictionaries: dict[str, Any] | None = None

    def payload(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"ranks": [asdict(r) for r in self.ranks]}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> Checkpoint:
        """A loaded file; one written with parallel per-rank lists (earlier versions) reads the same."""
        payload = dict(payload)
        if "ranks" not in payload:
            cuda = payload.pop("cuda_rng", None) or []
            lists = {field: payload.pop(key) for key, field in PER_RANK_LISTS.items()}
            n = len(lists["batcher"])
            payload["ranks"] = [
                {
                    **{field: values[r] for field, values in lists.items()},
                    "cuda_rng": cuda[r] if len(cuda) == n else None,
                }
                for r in range(n)
            ]
        payload["ranks"] = [RankState(**r) for r in payload["ranks"]]
        return cls(**payload)


def checkpoint_dir(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def _step(path: Path) -> int:
    return int(path.stem.split("-")[1])


def digest_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + ".sha256")


def list_checkpoints(out: str | Path) -> list[Path]:
    """The run's checkpoints, oldest first."""
    return sorted(checkpoint_dir(out).glob(PATTERN), key=_step)


def _write_with_digest(path: Path, payload: dict[str, Any]) -> Path:
    """``torch.save`` to a temporary name, its digest beside the final name, then the rename into place."""
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)
        write_text_atomic(digest_path(path), f"{file_sha256(tmp)}  {path.name}\n")
    return path


def payload_bytes(payload: Any) -> int:
    """About what ``torch.save`` writes for ``payload``: its tensors' bytes, plus the zip archive's ~320 bytes of
    headers and alignment per tensor (measured: 390,012 bytes for the fixture run's 113 tensors of 354,321 bytes)
    and its pickle."""
    if isinstance(payload, Tensor):
        return payload.nbytes + 320
    if isinstance(payload, dict):
        return sum(payload_bytes(v) + 16 for v in payload.values())
    if isinstance(payload, list | tuple):
        return sum(payload_bytes(v) + 8 for v in payload)
    if isinstance(payload, str | bytes):
        return len(payload)
    return 16


def last_verified(out: str | Path) -> str:
    """What a run stopped now keeps: its newest checkpoint whose bytes match its digest, by name."""
    for path in reversed(list_checkpoints(out)):
        if problem(path) is None:
            return f"the last verified checkpoint {path} (step {_step(path)}) is kept"
    return "no checkpoint of this run was written yet"


RESUME = "run it again with --resume once there is space, it continues from there"


def _room(out: str | Path, step: int, size: int, keep: int) -> None:
    """Refuse the checkpoint of ``step`` where the run's ``keep`` checkpoints of this size will not fit (less what
    its older ones hold already). Where only the one rotated out after this write is in the way, it goes first."""
    directory = checkpoint_dir(out)
    older = list_checkpoints(out)
    if keep > 1 and len(older) >= keep and free_bytes(directory) < size:  # rotated out after this write anyway
        for old in older[: len(older) - keep + 1]:
            log.info("removing %s before the checkpoint of step %d: the disk has no room for both", old.name, step)
            old.unlink()
            digest_path(old).unlink(missing_ok=True)
    held = sum(p.stat().st_size for p in list_checkpoints(out)[-keep:])
    needed = max(size, keep * size - held)
    advice = f"{last_verified(out)}; free some space and run it again with --resume, it continues from there"
    require_space(directory, needed, f"the checkpoints from step {step} (keep {keep})", advice)


def _write_or_say_full(out: str | Path, path: Path, payload: dict[str, Any]) -> Path:
    """``_write_with_digest``; a write that fails for lack of space is one ``DiskFullError`` naming the last verified
    checkpoint of the run in ``out`` (what a rerun with ``--resume`` continues from)."""
    try:
        return _write_with_digest(path, payload)
    except Exception as exc:
        if isinstance(exc, NoSpaceError) or not disk_full(exc):
            raise
        raise disk_full_error(path.parent, last_verified(out), exc, RESUME) from exc


def write_checkpoint(out: str | Path, step: int, payload: dict[str, Any], keep: int) -> Path:
    """Save ``payload`` as ``step-<step>.pt`` with its digest; keep only the newest ``keep`` checkpoints. A write the
    disk has no room for is refused (``NoSpaceError``) or, failing anyway, one ``DiskFullError``; either names the
    last verified checkpoint."""
    directory = checkpoint_dir(out)
    directory.mkdir(parents=True, exist_ok=True)
    _room(out, step, payload_bytes(payload), keep)
    path = _write_or_say_full(out, directory / f"step-{step:09d}.pt", payload)
    for old in list_checkpoints(out)[:-keep]:
        old.unlink()
    for digest in directory.glob(PATTERN + ".sha256"):
        if not digest.with_suffix("").exists():  # its checkpoint was rotated out, or never renamed into place
            digest.unlink()
    return path


def problem(path: Path) -> str | None:
    """Why ``path`` cannot be trusted (checksum missing or different), or None when its bytes are as written."""
    digest_file = digest_path(path)
    if not digest_file.exists():
        return None  # written before checksums existed: ``load`` still has to succeed
    expected = (digest_file.read_text().split() or [""])[0]
    if file_sha256(path) != expected:
        return f"its SHA-256 differs from {digest_file.name} (truncated, overwritten or damaged)"
    return None


def _read_verified(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The payload of a checkpoint whose bytes match its digest and that loads, or None and why not."""
    issue = problem(path)
    if issue is not None:
        return None, issue
    try:
        return torch.load(path, map_location="cpu", weights_only=True), None
    except Exception as exc:  # torch raises RuntimeError, EOFError, pickle errors, … for unreadable files
        return None, f"it cannot be read ({str(exc).splitlines()[0][:120]})"


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """One named checkpoint, verified; a ``CheckpointError`` says what is wrong with it."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    payload, issue = _read_verified(path)
    if payload is None:
        raise CheckpointError(f"{path}: {issue}; export another checkpoint of the run")
    return payload


def load_newest_valid(out: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of a run folder that verifies and loads, with its payload; None when there is none.

    Damaged ones are skipped with one warning naming them; if every checkpoint is damaged, a
    ``CheckpointError`` lists them.
    """
    damaged: list[str] = []
    for path in reversed(list_checkpoints(out)):
        payload, issue = _read_verified(path)
        if payload is not None:
            if damaged:
                log.warning("skipped damaged checkpoint %s; using %s", "; ".join(damaged), path.name)
            return path, payload
        damaged.append(f"{path} ({issue})")
    if damaged:
        raise CheckpointError(
            f"no valid checkpoint in {checkpoint_dir(out)}: {'; '.join(damaged)}; delete them to start the run afresh"
        )
    return None


def _bests(out: str | Path) -> list[Path]:
    return sorted(checkpoint_dir(out).glob(BEST_PATTERN), key=_step)


def write_best(out: str | Path, step: int, payload: dict[str, Any]) -> Path:
    """Save the best weights so far (``payload``: step, heldout result, model) as ``best-<step>.pt``, then drop the
    previous best: a crash at any point leaves one complete best file with its digest."""
    directory = checkpoint_dir(out)
    directory.mkdir(parents=True, exist_ok=True)
    path = _write_or_say_full(out, directory / f"best-{step:09d}.pt", payload)
    for old in _bests(out):
        if old != path:
            old.unlink()
            digest_path(old).unlink(missing_ok=True)
    return path


def load_best(out: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest best weights of a run folder that verify and load, with their path; None where there are none. A
    damaged file is named in a warning and skipped."""
    for path in reversed(_bests(out)):
        payload, issue = _read_verified(path)
        if payload is not None:
            return path, payload
        log.warning("ignored %s: %s", path, issue)
    return None


def remove_best(out: str | Path) -> None:
    """Forget a folder's best weights (a run starting afresh there)."""
    for path in _bests(out):
        path.unlink()
        digest_path(path).unlink(missing_ok=True)


@dataclass
class BestWeights:
    """``export: best``: the step and heldout result of a run's lowest-perplexity weights so far. The weights are on
    disk (``best-<step>.pt``, above); this one object decides what is kept, and finds and gives it back."""

    out: Path
    step: int | None = None
    result: dict[str, float] | None = None  # the heldout evaluation of those weights

    @classmethod
    def resume(cls, out: Path, step: int) -> BestWeights:
        """A run at ``step`` in its folder: the best so far; a run starting afresh forgets any of an earlier run, and
        a resume from before the best step forgets it too (the same steps run again and find it again)."""
        found = cls.on_disk(out, step) if step > 0 else None
        if found is None:
            remove_best(out)
            return cls(out)
        return cls(out, found[1]["step"], found[1]["perplexity"])

    @staticmethod
    def on_disk(out: Path, step: int) -> tuple[Path, dict[str, Any]] | None:
        """A run folder's best weights from no later than ``step``, with their file: what the run exports."""
        found = load_best(out)
        return found if found is not None and found[1]["step"] <= step else None

    def offer(self, step: int, result: dict[str, float], model: Callable[[], dict[str, Tensor]]) -> bool:
        """Keep ``model()`` if ``result`` is the lowest heldout perplexity yet; True if it was kept."""
        if not result or (self.result is not None and result["perplexity"] >= self.result["perplexity"]):
            return False
        self.step, self.result = step, result
        write_best(self.out, step, {"step": step, "perplexity": result, "model": model()})
        return True

    def weights(self) -> dict[str, Tensor] | None:
        """The kept weights, if the file on disk is still the one of ``step``."""
        found = self.on_disk(self.out, self.step) if self.step is not None else None
        return found[1]["model"] if found is not None and found[1]["step"] == self.step else None
