"""A model made ready to fine-tune on a corpus's vocabulary: the same network with a fresh softmax over that
vocabulary, and for an ELMoForManyLangs model its dictionaries kept and grown by the corpus's new words.

    fresh = for_vocabulary(bilm, vocab, unigram_counts)   # what the trainer starts from when ``init_from`` is given

An ELMoForManyLangs model reads a word's row of its word table beside the char CNN (``text.manylangs_chars``):
a word it never saw would read ``<oov>``'s row, so each new word (and each new character) gets a row of its own,
appended after the published ones and initialised as their trainer initialises its tables (uniform in ±0.25, then
each row scaled to unit length). The published rows, and so the published numbers of known words, stay as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from elmo_core.bilm.initialization import init_softmax
from elmo_core.bilm.model import BiLM
from elmo_core.text.chars import SPECIAL_TOKENS

log = logging.getLogger(__name__)

CHAR_TABLE = "token_encoder.char_cnn.char_embedding.weight"
WORD_TABLE = "token_encoder.word_embedding.weight"


def their_rows(n: int, dim: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` new rows as ELMoForManyLangs' trainer makes a table: uniform in ±0.25, each row then of length 1."""
    rows = torch.rand(n, dim, generator=generator) * 0.5 - 0.25
    return rows / rows.norm(dim=1, keepdim=True).clamp(min=1e-12)


def for_vocabulary(bilm: BiLM, vocab: Sequence[str], unigram_counts: np.ndarray | None = None, seed: int = 0) -> BiLM:
    """A copy of ``bilm`` on its device, in training mode, with a fresh softmax over ``vocab`` (``init_softmax``: a
    bilm-tf model gets what the trainer gave it before, to the random draw); an ELMoForManyLangs model's dictionaries
    grow by ``vocab``'s new words and characters, with new rows in its tables."""
    config = bilm.config.model_copy(update={"n_tokens_vocab": len(vocab)})
    state = {k: v.detach().cpu() for k, v in bilm.state_dict().items() if not k.startswith("softmax.")}
    dics = bilm.dictionaries
    if dics is not None and config.manylangs is not None:
        grown, new_words, new_chars = dics.with_words(w for w in vocab if w not in SPECIAL_TOKENS)
        ml = config.manylangs
        n_words = grown.n_words if ml.word_dim else 0
        config = config.model_copy(
            update={"manylangs": ml.model_copy(update={"n_characters": grown.n_chars, "n_words": n_words})}
        )
        generator = torch.Generator().manual_seed(seed)
        chars = state[CHAR_TABLE]
        state[CHAR_TABLE] = torch.cat([chars, their_rows(grown.n_chars + 1 - len(chars), chars.shape[1], generator)])
        if ml.word_dim:
            words = state[WORD_TABLE]
            state[WORD_TABLE] = torch.cat([words, their_rows(grown.n_words - len(words), words.shape[1], generator)])
        log.info(
            "fine-tuning an ELMoForManyLangs model: its dictionaries kept, %d new words and %d new characters added",
            new_words,
            new_chars,
        )
        dics = grown
    fresh = BiLM(config, vocab=list(vocab), dics=dics)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.startswith("softmax.")]:
        raise RuntimeError(f"the model's weights do not fit its copy: missing {missing}, unexpected {unexpected}")
    init_softmax(fresh, unigram_counts)
    return fresh.to(bilm.device)  # in training mode, as a model built to train
