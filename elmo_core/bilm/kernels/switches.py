"""The environment switches that turn a speed kernel off, read here and nowhere else, and named on the kernels line.

Each is ``1`` to turn its kernel off (to compare it with what runs without it, or to step around a machine where it
misbehaves); anything else leaves the choice to ``choice.choose``:

    ELMO_NO_PACKED_WEIGHTS   the LSTM step's products on oneDNN-packed weights (``packed``)
    ELMO_NO_FUSED_GATES      the C kernels: the LSTM gates, the char CNN's backward (``fused_gates``)
    ELMO_NO_STEP_LOOP        a layer's steps in one C call (``step_loop``)
    ELMO_NO_LAYER_STEPS      a whole layer per call on CUDA (``layer_steps.LayerCell``)
    ELMO_NO_COMPILE          ``torch.compile`` of that layer's step (``layer_steps``)
    ELMO_NO_CUDA_GRAPHS      its replay as CUDA graphs (``cuda_graphs``)

Read on every call, not cached: a test turns one on for a block (``monkeypatch.setenv``) and clears the loaders'
caches, as a new process with the variable set would see it.
"""

from __future__ import annotations

import os

SWITCHES = (
    "ELMO_NO_PACKED_WEIGHTS",
    "ELMO_NO_FUSED_GATES",
    "ELMO_NO_STEP_LOOP",
    "ELMO_NO_LAYER_STEPS",
    "ELMO_NO_COMPILE",
    "ELMO_NO_CUDA_GRAPHS",
)


def off(name: str) -> bool:
    """Whether the switch ``name`` (one of ``SWITCHES``) turns its kernel off in this process."""
    if name not in SWITCHES:
        raise ValueError(f"{name}: not a kernel switch; the switches are {', '.join(SWITCHES)}")
    return os.environ.get(name) == "1"


def line() -> str:
    """The switches set, for the kernels line ("" where none is)."""
    set_ = [f"{name}=1" for name in SWITCHES if off(name)]
    return f"; switched off: {', '.join(set_)}" if set_ else ""
