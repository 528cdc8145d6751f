"""Where and in what precision a run computes: its device, and exact float32 (bilm-tf's numbers) or bfloat16
matmuls with float32 state.

``bf16`` runs the char CNN, highway, projection, the LSTM input and recurrent matmuls (and the softmax where
used) in bfloat16 under ``torch.autocast``; accumulation happens in float32 inside the kernels, and the LSTM
cell state, the gate arithmetic and the loss stay float32 (``model.LstmCell`` casts the gates up).
CPUs without native bf16 instructions still run it, more slowly; ``ELMO_ASSUME_NO_BF16=1`` makes this
module report such a CPU (how the tests exercise that path on machines that have bf16).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from functools import lru_cache

import torch

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "fp32", "bf16")


def pick_device(name: str) -> torch.device:
    """``auto`` → CUDA when there is a GPU, else the CPU; CUDA asked for without one falls back with a warning."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        log.warning("CUDA is not available; running on the CPU")
        return torch.device("cpu")
    return device


@lru_cache(maxsize=1)
def cpu_capability() -> str:
    """What torch's CPU kernels were dispatched for (e.g. AVX512, AVX2, DEFAULT)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # older builds
        return "unknown"


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bfloat16 dot-product instructions (avx512_bf16, AMX or ARM bf16)."""
    if os.environ.get("ELMO_ASSUME_NO_BF16") == "1":
        return False
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


_warned: set[str] = set()


def native_bf16(device: torch.device | str) -> tuple[bool, str]:
    """Whether ``device`` computes bfloat16 products natively, and what says so (for the run's log)."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{torch.cuda.get_device_name(device)} computes bfloat16 natively"
        return False, "this GPU has no native bfloat16"
    if device.type == "cpu":
        if cpu_has_native_bf16():
            return True, f"the CPU has bfloat16 instructions (avx512_bf16 or AMX; torch capability {cpu_capability()})"
        return False, f"the CPU has no bfloat16 instructions (torch capability {cpu_capability()})"
    return False, f"{device.type} is not known to compute bfloat16 natively"


def choose_precision(precision: str, device: torch.device | str) -> tuple[str, str]:
    """The precision a run computes in, and why: ``auto`` is bf16 wherever the hardware computes it natively (CUDA
    with bf16, CPUs with avx512_bf16 or AMX) and fp32 elsewhere; fp32 and bf16 are taken as asked."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision != "auto":
        return resolve_precision(precision, device), f"asked for {precision}"
    native, why = native_bf16(device)
    return ("bf16" if native else "fp32"), f"auto: {why}"


def resolve_precision(precision: str, device: torch.device | str) -> str:
    """``auto`` → bf16 where ``device`` computes it natively, else fp32 (``choose_precision``); warns once when
    bf16 is asked for on a CPU that will emulate it."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    device_type = torch.device(device).type
    if precision == "auto":
        return choose_precision(precision, device)[0]
    if precision == "bf16" and device_type == "cpu" and not cpu_has_native_bf16() and "cpu" not in _warned:
        _warned.add("cpu")
        log.warning(
            "this CPU has no native bfloat16 instructions (torch CPU capability %s): bf16 works but runs "
            "slower than fp32 here; use --precision fp32",
            cpu_capability(),
        )
    return precision


def autocast(device: torch.device | str, precision: str) -> contextlib.AbstractContextManager:
    """The autocast context of ``precision`` on ``device`` (a no-op for fp32)."""
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


@contextlib.contextmanager
def onednn_verbose(enabled: bool) -> Iterator[None]:
    """Print oneDNN's kernel log (which primitives ran, in which precision) while the block runs."""
    if not enabled or not torch.backends.mkldnn.is_available():
        yield
        return
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        yield
