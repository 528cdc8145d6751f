"""The nearest-neighbour index beside an embedding table (``elmo index``): the answers of an exact scan, tables
that change under it, kill -9 mid-build, two builds at once, shards, bad input. Real files and processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from bench.query_scale import write_table
from elmo_core.errors import ConfigError, InputError
from elmo_core.vectors import ann
from elmo_core.vectors.query import EmbeddingStore
from tests.helpers import run_elmo

ROOT = Path(__file__).resolve().parent.parent
PART_ROWS = 4_000


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    """Six parts of 4,000 token rows, 32 wide, Zipfian tokens whose uses cluster (bench/query_scale.py's table)."""
    return write_table(tmp_path_factory.mktemp("index") / "emb", rows=6 * PART_ROWS, dim=32, part_rows=PART_ROWS)


@pytest.fixture()
def table(original, tmp_path) -> Path:
    return Path(shutil.copytree(original, tmp_path / "emb"))


def queries(table: Path, n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(token, sentence_id) of ``n`` rows drawn with a fixed seed."""
    rows = pq.read_table(sorted(table.glob("part-*.parquet")), columns=["token", "sentence_id"]).to_pylist()
    picked = np.random.default_rng(seed).choice(len(rows), n, replace=False)
    return [(rows[i]["token"], rows[i]["sentence_id"]) for i in picked]


def answer(store: EmbeddingStore, token: str, sid: str, **kw) -> list[tuple[str, int]]:
    return [(h.sentence_id, h.token_index) for h in store.nearest_tokens(token, sentence_id=sid, **kw)]


def exhaustive(table: Path) -> EmbeddingStore:
    """Indexed, visiting every inverted list: what is left to differ from the scan is only which rows it reads."""
    return EmbeddingStore(table, nprobe=ann.read_header(ann.index_dir(table, "elmo")).nlist)


def test_indexed_answers_are_the_exact_scans_rows_with_exact_similarities(table):
    summary = ann.build_index(table, shard_rows=10_000)
    assert summary.shards == 3 and summary.rows == 6 * PART_ROWS
    indexed, exact = EmbeddingStore(table), EmbeddingStore(table, exact=True)
    recalls = []
    for token, sid in queries(table, 30):
        got = indexed.nearest_tokens(token, sentence_id=sid, k=10)
        want = exact.nearest_tokens(token, sentence_id=sid, k=10)
        recalls.append(
            len({(h.sentence_id, h.token_index) for h in got} & {(h.sentence_id, h.token_index) for h in want})
        )
        exact_sim = {(h.sentence_id, h.token_index): h.similarity for h in want}
        for h in got:  # the cosine of the row itself, not of its 8-bit code
            if (h.sentence_id, h.token_index) in exact_sim:
                assert h.similarity == pytest.approx(exact_sim[(h.sentence_id, h.token_index)], abs=1e-5)
        assert [h.token for h in got if (h.sentence_id, h.token_index) in exact_sim] == [
            h.token for h in want if (h.sentence_id, h.token_index) in {(g.sentence_id, g.token_index) for g in got}
        ]
    assert np.mean(recalls) / 10 >= 0.95
    assert indexed.last_path.startswith("query: index") and exact.last_path.startswith("query: exact scan")
    token, sid = queries(table, 1, seed=5)[0]
    assert answer(indexed, token, sid, like=token) == answer(exact, token, sid, like=token)  # filtered: exact
    assert answer(indexed, token, sid, like="w1%") == answer(exact, token, sid, like="w1%")


def test_shards_merged_equal_one_index_over_the_same_parts(table, tmp_path):
    one = Path(shutil.copytree(table, tmp_path / "one"))
    assert ann.build_index(one, shard_rows=10**9).shards == 1
    assert ann.build_index(table, shard_rows=PART_ROWS, workers=2).shards == 6  # built by two processes
    sharded, single = EmbeddingStore(table), EmbeddingStore(one)
    sharded.index("elmo"), single.index("elmo")  # both answer through their index, not a scan
    assert sharded.last_path.endswith("(6 shards, 6 parts)") and single.last_path.endswith("(1 shards, 6 parts)")
    for token, sid in queries(table, 20, seed=2):
        a = sharded.nearest_tokens(token, sentence_id=sid, k=10)
        b = single.nearest_tokens(token, sentence_id=sid, k=10)
        assert [(h.sentence_id, h.token_index) for h in a] == [(h.sentence_id, h.token_index) for h in b]
        assert [h.similarity for h in a] == pytest.approx([h.similarity for h in b], abs=1e-9)


def test_parts_added_and_removed_after_indexing_give_no_missing_and_no_phantom_rows(table, tmp_path):
    ann.build_index(table, shard_rows=10_000)
    write_table(tmp_path / "more", rows=PART_ROWS, dim=32, seed=7, part_rows=PART_ROWS, first_part=6)
    new_part = table / "part-00006.parquet"
    shutil.move(tmp_path / "more" / "part-00006.parquet", new_part)
    fresh = pq.read_table(new_part, columns=["token", "sentence_id"]).slice(100, 1).to_pylist()[0]
    removed = set(pq.read_table(table / "part-00002.parquet", columns=["sentence_id"]).column(0).to_pylist())
    (table / "part-00002.parquet").unlink()

    store, exact = exhaustive(table), EmbeddingStore(table, exact=True)
    store.index("elmo")
    assert "exact scan of 1 parts" in store.last_path
    assert "1 indexed parts are gone" in store.last_path
    for token, sid in [(fresh["token"], fresh["sentence_id"]), *queries(table, 15, seed=3)]:
        got = answer(store, token, sid, k=10)  # the token of the new part is found, its neighbours too
        assert got == answer(exact, token, sid, k=10)
        assert not {s for s, _ in got} & removed
    with pytest.raises(ConfigError, match="not found"):
        store.nearest_tokens("w0", sentence_id=sorted(removed)[0])  # a sentence of the removed part is not there

    summary = ann.build_index(table)  # adds the new part; rebuilds the shard that lost one
    assert summary.rows == 6 * PART_ROWS and "part-00002.parquet changed or is gone" in " ".join(summary.notes)
    after = exhaustive(table)
    after.index("elmo")
    assert "exact scan" not in after.last_path and "gone" not in after.last_path
    assert answer(after, fresh["token"], fresh["sentence_id"], k=10) == answer(
        exact, fresh["token"], fresh["sentence_id"], k=10
    )


# ``elmo index`` in a process that stops for good while writing its fourth shard (its vectors written, its metadata
# not yet, no record): the moment of the kill is the same every run
PAUSED_BUILD = """
import signal, sys
import elmo_core.vectors.ann.build as build
from elmo_core.cli import main

real, calls = build._write_meta, []
def write_meta(*args):
    calls.append(1)
    if len(calls) == 4:
        print("paused in shard 4", flush=True)
        signal.pause()
    return real(*args)
build._write_meta = write_meta
main(sys.argv[1:])
"""


@pytest.mark.slow
def test_kill_9_during_a_build_then_a_query_is_right_and_a_rerun_completes_it(tmp_path):
    table = write_table(tmp_path / "big", rows=12 * PART_ROWS, dim=64, part_rows=PART_ROWS)
    folder = ann.index_dir(table, "elmo")
    build = subprocess.Popen(
        [sys.executable, "-c", PAUSED_BUILD, "index", str(table), "--shard-rows", str(PART_ROWS)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert build.stdout.readline().strip() == "paused in shard 4", build.stderr.read()
    os.kill(build.pid, signal.SIGKILL)
    build.wait()
    assert len(list(folder.glob("shard-*.json"))) == 3 and (folder / "shard-00003.vectors.npy").exists()

    store, exact = exhaustive(table), EmbeddingStore(table, exact=True)
    for token, sid in queries(table, 10, seed=4):
        assert answer(store, token, sid, k=5) == answer(exact, token, sid, k=5)
    assert "exact scan of 9 parts" in store.last_path  # the half shard is not used

    summary = ann.build_index(table, shard_rows=PART_ROWS)
    assert summary.shards_built == 9 and summary.rows == 12 * PART_ROWS
    assert not list(folder.glob(".*.tmp"))  # the killed build's temporary files are gone
    again = exhaustive(table)
    again.index("elmo")
    assert "exact scan" not in again.last_path and again.last_path.endswith("(12 shards, 12 parts)")


def test_two_builds_at_once_one_waits_or_is_refused_in_one_line(table):
    with ann.build_lock(table, "elmo"):
        refused = run_elmo("index", str(table), timeout=120)
        assert refused.returncode != 0
        assert refused.stderr.strip().splitlines()[-1].startswith(f"elmo index: error: {ann.index_dir(table, 'elmo')}")
        assert "in use by another job" in refused.stderr and "Traceback" not in refused.stderr
        waiting = subprocess.Popen(
            [sys.executable, "-m", "elmo_core.cli", "index", str(table), "--wait"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for line in waiting.stderr:  # its own line says it waits: no sleep stands in for it
            if "waiting for it to end" in line:
                break
        assert waiting.poll() is None
    out, err = waiting.communicate(timeout=120)
    assert waiting.returncode == 0, err
    after = EmbeddingStore(table)
    after.index("elmo")
    assert "(1 shards, 6 parts)" in after.last_path
    assert out.startswith("index: 1 shards (24,000 rows) built")


def test_bad_input_gets_one_line_naming_the_path_and_the_cause(table, tmp_path):
    missing = run_elmo("index", str(table), "--layer", "layer_7", timeout=120)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert f"{table}: no vector column 'layer_7'; this table has ['elmo']" in missing.stderr
    assert not (table / "_index" / "layer_7").exists()
    with pytest.raises(ConfigError, match=f"{table}: no vector column 'layer_7'; this table has \\['elmo'\\]"):
        EmbeddingStore(table).nearest_tokens("w0", layer="layer_7")  # the query's check is the index's
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=f"{tmp_path / 'empty'}: no part-\\*.parquet files"):
        ann.build_index(tmp_path / "empty")
    with pytest.raises(InputError, match="no such table folder"):
        ann.build_index(tmp_path / "nowhere")

    ann.build_index(table)  # an index of another model: the query says so and scans; a build replaces it
    header = ann.index_dir(table, "elmo") / ann.HEADER
    header.write_text(json.dumps({**json.loads(header.read_text()), "model_id": "another"}))
    store = EmbeddingStore(table)
    store.index("elmo")
    assert "an index of another model (another; the table's is synthetic)" in store.last_path
    assert store.last_path.startswith("query: exact scan")
    summary = ann.build_index(table)
    assert "the table changed (model_id another → synthetic): rebuilding the index" in summary.notes


def test_pooled_tables_index_sentences(tmp_path, allennlp_dir):
    from elmo_core.vectors.embed import EmbedConfig, embed

    probes = ROOT / "data" / "probes" / "apple.txt"
    embed(EmbedConfig(model=str(allennlp_dir), input=str(probes), out=str(tmp_path / "pool"), pool="mean"))
    ann.build_index(tmp_path / "pool")
    indexed, exact = EmbeddingStore(tmp_path / "pool"), EmbeddingStore(tmp_path / "pool", exact=True)
    sid = indexed.con.execute("SELECT min(sentence_id) FROM embeddings").fetchone()[0]
    got, want = indexed.similar_sentences(sid, k=3), exact.similar_sentences(sid, k=3)
    assert [n.sentence_id for n in got] == [n.sentence_id for n in want]
    assert [n.similarity for n in got] == pytest.approx([n.similarity for n in want], abs=1e-5)
    assert indexed.last_path.startswith("query: index")
    with pytest.raises(ConfigError, match="pooled per sentence"):
        indexed.nearest_tokens("apple", sentence_id=sid)


def test_query_cli_says_which_path_ran(table):
    assert run_elmo("index", str(table), timeout=120).returncode == 0
    token, sid = queries(table, 1, seed=9)[0]
    indexed = run_elmo("-v", "query", str(table), "--token", token, "--sentence-id", sid, "-k", "3", timeout=120)
    assert indexed.returncode == 0, indexed.stderr
    assert f"query: index {ann.index_dir(table, 'elmo')} (1 shards, 6 parts)" in indexed.stderr
    assert "index parameters: faiss IVF" in indexed.stderr  # -v: what the index is
    exact = run_elmo("query", str(table), "--token", token, "--sentence-id", sid, "-k", "3", "--exact", timeout=120)
    assert "query: exact scan of 6 parts (exact=True / --exact)" in exact.stderr
    assert exact.stdout.splitlines()[1:] == indexed.stdout.splitlines()[1:]


def test_a_table_with_its_index_still_reads_as_a_plain_dataset(table):
    import duckdb
    import pandas as pd
    import pyarrow.dataset as ds

    ann.build_index(table)
    store = EmbeddingStore(table)
    store.index("elmo")
    assert store.last_path.endswith("(1 shards, 6 parts)")  # the index is there, beside the parts
    rows = 6 * PART_ROWS
    assert len(pd.read_parquet(table, columns=["token"])) == rows
    assert ds.dataset(table, format="parquet").count_rows() == rows
    glob = str(table / "**" / "*.parquet")
    assert duckdb.connect().execute("SELECT count(*) FROM read_parquet($g)", {"g": glob}).fetchone()[0] == rows


def test_a_first_build_killed_before_its_header_is_built_afresh(table):
    """The quantizer is written before index.json: a kill between the two leaves a folder a rerun starts over."""
    ann.build_index(table, shard_rows=10_000)
    folder = ann.index_dir(table, "elmo")
    (folder / ann.HEADER).unlink()
    store = EmbeddingStore(table)
    store.index("elmo")
    assert store.last_path.startswith("query: exact scan") and "no index of elmo" in store.last_path
    summary = ann.build_index(table, shard_rows=10_000)
    assert summary.shards_built == 3 and summary.rows == 6 * PART_ROWS
