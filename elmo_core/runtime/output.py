"""What a caller wants of a sentence's layers: the one output description of the table writer, the server, the
probes, the pyfunc model and the drop-in's ``average``.

    layers  "all": every layer, (L+1, n, 2P); "mix": γ · Σ_j softmax(w)_j · layer_j, (1, n, 2P)
    pool    "none": a vector per token; "mean": the vectors averaged over the sentence's tokens, (K, 1, 2P)
    dtype   float32 or float16 (how the vectors are stored or sent; computed in float32 either way)

A mix with no weights is the plain average of the layers (AllenNLP's ``average``). ``apply`` works on a batch's
token rows as the runtime yields them, so a mix or a mean is computed in one place, on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from elmo_core.bilm.scalar_mix import fixed_mix


@dataclass(frozen=True)
class Output:
    layers: Literal["all", "mix"] = "all"
    pool: Literal["none", "mean"] = "none"
    mix_weights: tuple[float, ...] | None = None
    gamma: float = 1.0
    dtype: Literal["float32", "float16"] = "float32"

    @classmethod
    def of(
        cls,
        layers: str = "all",
        pool: str = "none",
        mix_weights: Sequence[float] | None = None,
        gamma: float = 1.0,
        dtype: str = "float32",
    ) -> Output:
        weights = tuple(float(w) for w in mix_weights) if mix_weights is not None else None
        return cls(layers, pool, weights, float(gamma), dtype)  # type: ignore[arg-type]

    def factors(self, n_layers: int) -> Tensor:
        """γ · softmax(w), (L+1,): each layer's factor in the mix (a wrong number of weights names the option)."""
        return fixed_mix(n_layers, self.mix_weights, self.gamma).weights().detach()

    def columns(self, n_layers: int) -> list[str]:
        """The table's vector columns: ``layer_0 … layer_L``, or one ``elmo``."""
        return [f"layer_{i}" for i in range(n_layers)] if self.layers == "all" else ["elmo"]

    def apply(self, stacked: Tensor, counts: Tensor, factors: Tensor | None = None) -> Tensor:
        """A batch's layers (L+1, N, 2P) as token rows (each sentence's tokens after the one before, ``counts``
        (B,) of them) ─► (K, R, 2P) in float32: K = L+1 layers or 1 mix, R = N tokens or B sentences.
        ``factors``: the mix's, where the caller made them once for many batches."""
        stacked = stacked.float()
        if self.layers == "mix":
            weights = (factors if factors is not None else self.factors(stacked.shape[0])).to(stacked.device)
            stacked = (weights[:, None, None] * stacked).sum(0, keepdim=True)
        if self.pool == "none":
            return stacked
        counts = counts.to(stacked.device)
        sentence = torch.repeat_interleave(torch.arange(len(counts), device=stacked.device), counts)
        sums = stacked.new_zeros(stacked.shape[0], len(counts), stacked.shape[2]).index_add_(1, sentence, stacked)
        return sums / counts.clamp(min=1).to(sums)[None, :, None]

    def of_sentence(self, shaped: Tensor) -> Tensor:
        """``apply``'s (K, R, 2P) of one sentence as callers hold it: (L+1, n, 2P) every layer, (n, 2P) a mix;
        pooled, (L+1, 2P) or (2P,)."""
        one = shaped[:, 0] if self.pool == "mean" else shaped
        return one[0] if self.layers == "mix" else one

    def numpy_dtype(self) -> np.dtype:
        return np.dtype(np.float16 if self.dtype == "float16" else np.float32)

    def torch_dtype(self) -> torch.dtype:
        """The stored type as torch converts to it (float16: vectorized, several times NumPy's ``astype``)."""
        return torch.float16 if self.dtype == "float16" else torch.float32


ALL_LAYERS = Output()
