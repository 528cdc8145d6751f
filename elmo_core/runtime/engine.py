"""``Runtime``: a model opened once in this process, and the one way it runs here.

    runtime = Runtime.open("models:/elmo/latest", device="auto", precision="auto")
    print(runtime.line())          # what was resolved: the model, device, precision and why, threads, kernels
    runtime.embed(sentences, Output(layers="mix", pool="mean"))   # one array per sentence

Opening it resolves the model reference (``reference``: folders, published files, MLflow URIs through one download
cache), the device and precision (``placement.place``, or a plan's ``Placement`` as it is), this process's
threads (``placement.take_threads``) and heap (``heap.keep_large_buffers``), and the kernels (``BiLM.prepare``,
chosen once). It keeps what a process reuses: the loaded weights and the layer-0 word cache. ``run`` packs
sentences into forward passes under its token budget (``token_budget``: the CPU's 8,192 padded tokens, more on a
GPU by its memory; printed on the line; ``inference.plan_batches``) and yields each batch's layers; ``embed``
shapes them as an ``Output`` asks. The embedding stage, each server model process, the probes, evaluation, the
MLflow pyfunc model and the AllenNLP drop-in all run a model through this class, so a sentence's vectors are the
same whichever asked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from elmo_core import cpu, heap
from elmo_core.bilm.inference import (
    MAX_BATCH_TOKENS,
    StateCarry,
    WordCache,
    plan_batches,
    sentence_major,
    token_rows,
)
from elmo_core.bilm.model import BiLM
from elmo_core.config import ModelConfig
from elmo_core.defaults import DEFAULT_DEVICE, DEFAULT_INFERENCE_PRECISION, WORD_CACHE_BYTES
from elmo_core.errors import ConfigError
from elmo_core.runtime.output import ALL_LAYERS, Output
from elmo_core.runtime.placement import Placement, place, take_threads
from elmo_core.runtime.reference import ModelRef, resolve_model

log = logging.getLogger(__name__)

# a first call's sentences: every layer runs, so every kernel's weights are prepared (``Runtime.warm_up``)
WARM_UP = [["The", "first", "call", "pays", "for", "what", "the", "rest", "reuse", "."], ["Warm", "."]]

CUDA_MAX_BATCH_TOKENS = 65_536  # ~2,000 rows of 30 tokens a step: the recurrent product's rows fill an H100
CUDA_MEMORY_SHARE = 0.25  # of the GPU's memory for one forward pass's per-token tensors: room for buckets and graphs


def token_budget(device: torch.device, config: ModelConfig) -> tuple[int, str]:
    """The padded tokens per forward pass on ``device``, and why: on a CPU ``MAX_BATCH_TOKENS`` (sized for its
    caches; tokens/s is flat beyond it), on CUDA ``cuda_budget`` of the GPU's memory."""
    if device.type != "cuda":
        return MAX_BATCH_TOKENS, f"the {device.type}'s default"
    return cuda_budget(torch.cuda.get_device_properties(device).total_memory, config)


def cuda_budget(total: int, config: ModelConfig) -> tuple[int, str]:
    """What ``CUDA_MEMORY_SHARE`` of ``total`` bytes holds of a forward pass's per-token tensors
    (``bytes_per_token``), in steps of 1,024, from ``MAX_BATCH_TOKENS`` up to ``CUDA_MAX_BATCH_TOKENS``."""
    per_token = bytes_per_token(config)
    fits = int(total * CUDA_MEMORY_SHARE) // per_token // 1024 * 1024
    tokens = max(MAX_BATCH_TOKENS, min(CUDA_MAX_BATCH_TOKENS, fits))
    return tokens, (
        f"CUDA: a quarter of {total / 2**30:.0f} GiB at {per_token / 1024:.0f} KiB a padded token, "
        f"{MAX_BATCH_TOKENS:,} to {CUDA_MAX_BATCH_TOKENS:,}"
    )


def bytes_per_token(config: ModelConfig) -> int:
    """A forward pass's float32 bytes per padded token at its peak: a layer's input gates, both directions (the
    reference cell holds every step's at once), and the L+1 layers' outputs twice (kept, then stacked)."""
    lstm = config.lstm
    return 4 * (2 * 4 * lstm.dim + 2 * (lstm.n_layers + 1) * 2 * lstm.projection_dim)


class Runtime:
    """A biLM loaded, placed and prepared in this process (``open``), with its word cache and token budget."""

    def __init__(
        self,
        model: ModelRef,
        bilm: BiLM,
        placement: Placement,
        threads: tuple[int, str],
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        word_cache_bytes: int = WORD_CACHE_BYTES,
        budget_why: str = "asked for",
    ) -> None:
        self.model, self.bilm, self.placement = model, bilm, placement
        self.threads, self.threads_why = threads
        self.max_batch_tokens, self.budget_why = max_batch_tokens, budget_why
        self.words = WordCache(bilm, word_cache_bytes)

    @classmethod
    def open(
        cls,
        model: str | ModelRef,
        *,
        weight_file: str | None = None,
        placement: Placement | None = None,
        device: str = DEFAULT_DEVICE,
        precision: str = DEFAULT_INFERENCE_PRECISION,
        threads: int | None = None,
        max_batch_tokens: int | None = None,
        word_cache_bytes: int = WORD_CACHE_BYTES,
    ) -> Runtime:
        """Resolve, place and load ``model``; ``placement`` (a plan's) is taken as it is, else ``device`` and
        ``precision`` are resolved here; ``max_batch_tokens`` None: ``token_budget`` of the device. Logs ``line()``,
        the line every command that runs a model prints."""
        ref = model if isinstance(model, ModelRef) else resolve_model(model, weight_file)
        if ref.onnx:  # the file holds a graph, not the weights a runtime loads
            raise ConfigError(
                f"{ref.asked}: an ONNX file runs in ONNX Runtime (`elmo serve FILE.onnx`, docs/onnx.md); for this "
                f"command give the model it was exported from ({ref.exported_from})"
            )
        placement = placement if placement is not None else place(device, precision)
        taken = take_threads(threads)
        heap.keep_large_buffers()  # a pass's buffers reused, not page-faulted in again each time
        bilm = BiLM.from_pretrained(
            str(ref.options),
            str(ref.weights),
            device=placement.device,
            vocab_file=str(ref.vocab) if ref.vocab else None,
        )
        bilm.prepare(placement.precision)  # the kernels, chosen once, for the precision placed
        budget, why = (max_batch_tokens, "asked for") if max_batch_tokens else token_budget(bilm.device, bilm.config)
        runtime = cls(ref, bilm, placement, taken, budget, word_cache_bytes, why)
        log.info("%s", runtime.line())
        return runtime

    # --- what was decided ------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.bilm.device

    @property
    def precision(self) -> str:
        return self.placement.precision

    @property
    def num_layers(self) -> int:
        return self.bilm.num_layers

    @property
    def output_dim(self) -> int:
        return self.bilm.output_dim

    def shape(self) -> str:
        lstm, cnn = self.bilm.config.lstm, self.bilm.config.char_cnn
        return f"{lstm.n_layers}x{lstm.dim}_{lstm.projection_dim}, {cnn.n_filters} filters, {cnn.n_highway} highway"

    def line(self) -> str:
        """One line of everything resolved: the same in ``elmo info MODEL`` and every command that runs a model."""
        return (
            f"{self.model.line()}: {self.shape()}; on {self.placement.line()}; {self.threads} threads "
            f"({self.threads_why}); {self.max_batch_tokens:,} padded tokens a pass ({self.budget_why}); "
            f"kernels: {self.bilm.kernels}"
        )

    def facts(self) -> dict[str, Any]:
        """The same decisions as fields (the server's ``/info``, a run's parameters)."""
        return {
            "model": self.model.name,
            "model_id": self.model.model_id,
            "identity": self.model.identity(),
            "origin": self.model.origin,
            "device": str(self.device),
            "precision": str(self.precision),
            "precision_why": self.placement.precision.why,
            "threads": self.threads,
            "kernels": str(self.bilm.kernels),
            "layers": self.num_layers,
            "dim": self.output_dim,
            "max_batch_tokens": self.max_batch_tokens,
            "max_batch_tokens_why": self.budget_why,
            "cpu": cpu.describe(),
        }

    def warm_up(self) -> float:
        """One short call before the real ones, and its seconds: the kernels' weights prepared (cast, packed or
        quantized once per weight version) and their buffers sized, so that a job's first unit and a server's first
        request do not pay for it (1.2 s of the first unit, in int8 on the ManyLangs shape of bench/manylangs.py)."""
        started = time.perf_counter()
        self.embed(WARM_UP)
        return time.perf_counter() - started

    # --- running sentences -----------------------------------------------------------------------------
    def batches(self, lengths: Sequence[int], in_order: bool = False, max_rows: int | None = None) -> list[list[int]]:
        """Which sentences share a forward pass under this runtime's token budget (``inference.plan_batches``)."""
        return plan_batches(lengths, self.max_batch_tokens, max_rows, in_order)

    def run(
        self,
        sentences: Sequence[Sequence[str]],
        batches: list[list[int]] | None = None,
        carry: StateCarry | None = None,
    ) -> Iterator[tuple[list[int], Tensor, Tensor]]:
        """Per forward pass: its sentence indices, its layers (L+1, N, 2P) as token rows (each sentence's tokens
        after the one before) and each sentence's token count. ``batches`` default to ``batches()`` of the
        sentences (stateful where a ``carry`` is given)."""
        if batches is None:
            batches = self.batches([len(s) for s in sentences], in_order=carry is not None)
        if self.bilm.kernels is None or not self.bilm.kernels.runs_on(self.device):  # moved with .to(): again
            self.bilm.prepare(self.precision)
        for batch, layers, counts in token_rows(self.bilm, sentences, batches, carry, self.words):
            yield batch, torch.stack(layers), counts

    def embed(
        self,
        sentences: Sequence[Sequence[str]],
        output: Output = ALL_LAYERS,
        *,
        max_rows: int | None = None,
        carry: StateCarry | None = None,
    ) -> list[np.ndarray]:
        """One array per sentence, shaped as ``output`` asks: (L+1, n, 2P) every layer, (n, 2P) a mix; pooled,
        (L+1, 2P) or (2P,). Empty sentences give (·, 0, 2P) (their mean: zeros)."""
        batches = self.batches([len(s) for s in sentences], in_order=carry is not None, max_rows=max_rows)
        factors = output.factors(self.num_layers) if output.layers == "mix" else None
        results: list[np.ndarray | None] = [None] * len(sentences)
        for batch, stacked, counts in self.run(sentences, batches, carry):
            shaped = output.apply(stacked, counts, factors)
            lengths = counts.tolist() if output.pool == "none" else [1] * len(batch)
            for i, answer in zip(batch, sentence_major(shaped, lengths, output.torch_dtype())):
                results[i] = output.of_sentence(answer)  # a view: one host buffer per pass, no copy per sentence
        return results  # type: ignore[return-value]
