"""What this machine runs (its CPU, the precisions it offers, the kernels that built) and what a model is: the lines
``elmo info`` prints, made here so the command only prints them."""

from __future__ import annotations

import torch

from elmo_core import cpu
from elmo_core.bilm.kernels import choice, fused_gates, int8, packed
from elmo_core.bilm.model import BiLM
from elmo_core.config import preset
from elmo_core.runtime.placement import place


def machine_report() -> list[str]:
    """The CPU as the project sees it, what torch dispatches to, the precisions offered, oneDNN's packing per dtype,
    int8 and the C kernels."""
    auto = place("cpu", "auto").precision
    offered = choice.offered_precisions("cpu")
    refused = "" if "bf16" in offered else " (bf16 refused here: no bfloat16 instructions, so it would be emulated)"
    lines = [cpu.describe(), f"precisions on the CPU: {', '.join(offered)}; auto is {auto} ({auto.why}){refused}"]
    for dtype in (torch.float32, torch.bfloat16):
        works, why_not = packed.packing(dtype)
        name = str(dtype).removeprefix("torch.")
        lines.append(f"oneDNN packed products in {name}: {'yes' if works else f'no ({why_not})'}")
    lines.append(f"int8 products (precision int8): {int8.describe()}")
    lines.append(f"C kernels (LSTM gates, char CNN backward): {fused_gates.describe()}")
    return lines


def original_shape_kernels() -> str:
    """What would run the original shape here in ``auto`` precision (``elmo info`` without a model)."""
    return str(choice.choose(torch.device("cpu"), place("cpu", "auto").precision, preset("original").lstm))


def model_report(bilm: BiLM, name: str) -> list[str]:
    """A model's shape, parameters (the forget gate's +1 is a buffer, the softmax left out), vocabulary, and the
    kernels each offered precision runs it with."""
    cfg = bilm.config
    n_params = sum(p.numel() for n, p in bilm.named_parameters() if not n.startswith("softmax"))
    lines = [
        f"{name}: {cfg.lstm.n_layers}x{cfg.lstm.dim}_{cfg.lstm.projection_dim}, "
        f"{cfg.char_cnn.n_filters} filters, {cfg.char_cnn.n_highway} highway, skip={cfg.lstm.use_skip_connections}, "
        f"clips={cfg.lstm.cell_clip}/{cfg.lstm.proj_clip}, "
        f"{n_params:,} parameters (without softmax), softmax={cfg.n_tokens_vocab or 'none'}, "
        f"vocab={len(bilm.vocab) if bilm.vocab else 'none'}"
    ]
    return lines + [f"kernels: {bilm.prepare(precision)}" for precision in choice.offered_precisions("cpu")]
