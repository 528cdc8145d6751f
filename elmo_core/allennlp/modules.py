"""AllenNLP 2.10's ``allennlp.modules.elmo`` on this project's biLM: ``Elmo``, ``_ElmoBiLm``, ``batch_to_ids``,
``ScalarMix`` and ``remove_sentence_boundaries``, with AllenNLP's signatures, outputs and state-dict keys.

What differs, on purpose: AllenNLP's biLM carries its LSTM state from call to call per batch row, so a sentence's
vectors depend on what was embedded before it. Here each call starts from zero state unless ``stateful=True``
(which reproduces AllenNLP call for call, ``reset_states()`` included). Without gradients the project's fast
inference kernels run (``precision="bf16"`` where asked); with gradients the exact differentiable path does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from elmo_core.allennlp.keys import allennlp_keys, from_allennlp, to_allennlp
from elmo_core.bilm.inference import LstmState, StateCarry
from elmo_core.bilm.model import BiLM
from elmo_core.bilm.scalar_mix import ScalarMix
from elmo_core.defaults import DEFAULT_INFERENCE_PRECISION
from elmo_core.errors import ConfigError
from elmo_core.runtime import Runtime
from elmo_core.text.chars import batch_to_ids

__all__ = ["Elmo", "ScalarMix", "_ElmoBiLm", "batch_to_ids", "remove_sentence_boundaries"]

log = logging.getLogger(__name__)


def remove_sentence_boundaries(tensor: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(B, T+2, D) with ``<S>``/``</S>`` around each row's ``mask`` ─► (B, T, D) without them, and the new bool mask
    (AllenNLP's ``allennlp.nn.util.remove_sentence_boundaries``)."""
    lengths = mask.long().sum(1)
    width = tensor.shape[1] - 2
    keep = torch.arange(width, device=tensor.device)[None, :] < (lengths - 2)[:, None]
    trimmed = tensor[:, 1 : 1 + width] * keep.unsqueeze(-1).to(tensor.dtype)
    return trimmed, keep


class AllenNLPStateCarry(StateCarry):
    """AllenNLP's stateful update: row r of a call starts from row r's state; after it, rows beyond the call keep
    theirs, and a row whose new first-layer state is exactly zero (a row the LSTM did not run) keeps its old one,
    judged separately for h and c as AllenNLP's ``_EncoderBase._update_states`` does."""

    def keep(self, new_state: LstmState) -> None:
        h, c = (s.detach().float() for s in new_state)
        if self.state is not None:
            olds = self.take(h.shape[2])  # zeros for rows never seen
            h, c = (
                torch.where((new[0].sum(dim=(0, 2)) != 0)[None, None, :, None], new, old)
                for new, old in ((h, olds[0]), (c, olds[1]))  # type: ignore[index]
            )
        super().keep((h, c))


class _LstmStates:
    """What ``elmo._elmo_lstm._elmo_lstm`` offers downstream code: ``reset_states()`` and ``_states``."""

    def __init__(self, carry: StateCarry) -> None:
        self._carry = carry

    def reset_states(self) -> None:
        self._carry.reset()

    @property
    def _states(self) -> LstmState | None:
        return self._carry.state


class _ElmoBiLm(nn.Module):
    """AllenNLP's ``_ElmoBiLm(options_file, weight_file, requires_grad=False, vocab_to_cache=None)``:
    ``forward(inputs, word_inputs=None)`` ─► ``{"activations": [L+1 × (B, T+2, 2P)], "mask": (B, T+2) bool}``,
    boundaries kept. Its state dict has AllenNLP's keys (``keys.py``)."""

    def __init__(
        self,
        options_file: str | None,
        weight_file: str | None,
        requires_grad: bool = False,
        vocab_to_cache: list[str] | None = None,
        *,
        stateful: bool = False,
        precision: str = DEFAULT_INFERENCE_PRECISION,
        bilm: BiLM | None = None,
        device: str = "cpu",  # AllenNLP's: a module's weights start on the CPU, as every torch module's; .to() moves
    ) -> None:
        super().__init__()
        if bilm is None:  # the model opened as every command opens one: the runtime resolves, places, prepares
            self._runtime: Runtime | None = Runtime.open(
                str(options_file), weight_file=weight_file, device=device, precision=precision
            )
            bilm = self._runtime.bilm
        else:
            self._runtime = None
        self._bilm = bilm
        if not self._bilm.config.lstm.use_skip_connections:
            raise ConfigError(f"{options_file}: AllenNLP's ELMo supports only biLMs with residual connections")
        self._bilm.softmax = None  # AllenNLP's biLM has no softmax; neither do its state dicts
        for parameter in self._bilm.parameters():
            parameter.requires_grad_(requires_grad)
        self.num_layers = self._bilm.num_layers
        self._precision = self._runtime.precision if self._runtime is not None else precision
        self._stateful = stateful
        self._carry = AllenNLPStateCarry()
        self._word_embedding: nn.Embedding | None = None
        if vocab_to_cache:
            table = self._bilm.token_embeddings(vocab_to_cache).float()
            self._word_embedding = nn.Embedding.from_pretrained(table, freeze=True)
        self._register_state_dict_hook(_save_allennlp_keys)
        self._register_load_state_dict_pre_hook(_load_allennlp_keys, with_module=True)

    @property
    def _elmo_lstm(self) -> _LstmStates:
        return _LstmStates(self._carry)

    def get_output_dim(self) -> int:
        return self._bilm.output_dim

    def reset_states(self) -> None:
        self._carry.reset()

    def create_cached_cnn_embeddings(self, tokens: list[str]) -> None:
        """Cache layer 0 of ``tokens`` (row i = word i, row 0 padding) for ``word_inputs``."""
        self._word_embedding = nn.Embedding.from_pretrained(self._bilm.token_embeddings(tokens).float(), freeze=True)

    def forward(self, inputs: Tensor, word_inputs: Tensor | None = None) -> dict[str, Any]:
        bilm = self._bilm
        if bilm.kernels is None or not bilm.kernels.runs_on(bilm.device):  # moved with .to(): choose again
            bilm.prepare(self._precision)
        state = self._carry.take(inputs.shape[0]) if self._stateful else None
        table, ids = None, inputs
        if word_inputs is not None and self._word_embedding is not None:
            if word_inputs.numel() == 0 or int(word_inputs.max()) < self._word_embedding.num_embeddings:
                table, ids = self._word_embedding.weight, word_inputs  # else back to the char CNN, as AllenNLP
        out = bilm(ids, state=state, token_table=table, keep_boundaries=True)
        if self._stateful:
            self._carry.keep(out["state"])
        return {"activations": out["activations"], "mask": out["mask"]}


def _save_allennlp_keys(module: _ElmoBiLm, state_dict: dict[str, Tensor], prefix: str, _metadata: Any) -> None:
    """Our keys under ``prefix + "_bilm."`` ─► AllenNLP's under ``prefix``."""
    inner = prefix + "_bilm."
    ours = {key[len(inner) :]: state_dict.pop(key) for key in [k for k in state_dict if k.startswith(inner)]}
    for key, value in to_allennlp(ours, module._bilm.config).items():
        state_dict[prefix + key] = value


def _load_allennlp_keys(module: _ElmoBiLm, state_dict: dict[str, Tensor], prefix: str, *_: Any) -> None:
    """AllenNLP's keys under ``prefix`` ─► ours under ``prefix + "_bilm."``, before the children load them. Keys it
    lacks are left for ``load_state_dict`` to report as missing."""
    config = module._bilm.config
    theirs = {key: state_dict[prefix + key] for key in allennlp_keys(config) if prefix + key in state_dict}
    if len(theirs) < len(allennlp_keys(config)):
        return
    for key in theirs:
        del state_dict[prefix + key]
    for key, value in from_allennlp(theirs, config).items():
        state_dict[f"{prefix}_bilm.{key}"] = value


class Elmo(nn.Module):
    """AllenNLP 2.10's ``Elmo``: ``num_output_representations`` scalar mixes of the biLM's layers.

    ``forward(inputs, word_inputs=None)`` takes char ids (..., T, 50) (``batch_to_ids``) and returns
    ``{"elmo_representations": [num_output_representations × (..., T, 2P)], "mask": (..., T) bool}``: each a
    ``ScalarMix`` of the layers (computed with the boundaries, as AllenNLP does), boundaries removed (unless
    ``keep_sentence_boundaries``), then dropout. Extra keywords: ``stateful`` (AllenNLP's carried LSTM state; off:
    every sentence from zero state) and ``precision`` ("fp32" exact, "bf16" faster, without gradients).
    """

    def __init__(
        self,
        options_file: str | None,
        weight_file: str | None,
        num_output_representations: int,
        requires_grad: bool = False,
        do_layer_norm: bool = False,
        dropout: float = 0.5,
        vocab_to_cache: list[str] | None = None,
        keep_sentence_boundaries: bool = False,
        scalar_mix_parameters: Sequence[float] | None = None,
        module: nn.Module | None = None,
        *,
        stateful: bool = False,
        precision: str = DEFAULT_INFERENCE_PRECISION,
    ) -> None:
        super().__init__()
        if module is not None:
            if options_file is not None or weight_file is not None:
                raise ConfigError("Elmo: give module, or options_file and weight_file, not both")
            self._elmo_lstm = module
        else:
            self._elmo_lstm = _ElmoBiLm(
                options_file, weight_file, requires_grad, vocab_to_cache, stateful=stateful, precision=precision
            )
        self._has_cached_vocab = vocab_to_cache is not None
        self._keep_sentence_boundaries = keep_sentence_boundaries
        self._dropout = nn.Dropout(p=dropout)
        self._scalar_mixes: list[ScalarMix] = []
        for k in range(num_output_representations):
            mix = ScalarMix(
                self._elmo_lstm.num_layers,
                do_layer_norm=do_layer_norm,
                initial_scalar_parameters=scalar_mix_parameters,
                trainable=scalar_mix_parameters is None,
            )
            self.add_module(f"scalar_mix_{k}", mix)
            self._scalar_mixes.append(mix)

    def get_output_dim(self) -> int:
        return self._elmo_lstm.get_output_dim()

    def reset_states(self) -> None:
        self._elmo_lstm.reset_states()

    def forward(self, inputs: Tensor, word_inputs: Tensor | None = None) -> dict[str, Any]:
        shape = inputs.shape
        flat = inputs.view(-1, *shape[-2:]) if inputs.dim() > 3 else inputs
        words = word_inputs
        if word_inputs is not None and not self._has_cached_vocab:
            log.warning("Word inputs were passed to ELMo but it does not have a cached vocab.")
            words = None
        elif word_inputs is not None and word_inputs.dim() > 2:
            words = word_inputs.view(-1, word_inputs.shape[-1])
        bilm_output = self._elmo_lstm(flat, words)
        layers, mask_with_boundaries = bilm_output["activations"], bilm_output["mask"]
        representations = []
        mask = mask_with_boundaries
        for mix in self._scalar_mixes:
            mixed = mix(layers, mask_with_boundaries)
            if not self._keep_sentence_boundaries:
                mixed, mask = remove_sentence_boundaries(mixed, mask_with_boundaries)
            representations.append(self._dropout(mixed))
        if not self._scalar_mixes and not self._keep_sentence_boundaries:
            mask = remove_sentence_boundaries(layers[0], mask_with_boundaries)[1]
        if word_inputs is not None and word_inputs.dim() > 2:
            outer = word_inputs.shape
        elif inputs.dim() > 3:
            outer = shape[:-1]
        else:
            return {"elmo_representations": representations, "mask": mask}
        if self._keep_sentence_boundaries:
            outer = (*outer[:-1], outer[-1] + 2)
        return {"elmo_representations": [r.view(*outer, -1) for r in representations], "mask": mask.view(outer)}
