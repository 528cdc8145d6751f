"""Training on several processes: the process group, gathering one object per rank, and the check that every
replica holds the same weights."""

from __future__ import annotations

import hashlib
import json
import logging
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
