"""int8 products for CPU inference (``precision: int8``): the LSTM step's per-step products on int8 weights.

Why: on CPUs without bfloat16 instructions (AVX2-only x86, AVX-512 before Cooper Lake) fp32 is otherwise the fastest
path, and the per-step products are most of an original-shape call. PyTorch's dynamic quantization runs them on
int8 weights (per output channel, quantized once per weight version) with each call's activations quantized per
tensor on the fly: 1.9-2.0x fp32 on the original shape, measured (``bench/int8_inference.py`` on the 2-vCPU AMD
EPYC with avx512_bf16), with a per-token cosine to fp32 of at least 0.999 at the 0.1% quantile in every layer on real
text. The bias, the gates and the cell state stay float32; layer 0 and its per-word input gates are not quantized
(``choice.py`` says in what they run).

Where the CPU has VNNI (int8 dot products summed in int32) the weights are packed for oneDNN and the activations
take 8 bits; elsewhere fbgemm (``x86``) runs them with 7-bit activations (``reduce_range``), because AVX2's products
sum pairs of int8 x uint8 in int16, which 8-bit activations can saturate (``precision.int8_engine`` decides, once,
and says which on the kernels line). PyTorch 2.13 marks the quantized tensors these ops rest on as deprecated: the
warning is expected here and silenced where the weights are made; a torch without the ops has no int8
(``precision.int8_products`` says why, once), and ``precision: int8`` is then refused in one line.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from elmo_core import precision

log = logging.getLogger(__name__)


def available() -> bool:
    """Whether this torch runs dynamic int8 products here (probed once, ``precision.int8_products``)."""
    return precision.int8_products()[0]


def describe() -> str:
    """What runs the int8 products, or why nothing can (``elmo info``, the kernels' log line)."""
    works, why = precision.int8_products()
    return why if works else f"no ({why})"


class Int8Weights:
    """``kernels.packed.PackedWeights``' interface on int8 weights: ``products(x (D, rows, K))`` → per direction
    x @ W.T (rows, N) in float32, for ``weights`` (D, N, K) in ``nn.Linear``'s layout."""

    def __init__(self, weights: Tensor) -> None:
        engine, bits = precision.int8_engine()
        self.reduce_range = bits == 7  # AVX2's int16 sums (module docstring)
        self.packed = [precision.int8_packed(w, engine) for w in weights.unbind(0)]
        self.out_features = weights.shape[1]

    def products(self, x: Tensor) -> list[Tensor]:
        return [
            torch.ops.quantized.linear_dynamic(x[d].float().contiguous(), packed, self.reduce_range)
            for d, packed in enumerate(self.packed)
        ]

    def __call__(self, x: Tensor) -> Tensor:
        return torch.stack(self.products(x))
