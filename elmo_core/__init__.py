"""elmo_core: the ELMo pipeline as a plain library (no Prefect here; MLflow only behind ``tracking``).

Read it in the order data flows, text → Parquet → DuckDB vocab → batches → model → checkpoint → embeddings:

    options   every stage's options, one typed model each (the CLI and the flows are generated from them)
    chars     token → bilm-tf character ids; the special tokens and their ids (the only home of both)
    config    the model config (options.json names) and the published sizes as presets
    tokenize  whitespace / unicode / chinese tokenizers and a sentence splitter
    ingest    corpus files → deduplicated, tokenized Parquet shards + a DuckDB manifest
    vocab     vocab.txt files; vocab, char ids and corpus stats in DuckDB; token ids per split
    batches   bilm-tf's stateful training batches, streamed from Parquet, resumable, sharded by rank
    weights   bilm-tf / AllenNLP weights.hdf5 ⇄ state dict (given a config; never builds a model)
    inference running a biLM over many sentences: length batches, the token cache, the stateful carry
    model     char CNN → highway → projection → clipped LSTMs with residual → biLM → ScalarMix (state explicit)
    softmax   TF's sampled softmax (log-uniform sampler) and the full softmax
    checkpoint training checkpoints with their SHA-256, verified before use
    train     the training loop: setup, step, save/restore, finish; evaluation; DDP
    embed     embedding jobs → a Parquet dataset of token/sentence vectors, one job per folder
    query     DuckDB nearest-neighbour queries over embedding tables
    tracking  the tracker interface (MLflow or nothing) and MLflow model URIs
    corpus    the default corpus (Python's pydoc topics)
    cli       the ``elmo`` command, its flags generated from ``options``

Plumbing below all of them: ``errors`` (one-line user errors), ``fileio`` (atomic writes, digests),
``progress`` (bars, ETA, sinks such as the Prefect UI), ``precision`` (fp32 or bf16), ``packed`` (weights packed
once for oneDNN's CPU products), ``fused_gates`` (the LSTM gate arithmetic as one C loop, built on first use).
"""

from elmo_core.chars import batch_to_ids
from elmo_core.config import ModelConfig
from elmo_core.model import BiLM, ScalarMix

__all__ = ["BiLM", "ModelConfig", "ScalarMix", "batch_to_ids"]
