"""The biLM's parameters under AllenNLP's names and layouts, both ways: what lets a state dict saved from a model
that holds AllenNLP's ``Elmo`` load into ours with ``strict=True``, and ours load into AllenNLP's.

AllenNLP's ``_ElmoBiLm`` keys (relative to it) and how each maps onto ``BiLM``'s:

    _token_embedder._char_embedding_weights              token_encoder.char_cnn.char_embedding.weight   (same)
    _token_embedder.char_conv_{i}.weight / .bias         token_encoder.char_cnn.convs.{i}.weight / .bias (same)
    _token_embedder._highways._layers.{k}.weight / .bias [W_transform; −W_carry] / [b_transform; −b_carry]:
        AllenNLP's highway gates x with σ(·) where TensorFlow gates the transform, so the carry half is negated
    _token_embedder._projection.weight / .bias           token_encoder.projection.weight / .bias         (same)
    _elmo_lstm.{forward,backward}_layer_{i}.input_linearity.weight   lstm.{forward,backward}_layers.{i}.weight_ih_l0
                                            state_linearity.weight   weight_hh_l0
                                            state_linearity.bias     bias_ih_l0 + bias_hh_l0 (the forget +1 in it)
                                            state_projection.weight  weight_hr_l0

Gate order is i, f, g, o in both. Going back, ``bias_hh_l0`` stays the frozen forget-gate +1 and ``bias_ih_l0`` takes
the rest of AllenNLP's bias, so a fine-tuned bias survives exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from elmo_core.bilm.weights import forget_gate_bias
from elmo_core.config import ModelConfig
from elmo_core.errors import WeightFileError

OURS_ENCODER = "token_encoder."
OURS_LSTM = "lstm."


def _lstm_pairs(config: ModelConfig) -> list[tuple[str, str]]:
    """(AllenNLP prefix, our prefix) of every LSTM layer and direction."""
    return [
        (f"_elmo_lstm.{name}_layer_{i}.", f"{OURS_LSTM}{name}_layers.{i}.")
        for name in ("forward", "backward")
        for i in range(config.lstm.n_layers)
    ]


def to_allennlp(ours: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """A ``BiLM`` state dict (softmax left out) ─► ``_ElmoBiLm``'s keys and layouts."""
    if config.char_cnn.n_filters == config.lstm.projection_dim:
        raise WeightFileError("AllenNLP's ELMo always has a token projection; this model has none (n_filters == P)")
    out = {"_token_embedder._char_embedding_weights": ours[f"{OURS_ENCODER}char_cnn.char_embedding.weight"]}
    for i in range(len(config.char_cnn.filters)):
        for kind in ("weight", "bias"):
            out[f"_token_embedder.char_conv_{i}.{kind}"] = ours[f"{OURS_ENCODER}char_cnn.convs.{i}.{kind}"]
    for k in range(config.char_cnn.n_highway):
        highway = f"{OURS_ENCODER}highways.{k}."
        for kind in ("weight", "bias"):
            out[f"_token_embedder._highways._layers.{k}.{kind}"] = torch.cat(
                [ours[f"{highway}transform.{kind}"], -ours[f"{highway}carry.{kind}"]]
            )
    for kind in ("weight", "bias"):
        out[f"_token_embedder._projection.{kind}"] = ours[f"{OURS_ENCODER}projection.{kind}"]
    for theirs, mine in _lstm_pairs(config):
        out[f"{theirs}input_linearity.weight"] = ours[f"{mine}weight_ih_l0"]
        out[f"{theirs}state_linearity.weight"] = ours[f"{mine}weight_hh_l0"]
        out[f"{theirs}state_linearity.bias"] = ours[f"{mine}bias_ih_l0"] + ours[f"{mine}bias_hh_l0"]
        out[f"{theirs}state_projection.weight"] = ours[f"{mine}weight_hr_l0"]
    return out


def from_allennlp(theirs: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """``_ElmoBiLm``'s keys ─► a ``BiLM`` state dict (without a softmax). Raises KeyError on a missing key."""
    ours = {f"{OURS_ENCODER}char_cnn.char_embedding.weight": theirs["_token_embedder._char_embedding_weights"]}
    for i in range(len(config.char_cnn.filters)):
        for kind in ("weight", "bias"):
            ours[f"{OURS_ENCODER}char_cnn.convs.{i}.{kind}"] = theirs[f"_token_embedder.char_conv_{i}.{kind}"]
    width = config.char_cnn.n_filters
    for k in range(config.char_cnn.n_highway):
        highway = f"{OURS_ENCODER}highways.{k}."
        for kind in ("weight", "bias"):
            transform, negated_carry = theirs[f"_token_embedder._highways._layers.{k}.{kind}"].split(width)
            ours[f"{highway}transform.{kind}"], ours[f"{highway}carry.{kind}"] = transform, -negated_carry
    for kind in ("weight", "bias"):
        ours[f"{OURS_ENCODER}projection.{kind}"] = theirs[f"_token_embedder._projection.{kind}"]
    forget = forget_gate_bias(config.lstm.dim)
    for their_prefix, mine in _lstm_pairs(config):
        ours[f"{mine}weight_ih_l0"] = theirs[f"{their_prefix}input_linearity.weight"]
        ours[f"{mine}weight_hh_l0"] = theirs[f"{their_prefix}state_linearity.weight"]
        bias = theirs[f"{their_prefix}state_linearity.bias"]
        ours[f"{mine}bias_ih_l0"] = bias - forget.to(bias)
        ours[f"{mine}bias_hh_l0"] = forget.to(bias)
        ours[f"{mine}weight_hr_l0"] = theirs[f"{their_prefix}state_projection.weight"]
    return ours


def allennlp_keys(config: ModelConfig) -> list[str]:
    """Every key ``_ElmoBiLm`` has for a model of ``config``."""
    keys = ["_token_embedder._char_embedding_weights"]
    keys += [
        f"_token_embedder.char_conv_{i}.{k}" for i in range(len(config.char_cnn.filters)) for k in ("weight", "bias")
    ]
    keys += [
        f"_token_embedder._highways._layers.{k}.{w}"
        for k in range(config.char_cnn.n_highway)
        for w in ("weight", "bias")
    ]
    keys += ["_token_embedder._projection.weight", "_token_embedder._projection.bias"]
    for prefix, _ in _lstm_pairs(config):
        keys += [
            f"{prefix}{name}"
            for name in (
                "input_linearity.weight",
                "state_linearity.weight",
                "state_linearity.bias",
                "state_projection.weight",
            )
        ]
    return keys
