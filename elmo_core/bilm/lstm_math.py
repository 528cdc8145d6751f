"""TensorFlow's ``LSTMCell`` arithmetic, written once: the reference every LSTM path of the project computes.

``lstm.LstmCell`` (training, CUDA, any call with gradients) runs it as it is; the CPU inference cell
(``kernels/cells.py``) runs it where the C gate kernel is off; the C kernels are checked against it. A leaf: it
imports only torch, so the model and the kernels below it share it without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


def stacked(pair: Sequence[nn.LSTM], name: str) -> Tensor:
    """One weight of both directions' ``nn.LSTM``, stacked as (2, ...): direction 0 forward, 1 backward."""
    return torch.stack([getattr(lstm, name) for lstm in pair])


def reference_gates(z: Tensor, c: Tensor, cell_clip: float | None) -> tuple[Tensor, Tensor]:
    """Pre-activations z (..., 4H) in gate order i, f, g, o and the cell state c (..., H) ─► (m, clipped c'):
    c' = σ(f) ⊙ c + σ(i) ⊙ tanh(g), clipped to ±``cell_clip``; m = σ(o) ⊙ tanh(c'). The forget gate's +1 is in
    the bias (``bias_hh_l0``), so z already holds it.

    One chunk into the four gates, each activated on its own: under autograd the backward is then one
    concatenation of the four gate gradients. Slices of one sigmoid over all of z (the same numbers) cost five
    zero-filled gradients of z's size and their sum per step, a share of the LSTM's forward and backward in
    training."""
    i, f, g, o = z.chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    if cell_clip is not None:
        c = c.clamp(-cell_clip, cell_clip)
    return torch.sigmoid(o) * torch.tanh(c), c
