"""The unit a model process runs: one batch of sentences, from however many requests, in one packed forward pass.

The biLM is stateless here (every sentence starts from zero state) and reads the batch packed, as the batch job
does (``BiLM.token_rows`` over a token table: no padding computed), so a sentence's vectors are what it gets alone,
whatever shares its batch. A word's layer 0 (char CNN, highway, projection) depends on the word alone, so the
process keeps it across batches (``WordVectors``): a call then pays the char CNN only for words it has not seen,
where a lone call would read every highway weight for a handful of words. Each sentence's answer leaves as JSON
text (the value of its ``embedding``), encoded here so that the HTTP process only joins bytes.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch

from elmo_core.bilm.inference import TokenCache
from elmo_core.bilm.model import BiLM
from elmo_core.bilm.scalar_mix import fixed_mix
from elmo_core.cpu import apply_thread_share, describe
from elmo_core.precision import pick_device, resolve_precision
from elmo_core.serve.api import Answer, Batch, Output

log = logging.getLogger(__name__)

WORD_CACHE_BYTES = 64 << 20  # layer-0 vectors kept per model process: 131k words of the small shape, 32k original
WARM_UP = [["The", "first", "call", "pays", "for", "what", "the", "rest", "reuse", "."], ["Warm", "."]]


class WordVectors:
    """Layer 0 of the words a process has seen, least recently used dropped first past ``max_bytes``."""

    def __init__(self, bilm: BiLM, max_bytes: int = WORD_CACHE_BYTES) -> None:
        self.bilm = bilm
        self.rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.capacity = max(1, max_bytes // (bilm.config.lstm.projection_dim * 4))
        self.missed = 0

    def table(self, words: Sequence[str]) -> TokenCache:
        """A token cache of ``words`` (distinct), computing only the ones not kept (``missed`` says how many)."""
        missing = [w for w in words if w not in self.rows]
        self.missed = len(missing)
        if missing:
            for word, row in zip(missing, self.bilm.token_embeddings(missing)):
                self.rows[word] = row
        for word in words:
            self.rows.move_to_end(word)
        while len(self.rows) > max(self.capacity, len(words)):
            self.rows.popitem(last=False)
        return TokenCache(self.bilm, words, torch.stack([self.rows[w] for w in words]))


class BatchEmbedder:
    """One model process's biLM, loaded and warmed once, then batch after batch."""

    def __init__(
        self, model: str | Path, weight_file: str | None = None, device: str = "auto", precision: str = "fp32"
    ) -> None:
        apply_thread_share()  # this process's share of the cores (``/info`` reports its threads)
        self.device = pick_device(device)
        self.precision = resolve_precision(precision, self.device)
        self.bilm = BiLM.from_pretrained(str(model), weight_file, device=self.device, precision=self.precision)
        self.words = WordVectors(self.bilm)

    def warm_up(self) -> float:
        """One call before the first request (kernels compiled or chosen, buffers sized); returns its seconds."""
        started = time.perf_counter()
        self.run(Batch(0, WARM_UP, [0, 0], [Output()]))
        return time.perf_counter() - started

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "device": str(self.device),
            "precision": str(self.precision),
            "precision_why": self.precision.why,
            "kernels": str(self.bilm.kernels),
            "threads": torch.get_num_threads(),
            "layers": self.bilm.num_layers,
            "dim": self.bilm.output_dim,
            "cpu": describe(),
        }

    def _mix(self, spec: Output) -> torch.Tensor:
        """γ · softmax(w) of a request's mix, (L+1,): made per batch for each output asked (a few numbers; kept
        nowhere, so clients sending ever new weights grow nothing)."""
        return fixed_mix(self.bilm.num_layers, spec.mix_weights, spec.gamma).weights().detach().to(self.device)

    @torch.no_grad()
    def run(self, batch: Batch) -> Answer:
        """Every sentence of the batch in one packed forward pass, each answer shaped and encoded as its request
        asked."""
        started = time.perf_counter()
        shapes: list[tuple[int, ...]] = []
        embeddings: list[bytes] = []
        if not batch.sentences:
            return Answer(batch.id, shapes, embeddings, 0.0)
        cache = self.words.table(sorted({token for sentence in batch.sentences for token in sentence}))
        ids = cache.ids(batch.sentences).to(self.device)
        layers, counts, _ = self.bilm.token_rows(ids, token_table=cache.table.to(self.device))
        stacked = torch.stack([layer.float() for layer in layers])  # (L+1, N, 2P), sentence after sentence
        mixes = [self._mix(spec) if spec.kind != "layers" else None for spec in batch.specs]
        start = 0
        for i, n in enumerate(counts.tolist()):
            spec, mix = batch.specs[batch.outputs[i]], mixes[batch.outputs[i]]
            array = self._shape(stacked[:, start : start + n], spec, mix)
            start += n
            shapes.append(array.shape)
            embeddings.append(encode(array, spec))
        return Answer(batch.id, shapes, embeddings, time.perf_counter() - started, len(cache.words), self.words.missed)

    @staticmethod
    def _shape(layers: torch.Tensor, spec: Output, mix: torch.Tensor | None) -> np.ndarray:
        if mix is None:  # every layer
            return layers.cpu().numpy()
        mixed = (mix[:, None, None] * layers).sum(0)  # as the batch job mixes (vectors/embed.py)
        if spec.kind == "mean":
            mixed = mixed.mean(0)
        return mixed.cpu().numpy()


def encode(array: np.ndarray, spec: Output) -> bytes:
    """An embedding as its request asked: JSON text (nested lists, each float32 in its shortest form that reads back
    exactly, or float16 rounded; orjson writes them 20x as fast as ``json.dumps(array.tolist())``, whose 17-digit
    doubles made answers twice as long), a base64 string of its bytes, or the raw little-endian bytes (``binary``).
    ``normalize``: each vector (the last axis) divided by its L2 norm first, as OpenAI's are unit length."""
    if spec.normalize:
        norms = np.linalg.norm(array, axis=-1, keepdims=True)
        array = array / np.maximum(norms, np.finfo(np.float32).tiny)
    typed = np.ascontiguousarray(array, dtype="<f2" if spec.dtype == "float16" else "<f4")
    if spec.encoding == "binary":
        return typed.tobytes()
    if spec.encoding == "base64":
        return b'"' + base64.b64encode(typed.tobytes()) + b'"'
    return orjson.dumps(typed, option=orjson.OPT_SERIALIZE_NUMPY)
