"""How a unit's passes become its Parquet file: the table's schema, each pass's rows, and the writer's settings.

The vectors are most of a table's bytes and all of its writing time, so the writer does no per-float work that buys
nothing: no statistics on vector values (a min and max of every float, which no query reads), no dictionary, and no
general-purpose compression unless asked (``compression: zstd``, measured on real ELMo vectors in docs/tables.md: a
few percent of the bytes for a third of the pace); the small columns (ids, tokens, text) keep zstd and their
dictionaries. Values go to the writer in batches of ``WRITE_BATCH`` (Arrow's default of 1,024 values makes a
1,024-float vector a batch of its own). The vectors stay ``list<float>`` (or float16) of a fixed width: what DuckDB
(``list_cosine_similarity``), pandas and Spark read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from elmo_core.options import EmbedConfig

STRINGS = ["doc_id", "sentence_id", "token", "text", "model_id"]  # dictionary-encoded, zstd, with statistics
WRITE_BATCH = 65_536  # values handed to the encoder at a time: measured 1.2x the default's pace on 1,024-wide vectors


def output_schema(n_layers: int, width: int, config: EmbedConfig) -> pa.Schema:
    value = pa.float16() if config.dtype == "float16" else pa.float32()
    vector = pa.list_(value, width)
    names = [f"layer_{i}" for i in range(n_layers)] if config.layers == "all" else ["elmo"]
    if config.pool == "mean":
        head = [("doc_id", pa.string()), ("sentence_id", pa.string()), ("n_tokens", pa.int32()), ("text", pa.string())]
    else:
        head = [
            ("doc_id", pa.string()),
            ("sentence_id", pa.string()),
            ("token_index", pa.int32()),
            ("token", pa.string()),
            ("text", pa.string()),
        ]
    return pa.schema([*head, *[(n, vector) for n in names], ("model_id", pa.string())])


def open_writer(path: Path, schema: pa.Schema, compression: str) -> pq.ParquetWriter:
    """A unit's writer: the vector columns as ``compression`` asks (none by default), the rest zstd."""
    vectors = [f"{f.name}.list.element" for f in schema if pa.types.is_fixed_size_list(f.type)]  # the leaf's path
    small = [f.name for f in schema if not pa.types.is_fixed_size_list(f.type)]
    codecs = {**dict.fromkeys(small, "zstd"), **dict.fromkeys(vectors, compression)}
    return pq.ParquetWriter(
        path,
        schema,
        compression=codecs,
        compression_level={name: 1 for name, codec in codecs.items() if codec == "zstd"},
        use_dictionary=[name for name in STRINGS if name in small],
        write_statistics=small,
        write_batch_size=WRITE_BATCH,
    )


def pass_table(
    schema: pa.Schema,
    names: list[str],
    group: pa.Table,
    batch: np.ndarray,
    counts: np.ndarray,
    vectors: torch.Tensor,
    model_id: str,
) -> pa.Table:
    """A pass's rows: (K, R, 2P) ``vectors`` (already in the table's dtype), R tokens or (``pool: mean``, where the
    schema has ``n_tokens``) R sentences, ``batch`` the group's rows of its sentences and ``counts`` their tokens."""
    width = vectors.shape[-1]
    picked = pa.array(batch)
    if "n_tokens" in schema.names:
        data: dict[str, Any] = {
            "doc_id": group.column("doc_id").take(picked),
            "sentence_id": group.column("sentence_id").take(picked),
            "n_tokens": pa.array(counts.astype(np.int32)),
            "text": group.column("text").take(picked),
        }
        n_rows = len(batch)
    else:
        rows = pa.array(np.repeat(batch, counts))
        token_index = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        data = {
            "doc_id": group.column("doc_id").take(rows),
            "sentence_id": group.column("sentence_id").take(rows),
            "token_index": pa.array(token_index.astype(np.int32)),
            "token": pc.list_flatten(group.column("tokens").take(picked)),
            "text": group.column("text").take(rows),
        }
        n_rows = int(counts.sum())
    values = vectors.cpu().numpy()  # the table's dtype already (torch converts to float16 far faster than NumPy)
    for name, layer in zip(names, values):
        data[name] = pa.FixedSizeListArray.from_arrays(pa.array(layer.reshape(-1)), width)
    data["model_id"] = pa.repeat(pa.scalar(model_id, pa.string()), n_rows)
    return pa.table(data, schema=schema)


@contextlib.contextmanager
def writes(writer: pq.ParquetWriter, beside: bool, waiting: int = 2) -> Iterator[Callable[[pa.Table], None]]:
    """How a pass's table reaches the file: written here, or (``beside``) by one thread beside the model, in order,
    so that a GPU computes the next pass while the last one is encoded and written (pyarrow lets go of the GIL as it
    writes); at most ``waiting`` tables wait for it, so memory stays bounded. A failed write is raised by the next
    table's hand-over or at the end, and a unit's file is complete or absent either way (``atomic_path``)."""
    if not beside:
        yield writer.write_table
        return
    pending: list[Future[None]] = []
    with ThreadPoolExecutor(1, thread_name_prefix="parquet-writer") as thread:

        def write(table: pa.Table) -> None:
            while len(pending) >= waiting:
                pending.pop(0).result()
            pending.append(thread.submit(writer.write_table, table))

        try:
            yield write
        except BaseException:  # the pass failed (or was stopped): its error is the one to see, not a queued write's
            for future in pending:
                future.cancel()
            raise
        for future in pending:
            future.result()
