"""AllenNLP 0.9's ``allennlp.commands.elmo``: ``ElmoEmbedder`` and its module constants, on this project's biLM.

Same signatures and outputs: ``batch_to_embeddings`` (B, 3, T, D) and a 0/1 LongTensor mask, ``embed_batch`` one
float32 (3, n, D) array per sentence, lazy ``embed_sentences``, and ``embed_file`` writing the HDF5 layout that
AllenNLP's readers expect. Two differences: nothing is downloaded (the default URLs name the files to fetch), and
each sentence starts from zero LSTM state unless ``stateful=True``, so that ``embed_sentences`` and ``embed_file``
may sort sentences by length into token-bounded batches, which is what makes them fast.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

import h5py
import numpy as np
import torch
from torch import Tensor

from elmo_core.allennlp.modules import _ElmoBiLm, remove_sentence_boundaries
from elmo_core.defaults import DEFAULT_INFERENCE_PRECISION
from elmo_core.errors import ConfigError, InputError
from elmo_core.runtime import Runtime
from elmo_core.text.chars import batch_to_ids

if TYPE_CHECKING:  # the options module loads pyarrow (through the tokenizers); the drop-in must not
    from elmo_core.options import AllennlpElmoConfig

log = logging.getLogger(__name__)

DEFAULT_OPTIONS_FILE = (
    "https://allennlp.s3.amazonaws.com/models/elmo/2x4096_512_2048cnn_2xhighway/"
    "elmo_2x4096_512_2048cnn_2xhighway_options.json"
)
DEFAULT_WEIGHT_FILE = (
    "https://allennlp.s3.amazonaws.com/models/elmo/2x4096_512_2048cnn_2xhighway/"
    "elmo_2x4096_512_2048cnn_2xhighway_weights.hdf5"
)
DEFAULT_BATCH_SIZE = 64
LAZY_SENTENCES = 4096  # sentences ``embed_sentences`` reads ahead to sort by length (bounded memory)
OUTPUT_FORMATS = ("all", "top", "average")


def _local(path: str, what: str, other: str) -> str:
    if str(path).startswith(("http://", "https://", "s3://")):
        raise ConfigError(
            f"ElmoEmbedder: nothing is downloaded here; fetch {path} and {other}, then pass their local paths "
            f"(options_file=..., weight_file=...)"
        )
    if not Path(path).exists():
        raise InputError(f"ElmoEmbedder: {what} {path} not found")
    return str(path)


class ElmoEmbedder:
    """``ElmoEmbedder(options_file, weight_file, cuda_device=-1)``: the biLM's three layers per token.

    Extra keywords: ``stateful`` (AllenNLP's state carried from batch to batch, in the given order) and
    ``precision`` ("fp32" exact, "bf16" faster). ``elmo_bilm`` is the module (``.to()`` moves it).
    """

    def __init__(
        self,
        options_file: str = DEFAULT_OPTIONS_FILE,
        weight_file: str = DEFAULT_WEIGHT_FILE,
        cuda_device: int = -1,
        *,
        stateful: bool = False,
        precision: str = DEFAULT_INFERENCE_PRECISION,
    ) -> None:
        options_file = _local(options_file, "options file", weight_file)
        weight_file = _local(weight_file, "weight file", options_file)
        self.indexer = batch_to_ids  # sentences ─► char ids (AllenNLP: an ELMoTokenCharactersIndexer)
        device = f"cuda:{cuda_device}" if cuda_device >= 0 else "cpu"
        self.elmo_bilm = _ElmoBiLm(options_file, weight_file, stateful=stateful, precision=precision, device=device)
        self.elmo_bilm.eval()
        self.cuda_device = cuda_device
        self._stateful = stateful
        self._runtime: Runtime = self.elmo_bilm._runtime  # type: ignore[assignment]

    @property
    def _device(self) -> torch.device:
        return self.elmo_bilm._bilm.device

    def reset_states(self) -> None:
        self.elmo_bilm.reset_states()

    @torch.no_grad()
    def batch_to_embeddings(self, batch: list[list[str]]) -> tuple[Tensor, Tensor]:
        """(activations (B, 3, T, D) without the boundaries, mask (B, T) 0/1 LongTensor), as AllenNLP 0.9."""
        out = self.elmo_bilm(batch_to_ids(batch).to(self._device))
        trimmed = [remove_sentence_boundaries(layer, out["mask"]) for layer in out["activations"]]
        return torch.stack([layer for layer, _ in trimmed], dim=1), trimmed[0][1].long()

    def embed_batch(self, batch: list[list[str]]) -> list[np.ndarray]:
        """One float32 (3, n_tokens, D) array per sentence; an empty sentence gives (3, 0, D)."""
        if self._stateful:
            return self._embed_in_order(batch)
        return self._runtime.embed(batch)

    def _embed_in_order(self, batch: list[list[str]]) -> list[np.ndarray]:
        """AllenNLP's own way: the batch as it is, through ``batch_to_embeddings`` (the stateful protocol)."""
        width = self.elmo_bilm.get_output_dim()
        if not any(batch):
            return [np.zeros((3, 0, width), dtype=np.float32) for _ in batch]
        embeddings, mask = self.batch_to_embeddings(batch)
        lengths = mask.sum(1).tolist()
        return [embeddings[i, :, :n].float().cpu().numpy() for i, n in enumerate(lengths)]

    def embed_sentence(self, sentence: list[str]) -> np.ndarray:
        return self.embed_batch([sentence])[0]

    def embed_sentences(
        self, sentences: Iterable[list[str]], batch_size: int = DEFAULT_BATCH_SIZE
    ) -> Iterator[np.ndarray]:
        """Lazily, one array per sentence in order. Stateless: read ahead ``LAZY_SENTENCES`` at a time and batched
        by length (``batch_size`` rows at most); stateful: batches of ``batch_size`` in the given order."""
        sentences = iter(sentences)
        group = batch_size if self._stateful else max(batch_size, LAZY_SENTENCES)
        while chunk := list(itertools.islice(sentences, group)):
            if self._stateful:
                yield from self._embed_in_order(chunk)
            else:
                yield from self._runtime.embed(chunk, max_rows=batch_size)

    def embed_file(
        self,
        input_file: IO[str],
        output_file_path: str,
        output_format: str = "all",
        batch_size: int = DEFAULT_BATCH_SIZE,
        forget_sentences: bool = False,
        use_sentence_keys: bool = False,
    ) -> None:
        """Whitespace-tokenized sentences, one a line, from an open file ─► HDF5 datasets keyed by line number (or by
        the sentence), plus ``sentence_to_index`` (JSON sentence → line) unless ``forget_sentences`` or
        ``use_sentence_keys``. ``output_format``: "all" (3, n, D), "top" (n, D) or "average" (n, D)."""
        if output_format not in OUTPUT_FORMATS:
            raise ConfigError(f"output_format must be one of {', '.join(OUTPUT_FORMATS)}, got {output_format!r}")
        sentences = [line.strip() for line in input_file]
        name = getattr(input_file, "name", "input")
        blank = [i for i, line in enumerate(sentences, 1) if not line]
        if blank:
            more = f" (and {len(blank) - 1} more)" if len(blank) > 1 else ""
            raise InputError(
                f"{name}:{blank[0]}: a blank line{more}; ElmoEmbedder.embed_file takes one sentence a line"
            )
        if use_sentence_keys:
            keys = sentences
            seen: set[str] = set()
            for number, sentence in enumerate(sentences, 1):
                if sentence in seen:
                    raise InputError(
                        f"{name}:{number}: a duplicate sentence; without use_sentence_keys duplicates are kept by line"
                    )
                seen.add(sentence)
        else:
            keys = [str(i) for i in range(len(sentences))]
        vectors = self.embed_sentences([s.split() for s in sentences], batch_size)
        with h5py.File(output_file_path, "w") as out:
            for key, embeddings in zip(keys, vectors):
                layers = {"all": embeddings, "top": embeddings[-1], "average": np.average(embeddings, axis=0)}
                data = layers[output_format].astype(np.float32)
                out.create_dataset(key, data.shape, dtype="float32", data=data)
            if not forget_sentences and not use_sentence_keys:
                index = out.create_dataset("sentence_to_index", (1,), dtype=h5py.special_dtype(vlen=str))
                index[0] = json.dumps({s: k for s, k in zip(sentences, keys)})
        input_file.close()


def run_elmo_command(config: AllennlpElmoConfig) -> str:
    """``allennlp elmo`` of AllenNLP 0.9 (``elmo allennlp-elmo``): sentences, one a line, into HDF5. Returns the
    summary line."""
    embedder = ElmoEmbedder(
        config.options_file or DEFAULT_OPTIONS_FILE,
        config.weight_file or DEFAULT_WEIGHT_FILE,
        config.cuda_device,
        stateful=config.stateful,
        precision=config.precision,
    )
    try:
        source = open(config.input_file, encoding="utf-8")  # noqa: SIM115  (embed_file closes it, as AllenNLP's)
    except FileNotFoundError:
        raise InputError(f"{config.input_file}: no such file") from None
    started = time.perf_counter()
    with torch.no_grad():
        embedder.embed_file(
            source,
            config.output_file,
            config.output_format,
            config.batch_size,
            forget_sentences=config.forget_sentences,
            use_sentence_keys=config.use_sentence_keys,
        )
    with open(config.input_file, encoding="utf-8") as f:
        n = sum(1 for _ in f)
    return (
        f"allennlp-elmo: {n:,} sentences ({config.output_format}) in {time.perf_counter() - started:.1f} s "
        f"-> {config.output_file}"
    )
