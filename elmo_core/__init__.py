"""elmo_core: the ELMo pipeline as a plain library (no Prefect here; MLflow only behind ``tracking``).

Read it in the order data flows, text → Parquet → DuckDB vocab → batches → model → checkpoint → embeddings:

    options    every stage's options, one typed model each (the CLI and the flows are generated from them)
    chars      token → bilm-tf character ids; the special tokens and their ids (the only home of both)
    config     the model config (options.json names) and the published sizes as presets
    tokenize   whitespace / unicode / chinese tokenizers and a sentence splitter
    wordnet    WordNet 3.0's sense-annotated examples (the word-sense probe's default data)
    vocab_file bilm-tf's vocab.txt (read and written without DuckDB)
    ingest/    corpus files → deduplicated, tokenized Parquet shards + a DuckDB manifest:
               inputs (which files) → readers (records, lines) → shards (one per file) → manifest → run
    vocab      vocab, char ids and corpus stats in DuckDB; token ids per split
    batches    bilm-tf's stateful training batches, streamed from Parquet, resumable, sharded by rank
    prefetch   those batches made ahead of the step by a background thread, the position kept exact
    weights    bilm-tf / AllenNLP weights.hdf5 ⇄ state dict (given a config; never builds a model)
    inference  running a biLM over many sentences: batches, the token cache, the stateful carry, the one loop
    lstm_math  TensorFlow's LSTMCell arithmetic, once: the reference the model runs and the kernels match
    kernels/   the CPU's speed kernels, of inference and of training, and the choice of them (cache, packed,
               int8, fused_gates + lstm_gates.c, trained_step, char_cnn + char_cnn.c, cells, choice)
    packing    where each token of a batch sits in packed, time-major LSTM data, and back to a layout
    model      char CNN → highway → projection → clipped LSTMs with residual → biLM → ScalarMix (one forward path)
    manylangs  ELMoForManyLangs' released folders read (and converted once) as models; fine_tune: a model made
               ready for a corpus's vocabulary (a fresh softmax; a ManyLangs model's dictionaries grown)
    softmax    TF's sampled softmax (log-uniform sampler) and the full softmax
    runtime/   how a model runs in a process, decided once: reference (folders, published files, ManyLangs
               releases, MLflow URIs through one download cache), placement (device, precision, threads), output
               (layers, mix, mean), engine (``Runtime``: word cache, passes under a token budget), info
    checkpoint training checkpoints (one record per rank; the best weights) with their SHA-256, verified before use
    train      the training plan (device, precision, kernels, recipe, budget), the loop (setup, train_step,
               save/restore, finish), evaluation, DDP
    launch     training on several processes: torch.distributed.run started and owned by the train stage
    embed      embedding jobs → a Parquet dataset of token/sentence vectors, one job per folder
    tables     a table that follows a model: a version per model version, switched atomically (``elmo refresh``)
    probe      what each layer is worth: word-sense 1-NN and a linear tagging probe
    ann        the nearest-neighbour index beside an embedding table (faiss shards, exact re-ranking, a key map)
    query      nearest-neighbour queries over embedding tables: through the index, else a DuckDB scan
    corpus     the default corpus (Python's pydoc topics)
    mlflow_model  an exported model as an MLflow pyfunc model
    promote    ``@champion`` by evidence; ``lineage`` a training's data as MLflow datasets
    onnx_export, onnx_file  the biLM as one ONNX file (``elmo onnx``), which ``elmo serve`` runs without torch
    allennlp/  the drop-in for AllenNLP's ELMo: Elmo, ElmoEmbedder, their state-dict keys, install()
    cli        the ``elmo`` command, its flags generated from ``options``

Plumbing below all of them: ``errors`` (one-line user errors), ``cpu`` (what this CPU can do, and the
``ELMO_CPU_ISA=avx2`` override, applied here before torch is imported), ``fileio`` (atomic writes, digests),
``progress`` (bars, ETA, sinks such as the Prefect UI), ``precision`` (the device; fp32, bf16, or int8 for CPU
inference), ``ranks`` (which process of a torchrun launch this is), ``tracking`` (MLflow behind a small
interface: runs, metrics, model URIs), ``events`` (Prefect behind one function: a promotion announced).
``tests/test_layering.py`` keeps every import pointing down this list. Importing the package loads nothing but
``cpu``; ``BiLM`` and ``batch_to_ids`` load torch and the model on first use, never DuckDB, pyarrow, Prefect or
MLflow.
"""

from elmo_core import cpu

cpu.limit_torch()  # before anything imports torch: ELMO_CPU_ISA=avx2 holds torch's own kernels to AVX2 too

# loaded on first use (PEP 562), so that ``elmo --help`` and a bad flag answer without loading torch
_EXPORTS = {"BiLM": "bilm.model", "ScalarMix": "bilm.scalar_mix", "ModelConfig": "config", "batch_to_ids": "text.chars"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'elmo_core' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"elmo_core.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
