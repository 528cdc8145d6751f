"""A fresh biLM's weights as bilm-tf initializes them for training (docs/elmo-format.md §6)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from elmo_core.bilm.model import BiLM
from elmo_core.bilm.weights import forget_gate_bias
from elmo_core.config import ModelConfig
from elmo_core.text.chars import BOS_ID, EOS_ID


def init_bilm_tf(model: BiLM, unigram_counts: np.ndarray | None = None) -> None:
    """Initialise a fresh model as bilm-tf does before training (the softmax bias from ``unigram_counts`` if given:
    ``init_softmax``)."""
    cfg = model.config
    enc = model.token_encoder
    with torch.no_grad():
        nn.init.uniform_(enc.char_cnn.char_embedding.weight, -1.0, 1.0)
        enc.char_cnn.char_embedding.weight[0].zero_()
        for (width, _), conv in zip(cfg.char_cnn.filters, enc.char_cnn.convs):
            if cfg.char_cnn.activation == "relu":
                nn.init.uniform_(conv.weight, -0.05, 0.05)
            else:
                nn.init.normal_(conv.weight, 0.0, math.sqrt(1.0 / (width * cfg.char_cnn.embedding.dim)))
            conv.bias.zero_()
        std = math.sqrt(1.0 / cfg.char_cnn.n_filters)
        for highway in enc.highways:
            nn.init.normal_(highway.carry.weight, 0.0, std)
            nn.init.normal_(highway.transform.weight, 0.0, std)
            highway.carry.bias.fill_(-2.0)
            highway.transform.bias.zero_()
        if enc.projection is not None:
            nn.init.normal_(enc.projection.weight, 0.0, std)
            enc.projection.bias.zero_()
        for lstm in model.lstm.all_layers():
            # TF's default kernel init is Glorot-uniform over the fused [input; recurrent] kernel
            fan_in = lstm.input_size + (lstm.proj_size or lstm.hidden_size)
            bound = math.sqrt(6.0 / (fan_in + 4 * lstm.hidden_size))
            nn.init.uniform_(lstm.weight_ih_l0, -bound, bound)
            nn.init.uniform_(lstm.weight_hh_l0, -bound, bound)
            if lstm.proj_size > 0:
                bound_p = math.sqrt(6.0 / (lstm.hidden_size + lstm.proj_size))
                nn.init.uniform_(lstm.weight_hr_l0, -bound_p, bound_p)
            lstm.bias_ih_l0.zero_()
            lstm.bias_hh_l0.copy_(forget_gate_bias(lstm.hidden_size))
    init_softmax(model, unigram_counts)


def init_softmax(model: BiLM, unigram_counts: np.ndarray | None = None) -> None:
    """bilm-tf's softmax init, N(0, 1/sqrt(P)) weights and zero bias (also for a new vocabulary when fine-tuning).

    Given the train split's count of each word as a target (``softmax_bias_init: unigram``), the bias starts at each
    word's add-one log frequency instead, so the untrained model is the unigram model. Why: a sampled softmax pushes
    down only the rows it samples, and a short run samples a rare word's row seldom; from a zero bias such rows keep
    logits as high as a common word's, and the full softmax (heldout evaluation, any use of the model's
    probabilities) spreads mass over them."""
    if model.softmax is None:
        return
    with torch.no_grad():
        nn.init.normal_(model.softmax.weight, 0.0, 1.0 / math.sqrt(model.config.lstm.projection_dim))
        if unigram_counts is None:
            model.softmax.bias.zero_()
            return
        counts = torch.tensor(unigram_counts, dtype=torch.float64)
        counts[BOS_ID] = counts[EOS_ID]  # <S> ends the backward direction's sentences as </S> ends the forward one's
        model.softmax.bias.copy_(torch.log((counts + 1.0) / (counts.sum() + len(counts))))


def random_model(config: ModelConfig, out: Path, seed: int = 0) -> Path:
    """A model of ``config`` with bilm-tf's initial weights, written to ``out`` (``elmo demo`` without a model)."""
    torch.manual_seed(seed)
    fresh = BiLM(config)
    init_bilm_tf(fresh)
    fresh.save_pretrained(str(out))
    return out
