"""Weights packed once into oneDNN's blocked layout, for the small products of the CPU inference step.

Why: each LSTM time step multiplies only the rows still running (often 1-64) by a large weight (512 x 16384 on
the original shape). ``torch.bmm`` then re-packs the whole weight on every call, which costs as much as the
product itself at these row counts. Packing once per weight version and calling oneDNN's linear on the packed
weight measured 1.6x (fp32) and 1.3x (bf16) faster per step at 64 rows, and 2-5x at a handful of rows (the
long sentences' tail). The numbers are the same products in the same precision (float32 accumulation both ways).

``ELMO_NO_PACKED_WEIGHTS=1`` turns this off (plain ``bmm``), as does a torch build without oneDNN; which weights of a
model get packed is decided once, by ``kernels.choose``.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache

import torch
from torch import Tensor

log = logging.getLogger(__name__)

ROWS_HINT = 64  # the row count oneDNN tunes the packing for; measured insensitive from 16 rows up
# Weights smaller than this (per direction) stay with bmm: on the small shape (256 x 4096 at most) packing measured no
# gain in fp32 and 5% slower in bf16, where two calls per step cost more than the re-packing they save.
MIN_ELEMENTS = 1 << 21


@lru_cache(maxsize=1)
def packing_available() -> bool:
    """oneDNN's packed linear is in this torch build and works here (checked once on a tiny product)."""
    if os.environ.get("ELMO_NO_PACKED_WEIGHTS") == "1" or not torch.backends.mkldnn.is_available():
        return False
    try:
        w, x = torch.ones(8, 4), torch.ones(3, 4)
        y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, 3), None, "none", [], "")
        return bool(torch.equal(y, torch.full((3, 8), 4.0)))
    except (AttributeError, RuntimeError) as exc:  # an op renamed or missing in another torch build
        log.debug("oneDNN packed linear unavailable (%s); using bmm", exc)
        return False


class PackedWeights:
    """One packed weight per direction: ``__call__(x (D, rows, K)) -> (D, rows, N)``, the same as
    ``torch.bmm(x, w_t)`` for ``w_t = weights.transpose(1, 2)``, on float32 or bfloat16 inputs of the weights' dtype.
    """

    def __init__(self, weights: Tensor) -> None:
        """weights (D, N, K), PyTorch's ``nn.Linear`` layout per direction."""
        self.packed = [
            torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), ROWS_HINT) for w in weights.unbind(0)
        ]
        self.out_features = weights.shape[1]

    def products(self, x: Tensor) -> list[Tensor]:
        """x @ W.T per direction, each (rows, N) in x's dtype: what the fused gate kernel takes as it is."""
        return [
            torch.ops.mkldnn._linear_pointwise(x[d], packed, None, "none", [], "")
            for d, packed in enumerate(self.packed)
        ]

    def __call__(self, x: Tensor) -> Tensor:
        """x @ W.T per direction, (D, rows, N) in x's dtype."""
        return torch.stack(self.products(x))
