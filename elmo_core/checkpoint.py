"""Training checkpoints: written atomically with their SHA-256, verified before any use.

    OUT/checkpoints/step-000001250.pt          the payload (``torch.save``; loads with ``weights_only=True``)
    OUT/checkpoints/step-000001250.pt.sha256   its digest, in ``sha256sum`` format (``sha256sum -c`` checks it)
    OUT/checkpoints/best-000000800.pt (+ .sha256)   ``export: best``: the weights of the lowest heldout perplexity yet

The digest file is written first and the checkpoint renamed into place after it, so a checkpoint that exists is
complete and has its digest. Resume and export take the newest checkpoint whose bytes still match and that
loads; a damaged one (truncated, zeroed, replaced) is named in one warning and the one before it is used.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from elmo_core.errors import CheckpointError
from elmo_core.fileio import atomic_path, file_sha256, write_text_atomic

log = logging.getLogger(__name__)

PATTERN = "step-*.pt"
BEST_PATTERN = "best-*.pt"


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


def write_checkpoint(out: str | Path, step: int, payload: dict[str, Any], keep: int) -> Path:
    """Save ``payload`` as ``step-<step>.pt`` with its digest; keep only the newest ``keep`` checkpoints."""
    directory = checkpoint_dir(out)
    directory.mkdir(parents=True, exist_ok=True)
    path = _write_with_digest(directory / f"step-{step:09d}.pt", payload)
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
    path = _write_with_digest(directory / f"best-{step:09d}.pt", payload)
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
