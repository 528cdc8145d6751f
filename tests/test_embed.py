"""Embedding jobs and queries: real Parquet out, exact values, kill -9 and resume, DuckDB queries, sense separation."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest

from elmo_core import BiLM
from elmo_core.errors import ConfigError
from elmo_core.ingest import IngestConfig, ingest
from elmo_core.vectors.embed import EmbedConfig, embed
from elmo_core.vectors.query import EmbeddingStore
from tests.helpers import ingested, run_elmo

ROOT = Path(__file__).resolve().parent.parent
SENTENCES = [
    "I like to eat apples with honey .",
    "Many people find the Apple phone easy to use .",
    "It's a test of quotes ' and \" marks .",
    "Short .",
    "苹果 发布 了 新 手机 。",
]


@pytest.fixture()
def corpus(tmp_path) -> Path:
    return ingested(tmp_path, SENTENCES, "s.txt")


def _read(out: Path):
    return pq.read_table(sorted(out.glob("part-*.parquet"))).to_pylist()


def test_token_rows_all_layers_equal_embed_sentences(corpus, tmp_path, allennlp_dir):
    summary = embed(EmbedConfig(model=str(allennlp_dir), input=str(corpus), out=str(tmp_path / "out"), layers="all"))
    rows = _read(tmp_path / "out")
    assert summary.rows == len(rows) == sum(len(s.split()) for s in SENTENCES)
    schema = pq.read_schema(sorted((tmp_path / "out").glob("part-*.parquet"))[0])
    assert schema.names == [
        "doc_id",
        "sentence_id",
        "token_index",
        "token",
        "text",
        "layer_0",
        "layer_1",
        "layer_2",
        "model_id",
    ]
    assert schema.field("layer_2").type.list_size == 32 and schema.field("layer_2").type.value_type == "float"
    bilm = BiLM.from_pretrained(str(allennlp_dir))
    by_sentence: dict[str, list[dict]] = {}
    for row in rows:
        by_sentence.setdefault(row["text"], []).append(row)
    for text, token_rows in by_sentence.items():
        token_rows.sort(key=lambda r: r["token_index"])
        expected = bilm.embed_sentences([text.split()])[0]
        assert [r["token"] for r in token_rows] == text.split()
        for layer in range(3):
            got = np.array([r[f"layer_{layer}"] for r in token_rows])
            np.testing.assert_allclose(got, expected[layer], atol=1e-5)
    assert len({r["model_id"] for r in rows}) == 1 and len(rows[0]["model_id"]) == 16


def test_mix_float16_and_mean_pooling(corpus, tmp_path, allennlp_dir):
    embed(
        EmbedConfig(
            model=str(allennlp_dir),
            input=str(corpus),
            out=str(tmp_path / "mix"),
            mix_weights=[0.0, 1.0, 2.0],
            gamma=0.5,
            dtype="float16",
        )
    )
    rows = _read(tmp_path / "mix")
    bilm = BiLM.from_pretrained(str(allennlp_dir))
    s = np.exp([0.0, 1.0, 2.0]) / np.exp([0.0, 1.0, 2.0]).sum()
    row = next(r for r in rows if r["text"] == SENTENCES[0] and r["token_index"] == 4)
    layers = bilm.embed_sentences([SENTENCES[0].split()])[0][:, 4]
    np.testing.assert_allclose(row["elmo"], 0.5 * (s[:, None] * layers).sum(0), atol=2e-3)  # float16
    assert (
        pq.read_schema(sorted((tmp_path / "mix").glob("part-*.parquet"))[0]).field("elmo").type.value_type
        == "halffloat"
    )
    embed(EmbedConfig(model=str(allennlp_dir), input=str(corpus), out=str(tmp_path / "pool"), pool="mean"))
    pooled = _read(tmp_path / "pool")
    assert len(pooled) == len(SENTENCES)
    first = next(r for r in pooled if r["text"] == SENTENCES[0])
    assert first["n_tokens"] == 8
    np.testing.assert_allclose(
        first["elmo"], bilm.embed_sentences([SENTENCES[0].split()])[0].mean(0).mean(0), atol=1e-5
    )


def test_vectors_are_stored_plain_unless_compression_is_asked_and_duckdb_reads_every_form(
    corpus, tmp_path, allennlp_dir
):
    """The vector columns are written without compression, statistics or a dictionary (per-float work no query
    reads), the small columns zstd; ``compression: zstd`` compresses the vectors too. DuckDB reads each form, float16
    included, as vectors ``list_cosine_similarity`` takes, with the values the runtime gives."""
    import duckdb

    expected = BiLM.from_pretrained(str(allennlp_dir)).embed_sentences([SENTENCES[0].split()])[0].mean(0)[0]
    forms = {"plain": {}, "zstd": {"compression": "zstd"}, "half": {"dtype": "float16"}}
    for name, options in forms.items():
        embed(EmbedConfig(model=str(allennlp_dir), input=str(corpus), out=str(tmp_path / name), **options))
        meta = pq.ParquetFile(sorted((tmp_path / name).glob("part-*.parquet"))[0]).metadata.row_group(0)
        columns = {meta.column(i).path_in_schema.split(".")[0]: meta.column(i) for i in range(meta.num_columns)}
        vector = columns["elmo"]
        assert vector.compression == ("ZSTD" if name == "zstd" else "UNCOMPRESSED"), name
        assert not vector.is_stats_set and not vector.has_dictionary_page, name
        assert columns["text"].compression == "ZSTD" and columns["text"].is_stats_set
        with duckdb.connect() as db:
            got, similarity = db.execute(
                f"SELECT elmo, list_cosine_similarity(elmo::FLOAT[], elmo::FLOAT[]) FROM "
                f"read_parquet('{tmp_path / name}/*.parquet') WHERE text = ? AND token_index = 0",
                [SENTENCES[0]],
            ).fetchone()
        np.testing.assert_allclose(got, expected, atol=2e-3 if name == "half" else 1e-5)
        assert similarity == pytest.approx(1.0, abs=1e-3)


def test_text_input_rerun_does_nothing_and_other_options_are_refused(tmp_path, allennlp_dir):
    (tmp_path / "in.txt").write_text("\n".join(SENTENCES) + "\n" + SENTENCES[0] + "\n", encoding="utf-8")
    first = embed(EmbedConfig(model=str(allennlp_dir), input=str(tmp_path / "in.txt"), out=str(tmp_path / "out")))
    assert first.rows == sum(len(s.split()) for s in SENTENCES) + 8  # text input keeps duplicate lines
    files = {p: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("part-*.parquet")}
    units = json.loads((tmp_path / "out" / "_manifest.json").read_text())["units"]
    assert {u["device"] for u in units} == {"cpu"}  # what wrote each unit
    again = embed(EmbedConfig(model=str(allennlp_dir), input=str(tmp_path / "in.txt"), out=str(tmp_path / "out")))
    assert again.units_done_before == again.units and again.tokens == 0
    assert files == {p: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("part-*.parquet")}
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["rows"] == first.rows and {u["device"] for u in manifest["units"]} == {""}  # none written again
    with pytest.raises(ConfigError, match="holds embeddings of another job"):
        embed(
            EmbedConfig(
                model=str(allennlp_dir), input=str(tmp_path / "in.txt"), out=str(tmp_path / "out"), layers="all"
            )
        )


@pytest.mark.slow
def test_kill_9_mid_job_then_rerun_gives_exactly_one_row_per_token(tmp_path, allennlp_dir):
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(300)]
    lines = [" ".join(rng.choice(words, size=rng.integers(3, 30))) + f" s{i}" for i in range(6000)]
    (tmp_path / "big.txt").write_text("\n".join(lines) + "\n")
    ingest(
        IngestConfig(sources=[str(tmp_path / "big.txt")], out=str(tmp_path / "ing"))
    )  # one row group: units cut it by tokens
    total_tokens = sum(len(line.split()) for line in lines)
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "elmo_core.cli",
        "embed",
        "--model",
        str(allennlp_dir),
        "--input",
        str(tmp_path / "ing"),
        "--out",
        str(out),
        "--layers",
        "all",
        "--unit-tokens",
        "4000",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 180
    while time.time() < deadline and len(list(out.glob("part-*.parquet"))) < 3:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list(out.glob("part-*.parquet")))
    assert 3 <= done < 24, "the job should have been killed part-way"
    rerun = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    assert f"({done} already done)" in rerun.stdout or f"({done + 1} already done)" in rerun.stdout
    con = duckdb.connect()
    files = sorted(str(p) for p in out.glob("part-*.parquet"))
    rel = con.read_parquet(files)  # noqa: F841  (DuckDB finds the relation by its variable name)
    rows, distinct = con.execute("SELECT count(*), count(DISTINCT (sentence_id, token_index)) FROM rel").fetchone()
    assert rows == distinct == total_tokens
    assert not list(out.glob("*.tmp"))


def test_query_nearest_tokens_and_sentences(corpus, tmp_path, allennlp_dir):
    embed(EmbedConfig(model=str(allennlp_dir), input=str(corpus), out=str(tmp_path / "tok")))
    store = EmbeddingStore(tmp_path / "tok")
    hits = store.nearest_tokens("apples", text=SENTENCES[0], k=5)
    assert len(hits) == 5 and hits == sorted(hits, key=lambda h: -h.similarity)
    assert all(-1.0 <= h.similarity <= 1.0 for h in hits)
    quoted = store.nearest_tokens("'", text=SENTENCES[2], k=2)  # parameters, not spliced SQL
    assert len(quoted) == 2
    only_apples = store.nearest_tokens("apples", text=SENTENCES[0], like="apple%")
    assert [h.token for h in only_apples] == ["Apple"]
    with pytest.raises(ConfigError, match="not found"):
        store.nearest_tokens("pears", text=SENTENCES[0])
    embed(EmbedConfig(model=str(allennlp_dir), input=str(corpus), out=str(tmp_path / "pool"), pool="mean"))
    pooled = EmbeddingStore(tmp_path / "pool")
    sid = pooled.con.execute("SELECT sentence_id FROM embeddings WHERE text = $t", {"t": SENTENCES[0]}).fetchone()[0]
    similar = pooled.similar_sentences(sid, k=3)
    assert len(similar) == 3 and similar[0].similarity >= similar[-1].similarity


def test_query_cli(corpus, tmp_path, allennlp_dir):
    embed(EmbedConfig(model=str(allennlp_dir), input=str(corpus), out=str(tmp_path / "tok")))
    result = run_elmo(
        "query", str(tmp_path / "tok"), "--token", "Apple", "--sentence", SENTENCES[1], "-k", "3", timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"nearest to 'Apple' (token 4) in: {SENTENCES[1]}")
    assert len(result.stdout.strip().splitlines()) == 4


@pytest.mark.slow
def test_a_model_trained_here_separates_two_senses_that_layer_0_cannot(tmp_path):
    """'bank' by the river vs 'bank' with money: contextual layers group by sense, layer 0 is one vector."""
    from elmo_core.data.vocab import VocabConfig, build_vocab
    from elmo_core.train.loop import TrainConfig, train

    rng = np.random.default_rng(0)
    river = ["river", "water", "fish", "boat", "muddy", "grassy", "shore", "stream", "ducks", "reeds"]
    money = ["money", "loan", "cash", "account", "credit", "savings", "deposit", "mortgage", "interest", "cheque"]

    def sentence(words: list[str]) -> str:
        a, b, c, d = rng.choice(words, size=4, replace=False)
        return f"the {a} {b} bank {c} {d} ."

    lines = [sentence(river if i % 2 else money) for i in range(3000)]
    (tmp_path / "senses.txt").write_text("\n".join(lines) + "\n")
    ingest(
        IngestConfig(
            sources=[str(tmp_path / "senses.txt")], out=str(tmp_path / "ing"), heldout_fraction=0.0, dedup=False
        )
    )
    build_vocab(VocabConfig(corpus=str(tmp_path / "ing"), db=str(tmp_path / "v" / "vocab.duckdb")))
    model = {
        "char_cnn": {"embedding": {"dim": 4}, "filters": [[1, 8], [2, 8], [3, 16], [4, 16]], "n_highway": 1},
        "lstm": {"dim": 32, "projection_dim": 16, "n_layers": 2},
    }
    result = train(
        TrainConfig(
            data=str(tmp_path / "v"),
            out=str(tmp_path / "run"),
            model=model,
            batch_size=16,
            unroll_steps=10,
            max_steps=250,
            n_negative_samples_batch=16,
            tracking="none",
            seed=1,
        )
    )
    river_probes = [sentence(river) for _ in range(6)]
    money_probes = [sentence(money) for _ in range(6)]
    river, probes_text = set(river_probes), river_probes + money_probes
    probes = tmp_path / "probes.txt"
    probes.write_text("\n".join(probes_text) + "\n")
    embed(EmbedConfig(model=str(result.model_dir), input=str(probes), out=str(tmp_path / "emb"), layers="all"))
    rows = [r for r in _read(tmp_path / "emb") if r["token"] == "bank"]
    sense = np.array([r["text"] in river for r in rows])
    assert len(rows) == 12

    def separation(layer: str) -> tuple[float, float, float]:
        """Mean within-sense and cross-sense cosine (vectors centred on their mean), and 1-NN sense accuracy."""
        v = np.array([r[layer] for r in rows], dtype=np.float64)
        v -= v.mean(0)
        norms = np.linalg.norm(v, axis=1, keepdims=True)
        if norms.max() < 1e-6:  # every vector the same: nothing to tell apart
            return 0.0, 0.0, 0.0
        v /= norms
        sim = v @ v.T
        np.fill_diagonal(sim, -np.inf)
        same = sim[(sense[:, None] == sense[None, :]) & ~np.eye(len(v), dtype=bool)].mean()
        cross = sim[sense[:, None] != sense[None, :]].mean()
        nearest_same = (sense[sim.argmax(1)] == sense).mean()
        return float(same), float(cross), float(nearest_same)

    assert separation("layer_0") == (0.0, 0.0, 0.0)  # layer 0 is context-free: one vector for every "bank"
    for layer in ("layer_1", "layer_2"):
        same, cross, nearest = separation(layer)
        assert same > cross and nearest >= 0.9, (layer, same, cross, nearest)


def test_the_readme_apple_query_runs_on_an_embedding_of_the_probes(tmp_path, allennlp_dir):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    sql = readme.split("<!-- apple-query -->", 1)[1].split("```sql", 1)[1].split("```", 1)[0]
    embed(
        EmbedConfig(
            model=str(allennlp_dir),
            input=str(ROOT / "data" / "probes" / "apple.txt"),
            out=str(tmp_path / "embed"),
            tokenizer="unicode",
        )
    )
    con = duckdb.connect()
    statements = [s for s in sql.replace("data/probe_vectors/", f"{tmp_path}/embed/").split(";") if s.strip()]
    for statement in statements[:-1]:
        con.execute(statement)
    rows = con.execute(statements[-1]).fetchall()
    assert len(rows) == 6 and rows[0][0] == "apples" and rows[0][2] == pytest.approx(1.0, abs=1e-5)
    assert all(rows[i][2] >= rows[i + 1][2] for i in range(5))


def test_tables_written_beside_the_model_are_the_same_files(tmp_path, allennlp_dir):
    """On a GPU each pass's table is written by a thread beside the model (``Job.writes_beside``): the same file,
    byte for byte, as one written in the model's thread, over many passes."""
    import dataclasses

    from elmo_core.vectors.embed import Embedder, plan_job

    words = "the apple of my eye is a red fruit on a tall tree".split()
    lines = [" ".join(words[i % 7 : i % 7 + 2 + i % 6]) for i in range(60)]
    config = EmbedConfig(
        model=str(allennlp_dir), input=str(ingested(tmp_path, lines, "many.txt")), out=str(tmp_path / "out"),
        layers="all", max_batch_tokens=40,
    )  # fmt: skip
    job = plan_job(config)
    assert not job.writes_beside  # on the CPU the cores are the model's
    written = {}
    for beside in (False, True):
        folder = tmp_path / f"beside-{beside}"
        folder.mkdir()
        embedder = Embedder(dataclasses.replace(job, writes_beside=beside))
        for unit in job.units:
            embedder.embed_unit(unit, folder)
        written[beside] = {p.name: p.read_bytes() for p in folder.glob("part-*.parquet")}
    assert written[True] == written[False] and written[False]
    assert pq.ParquetFile(next(iter((tmp_path / "beside-True").glob("part-*")))).metadata.num_row_groups > 5


def test_a_write_beside_the_model_keeps_the_order_and_its_failure_fails_the_unit():
    import threading

    from elmo_core.vectors.unit_file import writes as _writes

    class Disk:  # what a ParquetWriter offers _writes: tables in order, until the disk fails
        def __init__(self, fails: int = -1) -> None:
            self.tables: list[int] = []
            self.fails, self.second_began = fails, threading.Event()

        def write_table(self, table: int) -> None:
            if table == 1:
                self.second_began.set()
            if table == 0:  # a slow first write: a second writer thread would overtake it
                self.second_began.wait(timeout=0.3)
            if table == self.fails:
                raise OSError(28, "No space left on device")
            self.tables.append(table)

    disk = Disk()
    with _writes(disk, beside=True) as write:
        for table in range(5):
            write(table)
    assert disk.tables == [0, 1, 2, 3, 4]  # in order, all of them by the end
    handed = []
    with pytest.raises(OSError, match="No space"):  # failing while more tables are handed over: the next hand-over
        with _writes(Disk(fails=3), beside=True) as write:
            for table in range(8):
                write(table)
                handed.append(table)
    assert handed == [0, 1, 2, 3, 4]
    with pytest.raises(OSError, match="No space"):  # failing on the last table: at the end
        with _writes(Disk(fails=7), beside=True) as write:
            for table in range(8):
                write(table)
    with pytest.raises(RuntimeError, match="the pass failed"):  # the pass's own error, not a queued write's
        with _writes(Disk(fails=1), beside=True) as write:
            write(0)
            write(1)
            raise RuntimeError("the pass failed")


def test_the_plan_of_text_not_yet_tokenized_says_its_gpu_processes(tmp_path, allennlp_dir, monkeypatch):
    """``elmo embed --plan`` before the text is tokenized says, as the plan of a tokenized input does, that a machine
    of several GPUs runs one process per GPU (this CPU is shown two, as ``gpu_processes`` would find them)."""
    from elmo_core.vectors import embed as embed_module

    (tmp_path / "in.txt").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    config = EmbedConfig(model=str(allennlp_dir), input=str(tmp_path / "in.txt"), out=str(tmp_path / "out"))
    assert not any("one process per GPU" in line for line in embed_module.plan_lines(config))
    two = [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    monkeypatch.setattr(embed_module, "gpu_processes", lambda device: two)
    said = embed_module.plan_lines(config)
    assert any(
        "one process per GPU (0, 1), each taking units as it finishes one, where the text" in line for line in said
    )
    assert not (tmp_path / "out").exists()


def test_the_weights_are_prepared_before_the_first_unit(corpus, tmp_path, allennlp_dir, monkeypatch):
    """The embedder warms its runtime up once (``Runtime.warm_up``): the kernels' weights are prepared before the
    first unit starts its clock, so a unit's seconds (the manifest's, the ETA's) are its own work."""
    from elmo_core.bilm.kernels import cells
    from elmo_core.vectors.embed import Embedder, plan_job

    job = plan_job(EmbedConfig(model=str(allennlp_dir), input=str(corpus), out=str(tmp_path / "out"), layers="all"))
    embedder = Embedder(job)
    assert embedder.runtime.bilm.kernels.cpu_cells  # the CPU cell, whose weights are prepared on first use
    prepared, make = [], cells.CpuCell._weights
    monkeypatch.setattr(cells.CpuCell, "_weights", lambda cell, pair: prepared.append(pair) or make(cell, pair))
    (tmp_path / "units").mkdir()
    embedder.embed_unit(job.units[0], tmp_path / "units")
    assert prepared == []
    embedder.runtime.bilm.kernels.cache.clear()  # as if nothing had warmed it: the unit prepares them itself
    (tmp_path / "again").mkdir()
    embedder.embed_unit(job.units[0], tmp_path / "again")
    assert prepared
