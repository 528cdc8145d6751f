"""Every long stage reports its progress (begin, updates, end) through elmo_core.progress; without a terminal
and without a sink it logs lines with the ETA."""

from __future__ import annotations

import logging

from elmo_core.data.vocab import build_vocab
from elmo_core.ingest import ingest
from elmo_core.options import IngestConfig, TrainConfig, VocabConfig
from elmo_core.progress import add_sink, track
from elmo_core.train.loop import train
from elmo_core.vectors.embed import EmbedConfig, embed


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, float]] = []

    def begin(self, progress):
        self.events.append(("begin", progress.name, progress.total or 0))

    def update(self, progress, line):
        self.events.append(("update", progress.name, progress.done))

    def end(self, progress, seconds):
        self.events.append(("end", progress.name, progress.done))

    def stages(self, kind: str) -> list[str]:
        return [name for k, name, _ in self.events if k == kind]


def test_ingest_vocab_train_evaluate_and_embed_report_progress(tmp_path, allennlp_dir):
    lines = [f"the {w} sat on the mat number {i} ." for i, w in enumerate(["cat", "dog", "bird", "fox"] * 30)]
    (tmp_path / "c.txt").write_text("\n".join(lines) + "\n")
    recorder = Recorder()
    with add_sink(recorder):
        ingest(IngestConfig(sources=[str(tmp_path / "c.txt")], out=str(tmp_path / "ing"), heldout_fraction=0.2))
        build_vocab(VocabConfig(corpus=str(tmp_path / "ing"), db=str(tmp_path / "v" / "vocab.duckdb")))
        train(
            TrainConfig(
                data=str(tmp_path / "v"),
                out=str(tmp_path / "run"),
                max_steps=6,
                batch_size=4,
                unroll_steps=5,
                n_negative_samples_batch=8,
                tracking="none",
            )
        )
        embed(
            EmbedConfig(
                model=str(allennlp_dir), input=str(tmp_path / "ing"), out=str(tmp_path / "emb"), unit_tokens=200
            )
        )
    assert set(recorder.stages("end")) == {"ingest", "vocab", "train", "evaluate", "embed"}
    for stage in ("ingest", "vocab", "train", "evaluate", "embed"):
        assert stage in recorder.stages("begin") and stage in recorder.stages("update")
    train_done = [done for k, name, done in recorder.events if name == "train" and k == "end"]
    assert train_done == [6]


def test_without_a_terminal_progress_is_logged_with_an_eta(caplog, monkeypatch):
    times = iter(range(0, 1000, 3))
    monkeypatch.setattr("elmo_core.progress.time.perf_counter", lambda: float(next(times)))
    with caplog.at_level(logging.INFO, logger="elmo_core.progress"):
        with track("train", 100, "steps") as progress:
            for step in range(1, 101):
                progress.update(step, f"loss {5 - step / 50:.2f}")
    lines = [r.getMessage() for r in caplog.records]
    assert 9 <= len(lines) <= 11  # about every 10%
    assert lines[0].startswith("train: 10/100 steps (10%), ETA ") and lines[0].endswith("loss 4.80")


def test_a_launched_ranks_progress_lines_move_this_process_progress():
    """launch.ProgressRelay: rank 0's progress log lines, as torchrun streams them, drive a local progress (and so
    the Prefect artifact); other lines pass through."""
    from elmo_core.progress import add_sink
    from elmo_core.train.launch import ProgressRelay

    class Recorder:
        def __init__(self) -> None:
            self.events: list[tuple[str, str, float]] = []

        def begin(self, progress) -> None:  # noqa: ANN001
            self.events.append(("begin", progress.name, progress.total))

        def update(self, progress, line) -> None:  # noqa: ANN001
            self.events.append(("update", progress.name, progress.done))

        def end(self, progress, seconds) -> None:  # noqa: ANN001
            self.events.append(("end", progress.name, progress.done))

    recorder = Recorder()
    with add_sink(recorder):
        relay = ProgressRelay()
        assert relay.feed(
            "2026-12-01 19:32:39,606 elmo_core.progress INFO train: 24/240 steps (10%), ETA 0:41, loss 4.1"
        )
        assert relay.feed("train: 1,200/2,400 steps (50%), ETA 1:02:03")
        assert not relay.feed("2026-12-01 19:32:40,001 elmo_core.train.loop INFO checkpoint /x/step-000000020.pt")
        assert relay.feed("evaluate: 3/3 batches (100%), ETA 0:00, perplexity 61.2")
        relay.close()
    assert recorder.events[:2] == [("begin", "train", 240.0), ("update", "train", 24.0)]
    assert ("begin", "train", 2400.0) in recorder.events and ("update", "train", 1200.0) in recorder.events
    assert ("end", "evaluate", 3.0) in recorder.events and recorder.events[-1] == ("end", "train", 1200.0)


def test_a_launch_failure_names_the_rank_killed_not_the_ranks_it_broke(tmp_path):
    """torchrun lists the other failures before its root cause; a rank killed by a signal that torchrun does not send
    (it stops the others with SIGTERM) is the cause, named even where another rank failed first."""
    from elmo_core.train.launch import _failure

    def block(rank: int, code: int) -> list[str]:
        return [f"  rank      : {rank} (local_rank: {rank})", f"  exitcode  : {code} (pid: 12{rank})"]

    def summary(others: list[tuple[int, int]], root: tuple[int, int]) -> list[str]:
        lines = ["elmo_core.cli FAILED", "Failures:"]
        for rank, code in others:
            lines += ["[1]:", *block(rank, code)]
        return [*lines, "Root Cause (first observed failure):", "[0]:", *block(*root)]

    killed = _failure(summary([(0, -15)], (1, -9)), tmp_path, 1)  # torchrun stopped rank 0 after rank 1's kill
    assert killed.startswith("rank 1 of the launched training failed (killed by SIGKILL)")
    broken = _failure(summary([(1, -9)], (0, 1)), tmp_path, 1)  # rank 0 failed first, on its link to rank 1
    assert broken.startswith("rank 1 of the launched training failed (killed by SIGKILL)")
    plain = _failure(summary([(0, -15)], (1, 1)), tmp_path, 1)
    assert plain.startswith("rank 1 of the launched training failed (exit code 1)")
    assert _failure(["something else"], tmp_path, 3).startswith("the launched training failed (exit code 3)")
