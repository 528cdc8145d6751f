"""A training's data as datasets: each split of a vocab folder's token ids (``<data>/token_ids/<split>/``) with what
identifies it, so that a run can say which data made its model (MLflow's dataset panel: ``tracking.log_dataset``)
and a promotion can compare two models only on the same heldout data (``promote``).

The digest is the SHA-256 of the split's files (their names and bytes, in order): two folders with the same
sentences tokenized the same way against the same vocabulary have the same digest wherever they live, and any
change to a sentence, a token or the vocabulary's ids changes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

from elmo_core.fileio import files_digest
from elmo_core.tracking import DatasetFacts

COLUMNS = (("sentence_id", "string"), ("tokens", "list<string>"), ("ids", "list<int32>"))  # a token ids file's


@dataclass(frozen=True)
class SplitDataset:
    """One split of a vocab folder's token ids, as a dataset: where it is, its digest, how much it holds."""

    name: str  # "<data folder's name>/<split>"
    split: str
    source: Path  # the split's folder
    digest: str
    sentences: int
    tokens: int

    def line(self) -> str:
        size = f"{self.sentences:,} sentences, {self.tokens:,} tokens"
        return f"{self.split} {self.source} (digest {self.digest[:12]}, {size})"


def split_dataset(data: str | Path, split: str) -> SplitDataset | None:
    """The ``split`` of the vocab folder ``data`` as a dataset, or None where it holds no token ids of it."""
    folder = Path(data) / "token_ids" / split
    files = sorted(folder.glob("part-*.parquet"))
    if not files:
        return None
    sentences = tokens = 0
    for path in files:
        table = pq.read_table(path, columns=["ids"])
        sentences += table.num_rows
        tokens += int(pc.sum(pc.list_value_length(table.column("ids"))).as_py() or 0)
    name = f"{Path(data).resolve().name}/{split}"
    return SplitDataset(name, split, folder.resolve(), files_digest(files), sentences, tokens)


def facts(dataset: SplitDataset) -> DatasetFacts:
    """The dataset as a run logs it (``tracking.DatasetFacts``)."""
    return DatasetFacts(dataset.name, str(dataset.source), dataset.digest, dataset.sentences, dataset.tokens, COLUMNS)
