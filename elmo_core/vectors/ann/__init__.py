"""An approximate-nearest-neighbour index beside an embedding table, so a query does not scan every row.

The table (``elmo embed`` output, or any Parquet folder with the same columns) stays the source of truth; the
index of one vector column lives in ``TABLE/_index/<column>/`` (readers of the table skip ``_`` folders):

    index.json                 what it indexes: column, key column, model id, width, dtype, nlist, nprobe
    trained.faiss              the coarse quantizer and 8-bit scalar quantizer, trained once on a sample
    shard-NNNNN.faiss          IVF lists of 8-bit codes of the normalized vectors of a group of parts (faiss-cpu)
    shard-NNNNN.vectors.npy    the same rows' vectors as the table holds them: candidates are re-ranked by exact cosine
    shard-NNNNN.meta.arrow     key (token, or sentence_id in pooled tables), sentence_id, token_index and text of
                               each row, in the vectors' order (Arrow IPC, memory-mapped: a row is read by position)
    shard-NNNNN.order.npy      the positions sorted by (key, sentence_id, token_index)
    shard-NNNNN.keys.arrow     each distinct key once, sorted, with its range in ``order``: a lookup by token is a
                               binary search, not a scan, and ``--like`` matches these keys only
    shard-NNNNN.json           the parts the shard covers (name, bytes, rows); written last: a shard without it is
                               not part of the index (a build killed midway), and a rerun builds it again

A shard covers whole part files. When the table changes, a query uses the shards whose parts are all unchanged
minus parts that are gone, and scans the parts no shard covers exactly (``query.py``); ``elmo index`` again builds
shards for just those parts (and rebuilds shards that lost a part). Shards share the trained quantizer, so N shards
built on N machines answer as one index over the same parts would: the query merges their top-k.

Read it in this order: ``files`` (what an index is on disk, and the one coverage rule), ``table`` (what a build reads
of the table first), ``build`` (the stage: plan, make room, a shard per unit), ``search`` (what queries open).
"""

from elmo_core.vectors.ann.build import (
    MAX_TRAIN,
    READ_ROWS,
    TRAIN_PER_LIST,
    BuildPlan,
    IndexStage,
    IndexSummary,
    build_index,
    build_lock,
    build_shard,
    make_room,
    plan_build,
    summarize,
)
from elmo_core.vectors.ann.files import (
    FORMAT,
    HEADER,
    INDEX_DIR,
    Coverage,
    Header,
    PartFile,
    ShardFiles,
    ShardRecord,
    index_dir,
    read_header,
    read_shards,
)
from elmo_core.vectors.ann.search import AnnIndex, Row, Shard, cosine, order_key
from elmo_core.vectors.ann.table import (
    JOB_FILE,
    POINTER,
    TableFacts,
    default_nlist,
    first_schema,
    in_use,
    normalized,
    pick_column,
    table_job,
    table_model_id,
    table_parts,
    vectors_of,
)

__all__ = [
    "AnnIndex",
    "BuildPlan",
    "Coverage",
    "FORMAT",
    "HEADER",
    "Header",
    "INDEX_DIR",
    "IndexStage",
    "IndexSummary",
    "MAX_TRAIN",
    "PartFile",
    "READ_ROWS",
    "Row",
    "Shard",
    "ShardFiles",
    "ShardRecord",
    "TRAIN_PER_LIST",
    "TableFacts",
    "build_index",
    "build_lock",
    "build_shard",
    "cosine",
    "default_nlist",
    "first_schema",
    "index_dir",
    "make_room",
    "normalized",
    "order_key",
    "pick_column",
    "plan_build",
    "read_header",
    "read_shards",
    "summarize",
    "JOB_FILE",
    "POINTER",
    "in_use",
    "table_job",
    "table_model_id",
    "table_parts",
    "vectors_of",
]
