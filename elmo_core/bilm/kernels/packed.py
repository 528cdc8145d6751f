"""Weights packed once into oneDNN's blocked layout, for the small products of the CPU inference step.

Why: each LSTM time step multiplies only the rows still running (often 1-64) by a large weight (512 x 16384 on
the original shape). ``torch.bmm`` then re-packs the whole weight on every call, which costs as much as the
product itself at these row counts. Packing once per weight version and calling oneDNN's linear on the packed
weight is faster per step, most at a handful of rows (the long sentences' tail); ``bench/embed_throughput.py``
with and without ``ELMO_NO_PACKED_WEIGHTS=1`` measures it on a shape. The numbers are the same products in the
same precision (float32 accumulation both ways).

``ELMO_NO_PACKED_WEIGHTS=1`` turns this off (plain ``bmm``), as does a torch build without oneDNN or a CPU it cannot
pack for in the run's dtype (probed per dtype: bf16 packing needs AVX-512 or AVX-NE-CONVERT); which weights of a
model get packed is decided once, by ``kernels.choose``.
"""

from __future__ import annotations

import logging
from functools import lru_cache

import torch
from torch import Tensor

from elmo_core import cpu
from elmo_core.bilm.kernels import switches

log = logging.getLogger(__name__)

ROWS_HINT = 64  # the row count oneDNN tunes the packing for; measured insensitive from 16 rows up
# Weights smaller than this (per direction) stay with bmm: on the small shape (256 x 4096 at most) packing gained
# nothing in fp32 and lost in bf16, where two calls per step cost more than the re-packing they save.
MIN_ELEMENTS = 1 << 21


def packing(dtype: torch.dtype = torch.float32) -> tuple[bool, str]:
    """Whether oneDNN's packed linear is in this torch build and works here for ``dtype`` inputs, and why not:
    checked once per dtype (and value of ``ELMO_CPU_ISA``) on a tiny product, in the dtype that will run (oneDNN's
    bf16 packing refuses CPUs without AVX-512 or AVX-NE-CONVERT: "bf16 path needs the cpu support ...")."""
    return _packing(dtype, cpu.override())


@lru_cache(maxsize=8)
def _packing(dtype: torch.dtype, isa: str | None) -> tuple[bool, str]:
    if switches.off("ELMO_NO_PACKED_WEIGHTS"):
        return False, "ELMO_NO_PACKED_WEIGHTS=1"
    if not torch.backends.mkldnn.is_available():
        return False, "no oneDNN in this torch"
    name = str(dtype).removeprefix("torch.")
    try:
        w, x = torch.ones(8, 4, dtype=dtype), torch.ones(3, 4, dtype=dtype)
        y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, 3), None, "none", [], "")
        if not torch.equal(y.float(), torch.full((3, 8), 4.0)):
            return False, f"oneDNN's packed {name} product gave wrong numbers here"
    except (AttributeError, RuntimeError) as exc:  # an op renamed or missing, or a CPU oneDNN cannot pack for
        log.debug("oneDNN packed linear unavailable for %s (%s); using bmm", name, exc)
        return False, f"oneDNN cannot pack {name} here: {str(exc).splitlines()[0][:120]}"
    if dtype == torch.bfloat16 and not cpu.facts().bf16_instructions:  # emulated (or ELMO_CPU_ISA says so)
        return False, f"not for {name} on a CPU without bfloat16 instructions"
    return True, ""


def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """oneDNN's packed linear works here for ``dtype`` inputs (``packing``)."""
    return packing(dtype)[0]


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
