"""elmo_core: the ELMo pipeline as a plain library (no Prefect here).

Read it in the order data flows:

    chars    token → bilm-tf character ids (the only module that knows the id conventions)
    config   typed model config (options.json names) and the published presets
    vocab    vocab.txt files
    model    char CNN → highway → projection → clipped LSTMs with residual → biLM → ScalarMix
    weights  bilm-tf / AllenNLP options.json + weights.hdf5 ⇄ BiLM
    cli      the ``elmo`` command
"""

from elmo_core.chars import batch_to_ids
from elmo_core.config import ModelConfig
from elmo_core.model import BiLM, ScalarMix

__all__ = ["BiLM", "ModelConfig", "ScalarMix", "batch_to_ids"]
