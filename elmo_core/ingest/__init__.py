"""Ingest: corpus files (text, .gz/.bz2, JSONL, Parquet) ─► a tokenized, deduplicated Parquet dataset.

Output directory layout (a plain Parquet dataset: readers skip the ``_`` and ``.`` names):

    OUT/part-<key>.parquet   one shard per input file (zstd, streaming-sized row groups), columns SHARD_SCHEMA
    OUT/_manifest.duckdb     table ``files`` (one row per input file: size, mtime, sha256, counts, status),
                             table ``seen`` (64-bit hashes of every kept sentence, for deduplication) and
                             table ``options`` (the tokenizer and split settings every shard shares)

``<key>`` is the first 16 hex digits of the sha256 of the file's text (decompressed), so ids, shard names and
the heldout split follow the content, not the container. A file is tokenized and deduplicated (against
itself, and against DuckDB's ``seen`` table) into a hidden ``.part-<key>.parquet.tmp``, renamed, and only then
committed to the manifest: a crash or ``kill -9`` leaves no partial shard, and the next run redoes just the file
that was in flight. Files already in the manifest are skipped; a run with other tokenizer or split options is
refused, so a dataset never mixes two ways of reading text.

Read it in the order a file goes through: ``inputs`` (which files a source names), ``readers`` (their records and
lines), ``shards`` (tokenized, split and deduplicated into one Parquet shard), ``manifest`` (the DuckDB record of
what is in), ``run`` (``ingest`` itself, file by file).
"""

from elmo_core.ingest.inputs import Input, detect_layout, file_format, find_inputs, find_sources
from elmo_core.ingest.manifest import MANIFEST_NAME, dataset_options, manifest_path, open_manifest, option_changes
from elmo_core.ingest.readers import BinaryFileError, FileStats, content_sha256
from elmo_core.ingest.run import IngestStage, IngestSummary, ingest
from elmo_core.ingest.shards import SHARD_SCHEMA, _HashSet, sentence_hashes, shard_paths
from elmo_core.options import IngestConfig

__all__ = [
    "IngestStage",
    "MANIFEST_NAME",
    "SHARD_SCHEMA",
    "BinaryFileError",
    "FileStats",
    "IngestConfig",
    "IngestSummary",
    "Input",
    "detect_layout",
    "find_sources",
    "_HashSet",
    "content_sha256",
    "dataset_options",
    "file_format",
    "find_inputs",
    "ingest",
    "manifest_path",
    "open_manifest",
    "option_changes",
    "sentence_hashes",
    "shard_paths",
]
