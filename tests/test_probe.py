"""Probes: the WordNet reader on a sample written here in WordNet's file format, 1-NN scoring and its tie rule,
layer 0 = most frequent sense, the tagging probe (deterministic), MLflow logging and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from elmo_core import BiLM
from elmo_core.errors import InputError
from elmo_core.options import TagConfig, WsdConfig
from elmo_core.text.wordnet import SenseExample, base_forms, read_wordnet
from elmo_core.vectors.probe import read_sense_examples, read_tagged, run_tag, run_wsd, wsd_scores
from tests.helpers import run_elmo

ROOT = Path(__file__).resolve().parent.parent
TAGGING = ROOT / "data" / "probes" / "tagging"
HEADER = "  1 This is a sample in the WordNet 3.0 database format, written for these tests.\n  2 \n"

# (offset, lemma, pos, gloss with quoted examples): invented synsets, WordNet's layout
SYNSETS = [
    (
        "00000100",
        "bank",
        "n",
        'land beside a river; "they fished from the bank of the river"; "the banks were muddy after the rain"',
    ),
    (
        "00000200",
        "bank",
        "n",
        'a business that keeps money; "he opened an account at the bank"; "the bank raised its rates"',
    ),
    ("00000300", "bank", "n", 'a long row; "a row of dark clouds"'),
    ("00000400", "mouse", "n", 'a small rodent; "the mice ate the cheese"'),
    ("00000500", "mouse", "n", 'a pointing device; "click the mouse twice"'),
    ("00000810", "stool", "n", 'a seat without a back; "he sat on a stool"'),
    ("00000820", "stool", "n", 'a sample for a doctor; "the nurse asked for a sample"'),
    ("00000950", "river_bank", "n", 'the land along a river; "the river bank was steep"'),
    ("00001100", "run", "v", 'move fast on foot; "she runs every morning"; "he ran to the station"'),
    ("00001200", "run", "v", 'manage; "they run a small shop"'),
]


def write_wordnet_sample(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for pos, name in (("n", "noun"), ("v", "verb"), ("a", "adj"), ("r", "adv")):
        synsets = [s for s in SYNSETS if s[2] == pos]
        data = "".join(f"{offset} 00 {pos} 01 {lemma} 0 000 | {gloss}  \n" for offset, lemma, _, gloss in synsets)
        lemmas: dict[str, list[str]] = {}
        for offset, lemma, _, _ in synsets:
            lemmas.setdefault(lemma, []).append(offset)
        index = "".join(
            f"{lemma} {pos} {len(o)} 1 @ {len(o)} 1 {' '.join(o)}  \n" for lemma, o in sorted(lemmas.items())
        )
        (folder / f"data.{name}").write_text(HEADER + data)
        (folder / f"index.{name}").write_text(HEADER + index)
    (folder / "noun.exc").write_text("mice mouse\n")
    (folder / "verb.exc").write_text("ran run\n")
    return folder


def test_the_wordnet_reader_finds_each_lemma_s_inflected_forms_and_keeps_ambiguous_lemmas(tmp_path):
    records = read_wordnet(write_wordnet_sample(tmp_path / "wn"))
    by_lemma = {}
    for r in records:
        by_lemma.setdefault(r.lemma, []).append(r)
    assert sorted(by_lemma) == [
        "bank.n",
        "mouse.n",
        "run.v",
    ]  # stool has one exemplified sense; river_bank is multi-word
    assert [(r.sense, r.sense_number, r.tokens[r.index]) for r in by_lemma["bank.n"]] == [
        ("00000100-n", 1, "bank"),
        ("00000100-n", 1, "banks"),
        ("00000200-n", 2, "bank"),
        ("00000200-n", 2, "bank"),
    ]
    assert [r.tokens[r.index] for r in by_lemma["mouse.n"]] == ["mice", "mouse"]  # noun.exc
    assert [r.tokens[r.index] for r in by_lemma["run.v"]] == ["runs", "ran", "run"]  # a rule, verb.exc, itself
    assert "walk" in base_forms("walking", "v", {}) and "city" in base_forms("cities", "n", {})
    with pytest.raises(InputError, match="not a WordNet 3.0 database folder .*`sudo apt-get install wordnet-base`"):
        read_wordnet(tmp_path)


def test_wordnet_definitions_without_their_examples_as_a_corpus(tmp_path):
    from elmo_core.text.wordnet import write_definitions

    lines = write_definitions(write_wordnet_sample(tmp_path / "wn"), tmp_path / "definitions.txt")
    text = (tmp_path / "definitions.txt").read_text()
    assert lines == len(SYNSETS) and "land beside a river" in text and "a business that keeps money" in text
    assert "fished" not in text and '"' not in text  # no probe sentence leaks into the training text


def test_sense_files_in_jsonl_and_tsv_and_their_errors(tmp_path):
    (tmp_path / "s.jsonl").write_text(
        json.dumps({"tokens": ["a", "bank"], "index": 1, "sense": "x", "lemma": "bank.n"}) + "\n"
    )
    (tmp_path / "s.tsv").write_text("a bank\t1\tx\tbank.n\t2\ttrain\n")
    assert read_sense_examples(tmp_path / "s.jsonl") == [SenseExample(("a", "bank"), 1, "x", "bank.n", 0, None)]
    assert read_sense_examples(tmp_path / "s.tsv") == [SenseExample(("a", "bank"), 1, "x", "bank.n", 2, "train")]
    (tmp_path / "bad.jsonl").write_text(
        '{"tokens": ["a"], "index": 0, "sense": "x", "lemma": "a.n"}\n{"tokens": ["a"]}\n'
    )
    with pytest.raises(InputError, match=r"bad.jsonl:2: expected JSON with tokens, index, sense, lemma"):
        read_sense_examples(tmp_path / "bad.jsonl")
    (tmp_path / "out.tsv").write_text("a bank\t5\tx\tbank.n\n")
    with pytest.raises(InputError, match=r"out.tsv:1: index 5 is outside the sentence's 2 tokens"):
        read_sense_examples(tmp_path / "out.tsv")


def _examples(senses: list[str], split: list[str | None] | None = None) -> list[SenseExample]:
    return [
        SenseExample(("w",), 0, s, "w.n", {"A": 1, "B": 2}[s], (split or [None] * len(senses))[i])
        for i, s in enumerate(senses)
    ]


def test_one_nearest_neighbour_its_tie_rule_and_the_baseline():
    examples = _examples(["A", "A", "A", "B", "B"])
    separated = np.array([[1, 0.1], [1, 0.2], [1, 0.3], [0.1, 1], [0.2, 1]], dtype=np.float32)
    same = np.ones((5, 2), dtype=np.float32)  # every cosine ties
    scores = wsd_scores(examples, {"apart": separated, "tied": same})
    assert scores["accuracy"]["apart"] == 1.0
    # leave-one-out MFS: an A query sees A:2 B:2 (tie → sense 1, right); a B query sees A:3 B:1 (wrong)
    assert scores["mfs"] == pytest.approx(3 / 5)
    assert scores["accuracy"]["tied"] == scores["mfs"]  # all tied → the more frequent sense, then the lower number
    assert scores["coverage"] == 1.0 and scores["answerable"] == 5
    split = wsd_scores(
        _examples(["A", "B", "A", "B"], ["train", "train", "test", "test"]), {"apart": separated[[0, 3, 1, 4]]}
    )
    assert (split["occurrences"], split["accuracy"]["apart"], split["protocol"]) == (2, 1.0, "train/test split")


@pytest.fixture(scope="module")
def bank_senses(tmp_path_factory) -> Path:
    """'bank' and 'bat', always in the same surface form, in two senses each."""
    river = [
        "we walked along the bank of the river",
        "the boat reached the bank at dusk",
        "fish hide near the bank in summer",
    ]
    money = ["she took a loan from the bank", "the bank charged a high interest rate", "my savings are in the bank"]
    animal = ["a bat flew out of the cave at night", "the bat hung upside down"]
    sport = ["he swung the bat at the ball", "the player dropped his bat"]
    path = tmp_path_factory.mktemp("senses") / "senses.jsonl"
    rows = []
    for sentences, sense, lemma, number in (
        (river, "bank.river", "bank.n", 1),
        (money, "bank.money", "bank.n", 2),
        (animal, "bat.animal", "bat.n", 1),
        (sport, "bat.club", "bat.n", 2),
    ):
        for sentence in sentences:
            tokens = sentence.split()
            rows.append(
                {
                    "tokens": tokens,
                    "index": tokens.index(lemma[:-2]),
                    "sense": sense,
                    "lemma": lemma,
                    "sense_number": number,
                }
            )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_layer_0_equals_the_most_frequent_sense_baseline(bank_senses, allennlp_dir, tmp_path):
    results = run_wsd(
        WsdConfig(model=str(allennlp_dir), data=str(bank_senses), out=str(tmp_path / "wsd"), tracking="none")
    )
    assert results["accuracy"]["layer_0"] == results["mfs"]  # context-free vectors tie, so the tie rule decides
    assert set(results["accuracy"]) == {"layer_0", "layer_1", "layer_2", "mix"}
    written = json.loads((tmp_path / "wsd" / "results.json").read_text())
    assert written["accuracy"] == results["accuracy"] and written["tokens_per_s"] > 0
    assert (tmp_path / "wsd" / "chart.png").read_bytes()[:4] == b"\x89PNG"
    assert len((tmp_path / "wsd" / "examples.jsonl").read_text().splitlines()) == 10


def test_identical_words_get_identical_layer_0_vectors_whatever_their_batch(allennlp_dir, monkeypatch):
    import elmo_core.bilm.inference as inference

    monkeypatch.setattr(inference, "CACHE_TOKENS", 8)  # every few sentences a new token cache
    bilm = BiLM.from_pretrained(str(allennlp_dir))
    sentences = [
        ["the", "bank"],
        ["a", "very", "long", "sentence", "about", "the", "bank"],
        ["bank"],
        ["x"] * 30 + ["bank"],
    ]
    vectors = bilm.embed_sentences(sentences)
    zeros = [v[0, list(s).index("bank")] for v, s in zip(vectors, sentences)]
    assert all(np.array_equal(zeros[0], z) for z in zeros[1:])


def test_the_tagging_probe_is_deterministic_and_reports_every_layer_and_the_mix(allennlp_dir, tmp_path):
    def run(out: str) -> dict:
        return run_tag(
            TagConfig(
                model=str(allennlp_dir),
                train=str(TAGGING / "train.tsv"),
                dev=str(TAGGING / "dev.tsv"),
                test=str(TAGGING / "test.tsv"),
                out=str(tmp_path / out),
                epochs=4,
                min_steps=40,
                tracking="none",
            )
        )

    first, second = run("a"), run("b")
    assert first["test"] == second["test"] and first["dev"] == second["dev"]
    assert set(first["test"]["accuracy"]) == {"layer_0", "layer_1", "layer_2", "mix"}
    assert all(0.0 <= v <= 1.0 for v in first["test"]["macro_f1"].values())
    weights = first["learned_mix"]["weights"]
    assert len(weights) == 3 and sum(weights) == pytest.approx(1.0) and first["learned_mix"]["gamma"] > 0
    assert weights != [1 / 3] * 3  # the mix was learned, not left at its start
    assert first["train_tokens"] == 681 and "NOUN" in first["tags"]


def test_tagged_files_conllu_and_columns(tmp_path):
    conllu = (
        "# text = I can fish\n1\tI\tI\tPRON\tPRP\t_\t2\tnsubj\t_\t_\n2-3\tcan't\t_\t_\t_\t_\t_\t_\t_\t_\n"
        "2\tcan\tcan\tAUX\tMD\t_\t0\troot\t_\t_\n3\tfish\tfish\tVERB\tVB\t_\t2\txcomp\t_\t_\n\n"
    )
    (tmp_path / "a.conllu").write_text(conllu)
    assert read_tagged(tmp_path / "a.conllu") == [(["I", "can", "fish"], ["PRON", "AUX", "VERB"])]
    assert read_tagged(tmp_path / "a.conllu", "xpos")[0][1] == ["PRP", "MD", "VB"]
    (tmp_path / "b.tsv").write_text("I PRON\ncan AUX extra\n")
    with pytest.raises(InputError, match=r"b.tsv:2: expected token tag, found 3 fields"):
        read_tagged(tmp_path / "b.tsv")


@pytest.mark.slow
def test_a_probe_is_an_mlflow_run_with_per_layer_metrics_and_the_chart(bank_senses, allennlp_dir, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    results = run_wsd(
        WsdConfig(model=str(allennlp_dir), data=str(bank_senses), out=str(tmp_path / "wsd"), tracking_uri=uri)
    )
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(results["mlflow_run_id"])
    assert {
        "wsd/acc/layer_0",
        "wsd/acc/layer_2",
        "wsd/acc/mix",
        "wsd/mfs",
        "wsd/coverage",
        "probe/tokens_per_s",
    } <= set(run.data.metrics)
    assert run.data.metrics["wsd/acc/layer_0"] == pytest.approx(results["accuracy"]["layer_0"])
    assert run.data.tags["elmo.probe"] == "wsd" and run.data.params["probe.model"] == str(allennlp_dir)
    assert {"chart.png", "results.json"} <= {a.path for a in client.list_artifacts(run.info.run_id)}


@pytest.mark.slow
def test_elmo_probe_on_the_command_line(tmp_path, allennlp_dir):
    wordnet = write_wordnet_sample(tmp_path / "wn")
    done = run_elmo(
        "probe",
        "wsd",
        "--model",
        str(allennlp_dir),
        "--data",
        str(wordnet),
        "--out",
        str(tmp_path / "out"),
        "--tracking",
        "none",
    )
    assert done.returncode == 0, done.stderr
    assert "| layer_2 |" in done.stdout and "| most frequent sense |" in done.stdout
    assert json.loads((tmp_path / "out" / "results.json").read_text())["occurrences"] == 9
    missing = run_elmo(
        "probe", "wsd", "--model", str(allennlp_dir), "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o2")
    )
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert (
        missing.stderr.strip()
        .splitlines()[-1]
        .startswith(f"elmo probe wsd: error: {tmp_path / 'nowhere'}: no such file")
    )
