"""A model process as the HTTP process meets it: a real process on the fixture biLM, spoken to through its pipe.

It says ``computed`` as soon as the model is done with a batch and takes the next one while its answer thread
encodes and sends the last; the pool counts a batch whose answer has not come as the process's, so a process lost
then fails that batch's requests too."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import numpy as np

from elmo_core import BiLM
from elmo_core.runtime import resolve_model
from elmo_core.serve.api import Answer, Batch, Output
from elmo_core.serve.workers import RESTARTS_BEFORE_GIVING_UP, Worker, WorkerEvents, WorkerPlan, WorkerPool, worker_main

SENTENCES = [["The", "cat", "sat", "."], ["Hi"], ["A", "much", "longer", "sentence", "than", "the", "others", "."]]


def _plan(model_dir: Path) -> WorkerPlan:
    return WorkerPlan(resolve_model(str(model_dir)).pinned(), "cpu", "fp32", "asked for fp32", 1, 4096)


def test_a_model_process_takes_the_next_batch_before_it_answers_the_last(allennlp_dir: Path) -> None:
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=worker_main, args=(child, _plan(allennlp_dir)), daemon=True)
    process.start()
    child.close()
    try:
        assert parent.poll(120) and parent.recv()[0] == "ready"
        spec = Output("layers", encoding="binary")
        parent.send(Batch(1, SENTENCES, [0, 0, 0], [spec]))
        assert parent.poll(60) and parent.recv() == ("computed", 1)  # before its answer: the model is free
        parent.send(Batch(2, SENTENCES[::-1], [0, 0, 0], [spec]))  # sent before batch 1's answer is read
        messages = []
        while len(messages) < 3 and parent.poll(60):
            messages.append(parent.recv())
        parent.send(None)
        process.join(30)
    finally:
        if process.is_alive():
            process.kill()
    kinds = [m[0] if m[0] != "done" else ("done", m[1].id) for m in messages]
    assert sorted(kinds, key=str) == sorted([("done", 1), "computed", ("done", 2)], key=str)
    assert kinds.index("computed") < kinds.index(("done", 2))
    answers = {m[1].id: m[1] for m in messages if m[0] == "done"}
    alone = BiLM.from_pretrained(str(allennlp_dir)).embed_sentences(SENTENCES)
    for batch_id, order in ((1, SENTENCES), (2, SENTENCES[::-1])):
        for sentence, shape, data in zip(order, answers[batch_id].shapes, answers[batch_id].embeddings, strict=True):
            expected = alone[SENTENCES.index(sentence)]
            np.testing.assert_allclose(np.frombuffer(data, "<f4").reshape(shape), expected, atol=1e-5, rtol=0)
    assert process.exitcode == 0  # ended when told, its answer thread done


class _Events(WorkerEvents):
    def __init__(self) -> None:
        self.lost: list[list[int]] = []
        self.computed = 0
        self.fatal_lines: list[str] = []

    def batch_computed(self, worker: Worker) -> None:
        self.computed += 1

    def worker_lost(self, worker: Worker, batches: list[Batch], exitcode: int | None) -> None:
        self.lost.append([b.id for b in batches])

    def fatal(self, message: str) -> None:
        self.fatal_lines.append(message)


def test_a_process_lost_with_an_answer_unsent_fails_that_batch_too(allennlp_dir: Path) -> None:
    """The pool's view, told what a process's pipe would tell it: batch 1 computed (its answer not yet come), batch 2
    computing, then the process ends. Both batches are reported lost; batch 1's answer, had it come, is its own."""
    events = _Events()
    pool = WorkerPool(_plan(allennlp_dir), events, call=lambda f, *a: f(*a))
    worker = pool.workers[0]
    worker.conn, other_end = multiprocessing.Pipe()  # what the pool sends goes there; no process reads it
    worker.ready, worker.alive = True, True
    worker.deaths_in_a_row = RESTARTS_BEFORE_GIVING_UP  # its loss then stops the pool rather than spawning
    first, second = Batch(1, SENTENCES, [0, 0, 0], [Output()]), Batch(2, SENTENCES, [0, 0, 0], [Output()])
    pool.send(worker, first)
    assert pool.idle() is None
    pool._on_computed(worker, 1)
    assert events.computed == 1 and pool.idle() is worker and pool.busy  # free for the next, still answering
    pool.send(worker, second)
    pool._on_lost(worker, -9)
    assert events.lost == [[2, 1]] and not pool.busy
    assert events.fatal_lines  # died past the restarts allowed: the pool says so instead of spawning again
    pool.send(worker, first)  # a late answer for a batch no longer held leaves the next batch alone
    pool._on_done(worker, Answer(7, [], [], 0.0))
    assert worker.batch is first
