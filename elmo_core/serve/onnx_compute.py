"""The unit a model process runs when the model is an ``elmo onnx`` file: one batch of sentences in one ONNX Runtime
run, on the CPU, in float32, in a process that never imports torch (``elmo serve FILE.onnx``: a serving image
needs neither torch nor the C kernels).

The same contract as ``compute.BatchEmbedder`` (``warm_up``, ``info``, ``run``), and the same answers: a sentence's
layers are the file's (equal to the runtime's within 1e-5, ``tests/test_onnx.py``), its mix γ·softmax(w)·layers
and its mean over tokens computed here as the runtime's ``Output`` computes them (``encode.Computed`` encodes them).
Like the runtime, the process keeps each word's layer 0 (``OnnxWords``), so a word pays the token encoder once.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import numpy as np

from elmo_core import cpu
from elmo_core.defaults import WORD_CACHE_BYTES
from elmo_core.runtime.reference import ModelRef
from elmo_core.serve.api import Batch, Output
from elmo_core.serve.encode import EMPTY, Computed
from elmo_core.text.chars import MAX_CHARS, tokens_to_char_array
from elmo_core.text.manylangs_chars import ONNX_METADATA_KEY, Dictionaries
from elmo_core.word_rows import WordRows

log = logging.getLogger(__name__)

WARM_UP = [["The", "first", "call", "pays", "for", "what", "the", "rest", "reuse", "."], ["Warm", "."]]
CHAR_IDS, TOKEN_EMBEDDINGS = "char_ids", "token_embeddings"  # the file's inputs (``bilm.onnx_export``, torch-free here)
NEW_WORDS_A_RUN = 1024  # new words run as one-token sentences, this many a run


def char_ids(sentences: list[list[str]], dictionaries: Dictionaries | None = None) -> np.ndarray:
    """(B, T, 50) int64, AllenNLP's ``batch_to_ids`` without torch: the file's input; a ManyLangs model's file takes
    the rows of its own dictionaries (B, T, 51), which it carries."""
    width = dictionaries.width if dictionaries is not None else MAX_CHARS
    ids = np.zeros((len(sentences), max(map(len, sentences)), width), dtype=np.int64)
    for row, sentence in enumerate(sentences):
        if sentence:
            ids[row, : len(sentence)] = dictionaries.rows(sentence) if dictionaries else tokens_to_char_array(sentence)
    return ids


def mix_factors(spec: Output, n_layers: int) -> np.ndarray:
    """γ · softmax(w) (L+1,), the runtime's ``Output.factors``; no weights: the plain average."""
    weights = np.zeros(n_layers) if spec.mix_weights is None else np.asarray(spec.mix_weights, dtype=np.float64)
    if weights.shape != (n_layers,):
        raise ValueError(f"mix_weights: {len(weights)} given, the model has {n_layers} layers")
    exp = np.exp(weights - weights.max())
    return (spec.gamma * exp / exp.sum()).astype(np.float32)


def shaped(layers: np.ndarray, spec: Output) -> np.ndarray:
    """One sentence's (L+1, n, 2P) as its request asked: every layer, the mix (n, 2P), or the mix's mean (2P,)."""
    if spec.kind == "layers":
        return layers
    mix = (mix_factors(spec, layers.shape[0])[:, None, None] * layers).sum(0)
    return mix if spec.kind == "mix" else mix.sum(0) / max(mix.shape[0], 1)


PADDING = 1.25  # a run's padded tokens at most this many times its real ones (a run of one sentence has none)


def similar_lengths(lengths: list[int]) -> list[list[int]]:
    """The batch's sentences in runs of similar length, shortest first: the file computes every padded position
    (the runtime packs them away), so one long sentence among short ones would multiply a run's work."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    tokens = 0
    for i in order:
        n = max(lengths[i], 1)
        if groups and n * (len(groups[-1]) + 1) <= PADDING * (tokens + n):
            groups[-1].append(i)
            tokens += n
        else:
            groups.append([i])
            tokens = n
    return groups


class OnnxWords:
    """Layer 0 of the words this process has seen, as the file gave it (the first P columns of ``layers[0]``), least
    recently used dropped first past ``max_bytes``, never a word of the batch at hand: the runtime's ``WordCache``
    without torch (the two share ``word_rows.WordRows``). The token encoder is about half of a run of short
    sentences (``bilm.onnx_export``), and the torch server pays it only for words it has not seen; so a batch's new
    words run first, each as a sentence of its own (a word's layer 0 depends on the word alone), and every run of the
    batch then passes its rows as the file's optional ``token_embeddings``, which skips the encoder."""

    def __init__(self, session: Any, dictionaries: Dictionaries | None, dim: int, max_bytes: int) -> None:
        self.session, self.dictionaries, self.dim = session, dictionaries, dim
        self.capacity = max(1, max_bytes // (4 * dim))
        self.rows: WordRows[np.ndarray] = WordRows()

    def learn(self, words: list[str]) -> int:
        """Keeps every one of ``words`` (distinct), computing those not kept; returns how many were computed."""
        missing = self.rows.missing(words)
        for start in range(0, len(missing), NEW_WORDS_A_RUN):
            chunk = missing[start : start + NEW_WORDS_A_RUN]
            layers, _ = self.session.run(None, {CHAR_IDS: char_ids([[word] for word in chunk], self.dictionaries)})
            self.rows.add(chunk, (row.copy() for row in layers[0, :, 0, : self.dim]))  # a view keeps the whole run
        self.rows.keep(words, self.capacity)
        return len(missing)

    def embeddings(self, sentences: list[list[str]]) -> np.ndarray:
        """(B, T, P) float32 of sentences whose words are all kept, zeros at padding."""
        table = np.zeros((len(sentences), max(map(len, sentences)), self.dim), dtype=np.float32)
        for row, sentence in enumerate(sentences):
            if sentence:
                table[row, : len(sentence)] = np.stack([self.rows[word] for word in sentence])
        return table


class OnnxEmbedder:
    """One model process's ONNX Runtime session, opened and warmed once, then batch after batch."""

    def __init__(self, model: ModelRef, max_batch_tokens: int) -> None:
        import onnxruntime

        self.model, self.max_batch_tokens = model, max_batch_tokens
        options = onnxruntime.SessionOptions()
        self.threads = cpu.thread_share() or os.cpu_count() or 1  # this process's share of the cores
        options.intra_op_num_threads, options.inter_op_num_threads = self.threads, 1
        # errors only: ONNX Runtime warns at every load that an input with a default (``token_embeddings``) is no
        # constant, which is what makes it optional (docs/onnx.md)
        options.log_severity_level = 3
        self.session = onnxruntime.InferenceSession(str(model.options), options, providers=["CPUExecutionProvider"])
        self.version = onnxruntime.__version__
        carried = self.session.get_modelmeta().custom_metadata_map.get(ONNX_METADATA_KEY)
        self.dictionaries = Dictionaries.from_state(json.loads(carried), str(model.options)) if carried else None
        self.n_layers = int(self.session.get_outputs()[0].shape[0])
        self.width = int(self.session.get_outputs()[0].shape[-1])
        self.words = OnnxWords(self.session, self.dictionaries, self.width // 2, WORD_CACHE_BYTES)
        log.info("%s", self.line())

    def line(self) -> str:
        return (
            f"{self.model.line()}; ONNX Runtime {self.version}, CPU, fp32, {self.threads} threads, "
            f"batches of at most {self.max_batch_tokens:,} tokens"
        )

    def warm_up(self) -> float:
        started = time.perf_counter()
        self.run(Batch(0, WARM_UP, [0, 0], [Output()]))
        return time.perf_counter() - started

    def info(self) -> dict[str, Any]:
        """The runtime's facts (``Runtime.facts``), as this process has them."""
        return {
            "pid": os.getpid(),
            "model": self.model.name,
            "model_id": self.model.model_id,
            "identity": self.model.identity(),
            "origin": self.model.origin,
            "device": "cpu",
            "precision": "fp32",
            "precision_why": "an ONNX file runs in ONNX Runtime's CPU provider, in float32",
            "threads": self.threads,
            "kernels": f"onnxruntime {self.version} CPU provider (torch not loaded)",
            "layers": self.n_layers,
            "dim": self.width,
            "max_batch_tokens": self.max_batch_tokens,
            "cpu": f"CPU {cpu.facts().line()}",  # (cpu.describe names torch's kernels: it would import torch)
            "line": self.line(),
        }

    def run(self, batch: Batch) -> Computed:
        """Every sentence of the batch in one run of the file, each shaped as its request asked."""
        started = time.perf_counter()
        arrays: list[np.ndarray] = [EMPTY] * len(batch.sentences)
        if not batch.sentences:
            return Computed(batch.id, arrays, 0.0)
        words = list(dict.fromkeys(token for sentence in batch.sentences for token in sentence))
        new_words = self.words.learn(words)
        for group in similar_lengths([len(s) for s in batch.sentences]):
            sentences = [batch.sentences[i] for i in group]
            if any(sentences):
                feed = {
                    CHAR_IDS: char_ids(sentences, self.dictionaries),
                    TOKEN_EMBEDDINGS: self.words.embeddings(sentences),
                }
                layers, _ = self.session.run(None, feed)
            else:  # only empty sentences: nothing for the file to run
                layers = np.zeros((self.n_layers, len(group), 0, self.width), dtype=np.float32)
            for row, i in enumerate(group):
                arrays[i] = shaped(layers[:, row, : len(batch.sentences[i])], batch.specs[batch.outputs[i]])
        return Computed(batch.id, arrays, time.perf_counter() - started, len(words), new_words)
