"""elmo_core: the ELMo pipeline as a plain library (no Prefect here; MLflow only behind ``tracking``).

Read it in the order data flows, text → Parquet → DuckDB vocab → batches → model → checkpoint → embeddings:

    chars     token → bilm-tf character ids (the only module that knows the id conventions)
    config    typed model config (options.json names) and the published presets
    tokenize  whitespace / unicode / chinese tokenizers and a sentence splitter
    ingest    corpus files → deduplicated, tokenized Parquet shards + a DuckDB manifest
    vocab     vocab.txt files; vocab, char ids and corpus stats in DuckDB; token ids per split
    batches   bilm-tf's stateful training batches, streamed from Parquet, resumable, sharded by rank
    model     char CNN → highway → projection → clipped LSTMs with residual → biLM → ScalarMix
    weights   bilm-tf / AllenNLP options.json + weights.hdf5 ⇄ BiLM
    softmax   TF's sampled softmax (log-uniform sampler) and the full softmax
    train     the training loop: checkpoints, exact resume, evaluation, DDP
    embed     batch embedding jobs → Parquet token/sentence vectors
    query     DuckDB nearest-neighbour queries over embedding tables
    tracking  the tracker interface (MLflow or nothing) and MLflow model URIs
    corpus    the default corpus (Python's pydoc topics)
    cli       the ``elmo`` command
"""

from elmo_core.chars import batch_to_ids
from elmo_core.config import ModelConfig
from elmo_core.model import BiLM, ScalarMix

__all__ = ["BiLM", "ModelConfig", "ScalarMix", "batch_to_ids"]
