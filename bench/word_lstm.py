"""The baseline of the CPU recipe study (#38): a plain word-level LSTM language model in each direction.

One 512-unit LSTM layer per direction over 256-wide word embeddings, the exact (full) softmax over the whole
vocabulary from the LSTM's 512-wide output, Adam, both directions trained in each step on the same stateful
batches the biLM trains on (``LMBatcher``) and scored as the biLM is scored: the full softmax over the same heldout
windows, state carried, the perplexity being exp of the mean of both directions' losses. No characters: a word the
vocab lacks is ``<UNK>`` here as it is in the biLM's targets. ``bench/cpu_recipe.py`` runs it as the recipe
``word-lstm`` under the same clock as every other recipe.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from elmo_core.data.batches import LMBatcher
from elmo_core.precision import autocast, resolve_precision

EMBEDDING_DIM, HIDDEN_DIM = 256, 512


class WordLSTMs(nn.Module):
    """Two independent word LSTM language models, forward and backward; each direction has its own weights."""

    def __init__(self, n_vocab: int, dropout: float) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.embed = nn.ModuleList(nn.Embedding(n_vocab, EMBEDDING_DIM) for _ in range(2))
        self.lstm = nn.ModuleList(nn.LSTM(EMBEDDING_DIM, HIDDEN_DIM, batch_first=True) for _ in range(2))
        self.softmax = nn.ModuleList(nn.Linear(HIDDEN_DIM, n_vocab) for _ in range(2))

    def forward(self, ids: list[Tensor], targets: list[Tensor], state: list[Any] | None) -> tuple[list[Tensor], list]:
        """Each direction's mean loss over its (B, T) targets, and the states to carry to the next window."""
        losses, states = [], []
        for d in range(2):
            x = self.dropout(self.embed[d](ids[d]))
            y, new = self.lstm[d](x, state[d] if state else None)
            logits = self.softmax[d](self.dropout(y)).float()
            losses.append(nn.functional.cross_entropy(logits.flatten(0, 1), targets[d].reshape(-1)))
            states.append(tuple(s.detach() for s in new))
        return losses, states


def _tensors(batch: dict[str, np.ndarray]) -> tuple[list[Tensor], list[Tensor]]:
    ids = [torch.from_numpy(batch["token_ids"]).long(), torch.from_numpy(batch["token_ids_reverse"]).long()]
    targets = [torch.from_numpy(batch["next_token_id"]).long(), torch.from_numpy(batch["next_token_id_reverse"]).long()]
    return ids, targets


class WordLSTMRun:
    """Training and heldout scoring of the baseline, with a checkpoint so a longer budget resumes a shorter one."""

    def __init__(self, data: Path, folder: Path, recipe: dict[str, Any]) -> None:
        torch.manual_seed(recipe.get("seed", 0))
        self.data, self.folder, self.recipe = data, folder, recipe
        n_vocab = len((data / "vocab.txt").read_text(encoding="utf-8").splitlines())
        self.model = WordLSTMs(n_vocab, recipe["dropout"]).train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=recipe["learning_rate"])
        self.batches = LMBatcher(
            data / "token_ids" / "train", recipe["batch_size"], recipe["unroll_steps"], seed=recipe.get("seed", 0)
        )
        self.precision = resolve_precision(recipe["precision"], "cpu")
        self.state: list[Any] | None = None
        self.step_count = 0
        self.tokens_per_step = 2 * recipe["batch_size"] * recipe["unroll_steps"]
        checkpoint = folder / "word_lstm.pt"
        if checkpoint.exists():
            saved = torch.load(checkpoint, weights_only=False)
            self.model.load_state_dict(saved["model"])
            self.optimizer.load_state_dict(saved["optimizer"])
            self.batches.load_state_dict(saved["batches"])
            self.state, self.step_count = saved["state"], saved["step"]
            torch.set_rng_state(saved["rng"])

    def step(self) -> float:
        ids, targets = _tensors(self.batches.next_batch())
        with autocast(torch.device("cpu"), self.precision):
            losses, self.state = self.model(ids, targets, self.state)
        loss = 0.5 * (losses[0] + losses[1])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), self.recipe["clip_norm"])
        self.optimizer.step()
        self.step_count += 1
        return float(loss)

    @torch.no_grad()
    def evaluate(self, max_batches: int | None) -> float:
        """Heldout perplexity as ``elmo_core.train.evaluate`` takes the biLM's: 64-row windows of 20, in order."""
        self.model.eval()
        heldout = self.data / "token_ids" / "heldout"
        from elmo_core.train.evaluate import heldout_rows

        rows = heldout_rows(heldout)
        total, batches, state = 0.0, 0, None
        for batch in LMBatcher(heldout, rows, 20, shuffle=False, loop=False):
            ids, targets = _tensors(batch)
            with autocast(torch.device("cpu"), self.precision):  # the products in bf16 as in training; loss fp32
                losses, state = self.model(ids, targets, state)
            total += 0.5 * float(losses[0] + losses[1])
            batches += 1
            if max_batches and batches >= max_batches:
                break
        self.model.train()
        return math.exp(total / batches)

    def save(self) -> None:
        saved = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "batches": self.batches.state_dict(),
            "state": self.state,
            "step": self.step_count,
            "rng": torch.get_rng_state(),
        }
        torch.save(saved, self.folder / "word_lstm.pt.tmp")
        (self.folder / "word_lstm.pt.tmp").replace(self.folder / "word_lstm.pt")
