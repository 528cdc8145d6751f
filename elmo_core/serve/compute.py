"""The unit a model process runs: one batch of sentences, from however many requests, in one packed forward pass.

The model runs through the runtime (``elmo_core.runtime.Runtime``), as the batch job's does: resolved, placed and
prepared once per process, every sentence from zero state over the runtime's word cache (a word's layer 0 is kept
across batches, so a call pays the char CNN only for words it has not seen), and shaped by the runtime's output
description, so a sentence's vectors are what ``elmo embed`` writes for it, whatever shares its batch. Each
sentence's answer leaves as an array (``encode.Computed``): the process's answer thread encodes it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np
import torch

from elmo_core.bilm.inference import sentence_slices
from elmo_core.precision import Precision
from elmo_core.runtime import Output as Shape
from elmo_core.runtime import Placement, Runtime
from elmo_core.runtime.engine import WARM_UP
from elmo_core.runtime.reference import ModelRef
from elmo_core.serve.api import Batch, Output
from elmo_core.serve.encode import EMPTY, Computed

log = logging.getLogger(__name__)

SHAPES = {"layers": ("all", "none"), "mix": ("mix", "none"), "mean": ("mix", "mean")}  # a request's kind, as the
# runtime's output description: (layers, pool)


class BatchEmbedder:
    """One model process's runtime, opened and warmed once, then batch after batch."""

    def __init__(self, model: ModelRef, device: str, precision: str, why: str, max_batch_tokens: int) -> None:
        """``model``: the exact model the HTTP process resolved (never resolved again here); ``device``,
        ``precision`` and ``why``: the placement decided before the port was bound (not decided again here);
        ``max_batch_tokens``: the batcher's budget, the most a batch it sends can hold, so the runtime's line names
        it."""
        placement = Placement(device, Precision(precision, torch.device(device).type, why))
        self.runtime = Runtime.open(model, placement=placement, max_batch_tokens=max_batch_tokens)

    def warm_up(self) -> float:
        """One call before the first request (kernels compiled or chosen, buffers sized); returns its seconds."""
        started = time.perf_counter()
        self.run(Batch(0, WARM_UP, [0, 0], [Output()]))
        return time.perf_counter() - started

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), **self.runtime.facts(), "line": self.runtime.line()}

    @torch.no_grad()
    def run(self, batch: Batch) -> Computed:
        """Every sentence of the batch in one packed pass through the runtime, each shaped as its request asked."""
        started = time.perf_counter()
        arrays: list[np.ndarray] = [EMPTY] * len(batch.sentences)
        if not batch.sentences:
            return Computed(batch.id, arrays, 0.0)
        runtime = self.runtime
        described = [Shape.of(*SHAPES[spec.kind], spec.mix_weights, spec.gamma) for spec in batch.specs]
        factors = [d.factors(runtime.num_layers) if d.layers == "mix" else None for d in described]
        one_pass = [list(range(len(batch.sentences)))]  # the batcher chose which sentences share this pass
        for indices, stacked, counts in runtime.run(batch.sentences, one_pass):
            for i, rows in zip(indices, sentence_slices(counts)):
                k = batch.outputs[i]
                shaped = described[k].apply(stacked[:, rows], counts.new_tensor([rows.stop - rows.start]), factors[k])
                arrays[i] = described[k].of_sentence(shaped).cpu().numpy()
        distinct = len({token for sentence in batch.sentences for token in sentence})
        return Computed(batch.id, arrays, time.perf_counter() - started, distinct, runtime.words.missed)
