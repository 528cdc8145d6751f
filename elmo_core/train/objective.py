"""The biLM under training: the model and its loss as one module, so DDP can wrap it.

Both directions' top layers (dropout as bilm-tf applies it) ─► one shared softmax: sampled in training
(``bilm.softmax.sampled_softmax_loss``), or exact where ``sample_softmax`` is off (bilm-tf's option of that
name; ``full_softmax_loss``, as evaluation takes it over the same hidden states).
"""

from __future__ import annotations

from torch import Tensor, nn

from elmo_core.bilm.model import BiLM, LstmState
from elmo_core.bilm.softmax import LogUniformSampler, full_softmax_loss, sampled_softmax_loss
from elmo_core.errors import ConfigError
from elmo_core.text.chars import model_ids


class LMObjective(nn.Module):
    """The biLM plus its training loss, one module so DDP can wrap it."""

    def __init__(self, bilm: BiLM, dropout: float, sparse: bool) -> None:
        super().__init__()
        if bilm.softmax is None:
            raise ConfigError("training needs a softmax: the model config must set n_tokens_vocab")
        self.bilm, self.dropout, self.sparse = bilm, dropout, sparse

    def hidden(self, chars_f: Tensor, chars_b: Tensor, state: LstmState | None) -> tuple[Tensor, Tensor, LstmState]:
        """Raw char ids (B, T, C) of both streams ─► top-layer outputs (B, T, P) each, and the new state."""
        out = self.bilm(model_ids(chars_f), state, backward_inputs=model_ids(chars_b), dropout=self.dropout)
        top_f, top_b = out["activations"][-1].chunk(2, dim=-1)
        if self.training and self.dropout > 0:
            top_f = nn.functional.dropout(top_f, self.dropout)
            top_b = nn.functional.dropout(top_b, self.dropout)
        return top_f, top_b, out["state"]

    def forward(
        self,
        chars_f: Tensor,
        chars_b: Tensor,
        targets_f: Tensor,
        targets_b: Tensor,
        state: LstmState | None,
        sampled: Tensor | None,
        num_tries: int,
        sampler: LogUniformSampler,
    ) -> tuple[Tensor, Tensor, Tensor, LstmState]:
        """The mean loss of both directions, each one's, and the new state; ``sampled`` None: the exact softmax."""
        top_f, top_b, new_state = self.hidden(chars_f, chars_b, state)
        w, b = self.bilm.softmax.weight, self.bilm.softmax.bias

        def loss(top: Tensor, targets: Tensor) -> Tensor:  # float32: under autocast only the logits product is bf16
            hidden, targets = top.reshape(-1, top.shape[-1]), targets.reshape(-1)
            if sampled is None:
                return full_softmax_loss(hidden, targets, w, b)
            return sampled_softmax_loss(hidden, targets, w, b, sampled, num_tries, sampler, self.sparse)

        loss_f, loss_b = loss(top_f, targets_f), loss(top_b, targets_b)
        return 0.5 * (loss_f + loss_b), loss_f, loss_b, new_state
