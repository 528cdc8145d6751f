"""Where and how a model computes in this process: the device, the precision (with its reason) and the threads.

``place`` decides the device and the precision once, from what was asked (``auto`` included); a plan calls it in
the process that plans, so a refusal (bf16 emulated on this CPU, int8 on a GPU) comes before any work, and the
resolved ``Placement`` travels with the plan (pickled whole) to every process that runs a unit. ``take_threads``
is decided where the model runs: a process the project started (an embedding worker, a server's model process, a
CPU rank of a launched training) takes its share of the cores from the environment its starter gave it
(``cpu.worker_env``); a process on its own keeps torch's default unless told a number.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from elmo_core import cpu
from elmo_core.defaults import DEFAULT_DEVICE, DEFAULT_INFERENCE_PRECISION
from elmo_core.precision import (
    PRECISIONS,
    Precision,
    pick_device,
    resolve_precision,
)

INFERENCE_PRECISIONS = PRECISIONS  # auto, fp32, bf16, int8: the same values, the same meaning, in every command
TRAINING_PRECISIONS = ("auto", "fp32", "bf16")  # int8 runs inference only


@dataclass(frozen=True)
class Placement:
    """A device and the precision resolved for it (``precision.why`` says why)."""

    device: str
    precision: Precision

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def line(self) -> str:
        return f"{self.device}, {self.precision} ({self.precision.why})"


def place(device: str | torch.device = DEFAULT_DEVICE, precision: str = DEFAULT_INFERENCE_PRECISION) -> Placement:
    """The device (``auto``: CUDA where there is a GPU) and the precision resolved for it, refused in one line
    where it cannot run usefully (``precision.resolve_precision``)."""
    chosen = pick_device(str(device))
    return Placement(str(chosen), resolve_precision(precision, chosen))


def take_threads(asked: int | None = None) -> tuple[int, str]:
    """Set this process's torch threads: ``asked``, else the share of the cores its starter gave it, else torch's
    default. Returns (threads, why) for the run's line."""
    if asked:
        torch.set_num_threads(asked)
        return asked, "asked for"
    share = cpu.apply_thread_share()
    if share:
        return torch.get_num_threads(), f"this process's share of {cpu.usable_cores()} cores"
    return torch.get_num_threads(), f"torch's default on {cpu.usable_cores()} usable cores"


def visible_gpus() -> int:
    """The GPUs this process sees (``CUDA_VISIBLE_DEVICES``): a launch's ``nproc_per_node: auto`` starts one rank
    each."""
    return torch.cuda.device_count()


def gpu_processes(device: str) -> list[dict[str, str]]:
    """One process per GPU for a job of many units placed on ``device``: where it is ``cuda`` (no index) and this
    machine shows more than one GPU, the environment of each process shows it one (``CUDA_VISIBLE_DEVICES``), on
    which it is ``cuda``, as a training's ranks each take one. [] otherwise: the job runs in this process, and
    ``cuda:N`` keeps it on GPU N."""
    if device != "cuda":
        return []
    return one_gpu_each(visible_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))


def one_gpu_each(count: int, visible: str | None) -> list[dict[str, str]]:
    """``count`` GPUs shown as ``visible`` (``CUDA_VISIBLE_DEVICES``, or None for all) ─► one environment per GPU,
    each naming its GPU as the parent's environment does; [] for fewer than two."""
    names = [v.strip() for v in visible.split(",") if v.strip()] if visible is not None else []
    names = (names or [str(i) for i in range(count)])[:count]
    return [{"CUDA_VISIBLE_DEVICES": name} for name in names] if len(names) > 1 else []


def main(argv: list[str] | None = None) -> int:
    """``python -m elmo_core.runtime.placement DEVICE PRECISION``: the placement as one JSON line, or the refusal as
    one line on stderr (exit 2). What a process that must not import torch (``elmo serve``'s HTTP process) runs to
    have the device and precision decided, and refused, before it binds its port."""
    import json
    import sys

    from elmo_core.errors import ElmoError

    device, precision = argv if argv is not None else sys.argv[1:]
    try:
        placed = place(device, precision)
    except (ElmoError, ValueError, RuntimeError) as exc:
        print(str(exc).splitlines()[0], file=sys.stderr)
        return 2
    print(json.dumps({"device": placed.device, "precision": str(placed.precision), "why": placed.precision.why}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
