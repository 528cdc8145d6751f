"""ELMo's task mix of a biLM's layers: γ · Σ_j softmax(w)_j · LN?(layer_j), as AllenNLP computes it; learned by a
downstream model, or fixed (an embedding job's ``mix_weights`` and ``gamma``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from elmo_core.errors import ConfigurationError, InputError


class ScalarMix(nn.Module):
    """ELMo's task mix γ · Σ_j softmax(w)_j · LN?(layer_j), as AllenNLP computes it; fixed or learned.

    With ``do_layer_norm`` each layer is normalised by one mean and variance over all unmasked positions and
    features, ε = 1e-13, no affine parameters. Given ``initial_scalar_parameters`` and ``trainable=False`` the
    weights are fixed: what ``elmo embed --mix-weights`` and the probes use.
    """

    def __init__(
        self,
        mixture_size: int,
        do_layer_norm: bool = False,
        initial_scalar_parameters: Sequence[float] | None = None,
        trainable: bool = True,
        gamma: float = 1.0,
    ) -> None:
        super().__init__()
        self.mixture_size = mixture_size
        self.do_layer_norm = do_layer_norm
        values = list(initial_scalar_parameters) if initial_scalar_parameters is not None else [0.0] * mixture_size
        if len(values) != mixture_size:
            raise ConfigurationError(
                f"ScalarMix: initial_scalar_parameters has {len(values)} values; mixture_size is {mixture_size}"
            )
        self.scalar_parameters = nn.ParameterList(
            nn.Parameter(torch.tensor([float(v)]), requires_grad=trainable) for v in values
        )
        self.gamma = nn.Parameter(torch.tensor([float(gamma)]), requires_grad=trainable)

    def weights(self) -> Tensor:
        """γ · softmax(w): the factor of each layer, (L+1,)."""
        return self.gamma * torch.softmax(torch.cat(list(self.scalar_parameters)), dim=0)

    def forward(self, tensors: Sequence[Tensor], mask: Tensor | None = None) -> Tensor:
        if len(tensors) != self.mixture_size:
            raise ConfigurationError(f"{len(tensors)} tensors passed to a ScalarMix of size {self.mixture_size}")
        weights = torch.softmax(torch.cat(list(self.scalar_parameters)), dim=0)
        if self.do_layer_norm and mask is None:
            raise ValueError("do_layer_norm needs the mask")
        pieces = []
        for weight, tensor in zip(weights.split(1), tensors):
            if self.do_layer_norm:
                tensor = _masked_layer_norm(tensor, mask)  # type: ignore[arg-type]
            pieces.append(weight * tensor)
        return self.gamma * sum(pieces)


def fixed_mix(n_layers: int, weights: Sequence[float] | None, gamma: float = 1.0) -> ScalarMix:
    """The fixed mix a job's ``mix_weights`` option asks for (``elmo embed``, the probes); a wrong length names the
    option, where a library call's error names ``ScalarMix``'s parameter."""
    if weights is not None and len(weights) != n_layers:
        raise InputError(f"mix_weights (--mix-weights) has {len(weights)} values; the model has {n_layers} layers")
    return ScalarMix(n_layers, initial_scalar_parameters=weights, trainable=False, gamma=gamma)


def _masked_layer_norm(tensor: Tensor, mask: Tensor) -> Tensor:
    broadcast_mask = mask.unsqueeze(-1).to(tensor.dtype)
    n = broadcast_mask.sum() * tensor.shape[-1]
    masked = tensor * broadcast_mask
    mean = masked.sum() / n
    variance = (((masked - mean) * broadcast_mask) ** 2).sum() / n
    return (tensor - mean) / torch.sqrt(variance + 1e-13)
