"""Training on several processes: the process group, gathering one object per rank, values every rank agrees on
(the budget's share, a stop), and the check that every replica holds the same weights."""

from __future__ import annotations

import hashlib
import json
import logging
import signal
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elmo_core.bilm.model import BiLM
from elmo_core.errors import (
    ElmoError,
)
from elmo_core.fileio import write_text_atomic
from elmo_core.ranks import Rank, this_process

log = logging.getLogger(__name__)


def init_distributed(device: torch.device) -> Rank:
    """This process's rank, its process group set up where the launch has several (gloo on CPUs, NCCL on GPUs)."""
    launched = this_process()
    if launched.world == 1:
        return launched
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return replace(launched, rank=dist.get_rank(), world=dist.get_world_size())


def gather(ddp: Rank, item: Any) -> list[Any]:
    if ddp.world == 1:
        return [item]
    gathered: list[Any] = [None] * ddp.world
    dist.all_gather_object(gathered, item)
    return gathered


def check_replicas_agree(bilm: BiLM, ddp: Rank, out: Path) -> None:
    """Every rank hashes its weights; rank 0 writes them to out/ddp_weights.json and fails if they differ."""
    digest = hashlib.sha256()
    for name, tensor in sorted(bilm.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    digests = gather(ddp, digest.hexdigest())
    if ddp.main:
        write_text_atomic(out / "ddp_weights.json", json.dumps(digests) + "\n")
        if len(set(digests)) != 1:
            raise ElmoError(f"DDP replicas diverged: weight digests {digests}")


def agreed(ddp: Rank, device: torch.device, flag: bool) -> bool:
    """``flag`` on any rank: every rank stops at the same step."""
    return agreed_max(ddp, device, float(flag)) > 0.0


def agreed_max(ddp: Rank, device: torch.device, value: float) -> float:
    """The largest of every rank's ``value`` (one small all-reduce per call under DDP)."""
    if ddp.world == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


class StopRequest:
    """SIGTERM to a rank of a launch (``launch.py``) asks it to stop: every rank stops at the same step (the flag is
    all-reduced each step), after a checkpoint. Active only in a launched rank's main thread."""

    def __init__(self) -> None:
        self.asked = False
        self.active = this_process().launched and threading.current_thread() is threading.main_thread()
        self._previous = signal.signal(signal.SIGTERM, self._ask) if self.active else None

    def _ask(self, *_: object) -> None:
        self.asked = True

    def agreed(self, ddp: Rank, device: torch.device) -> bool:
        return self.active and agreed(ddp, device, self.asked)

    def restore(self) -> None:
        if self.active:
            signal.signal(signal.SIGTERM, self._previous)
