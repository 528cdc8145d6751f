"""The bilm-tf batcher over real token-id Parquet: packing semantics, reversal, exact resume, rank sharding."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elmo_core.data.batches import LMBatcher, SentenceStream
from elmo_core.data.vocab import TOKEN_IDS_SCHEMA
from elmo_core.text.chars import raw_char_ids


def _write_token_ids(path: Path, sentences: list[list[int]], row_group_size: int = 1000) -> None:
    path.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "sentence_id": [f"s{i}" for i in range(len(sentences))],
            "tokens": [[f"w{t}" for t in s] for s in sentences],
            "ids": sentences,
        },
        schema=TOKEN_IDS_SCHEMA,
    )
    pq.write_table(table, path / "part-0.parquet", row_group_size=row_group_size)


def test_packing_follows_bilm_tf_get_batch(tmp_path):
    # <S>=0 </S>=1; sentences [5 6 7] and [8 9]
    _write_token_ids(tmp_path, [[5, 6, 7], [8, 9]])
    batcher = LMBatcher(tmp_path, batch_size=1, unroll_steps=3, shuffle=False, loop=True)
    batches = [next(iter(batcher)) for _ in range(4)]
    assert [b["token_ids"][0].tolist() for b in batches] == [[0, 5, 6], [7, 0, 8], [9, 0, 5], [6, 7, 0]]
    assert [b["next_token_id"][0].tolist() for b in batches] == [[5, 6, 7], [1, 8, 9], [1, 5, 6], [7, 1, 8]]
    # the backward LM reads reversed sentences: </S> 7 6 5 <S>, then </S> 9 8 <S>
    assert [b["token_ids_reverse"][0].tolist() for b in batches[:2]] == [[1, 7, 6], [5, 1, 9]]
    assert [b["next_token_id_reverse"][0].tolist() for b in batches[:2]] == [[7, 6, 5], [0, 9, 8]]
    chars = batches[0]["tokens_characters"][0]
    assert chars.shape == (3, 50) and chars.dtype == np.int32
    assert chars[1].tolist() == list(raw_char_ids("w5")) and chars[0].tolist() == list(raw_char_ids("<S>"))


def test_a_finite_pass_drops_the_incomplete_batch(tmp_path):
    _write_token_ids(tmp_path, [[5, 6, 7], [8, 9]])
    # 3 + 2 = 5 input positions of (n + 1) per sentence, batch 1 × unroll 1: 7 batches, then stop
    assert sum(1 for _ in LMBatcher(tmp_path, 1, 1, shuffle=False, loop=False)) == 7
    assert sum(1 for _ in LMBatcher(tmp_path, 2, 3, shuffle=False, loop=False)) == 1


def test_resume_yields_exactly_the_same_batches(tmp_path):
    rng = np.random.default_rng(0)
    _write_token_ids(
        tmp_path, [rng.integers(3, 50, size=rng.integers(1, 12)).tolist() for _ in range(300)], row_group_size=40
    )
    reference = LMBatcher(tmp_path, batch_size=4, unroll_steps=5, seed=3)
    it = iter(reference)
    for _ in range(57):
        next(it)
    saved = json.loads(json.dumps(reference.state_dict()))  # serializable
    expected = [next(it) for _ in range(200)]  # crosses row groups and epochs
    resumed = LMBatcher(tmp_path, batch_size=4, unroll_steps=5, seed=3)
    resumed.load_state_dict(saved)
    for want, got in zip(expected, resumed):
        for key in want:
            assert np.array_equal(want[key], got[key]), key
    assert reference.forward.stream.epoch >= 1


def test_forward_and_backward_streams_are_shuffled_independently(tmp_path):
    _write_token_ids(tmp_path, [[i + 3] for i in range(200)], row_group_size=50)
    batch = next(iter(LMBatcher(tmp_path, batch_size=8, unroll_steps=2, seed=0)))
    forward_words = batch["token_ids"][:, 1].tolist()
    backward_words = batch["token_ids_reverse"][:, 1].tolist()
    assert forward_words != backward_words


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_get_disjoint_sentences_covering_the_corpus(tmp_path, world):
    _write_token_ids(tmp_path, [[i + 3] for i in range(100)], row_group_size=30)
    files = [tmp_path / "part-0.parquet"]
    seen = []
    for rank in range(world):
        stream = SentenceStream(files, seed=1, rank=rank, world=world, loop=False)
        seen.append({int(group.ids[group.starts[n] + 1]) for group, n in stream})
    assert sum(len(s) for s in seen) == 100
    assert set().union(*seen) == set(range(3, 103))


def _corpus(path: Path, n: int = 300) -> None:
    rng = np.random.default_rng(1)
    _write_token_ids(
        path, [rng.integers(3, 50, size=rng.integers(1, 12)).tolist() for _ in range(n)], row_group_size=40
    )


def test_prefetched_batches_not_yet_taken_are_not_lost_from_the_position(tmp_path):
    """The thread runs ahead (a queue of 3); a checkpoint's position is the one after the last batch taken, so a
    run resumed from it gets exactly the batches the uninterrupted run gets next."""
    import torch

    from elmo_core.data.prefetch import KEYS, Prefetcher

    _corpus(tmp_path)
    plain = LMBatcher(tmp_path, batch_size=4, unroll_steps=5, seed=3)
    expected = [plain.next_batch() for _ in range(30)]
    ahead = Prefetcher(LMBatcher(tmp_path, batch_size=4, unroll_steps=5, seed=3), torch.device("cpu"), depth=3)
    for i in range(12):
        got = ahead.next()
        assert all(torch.equal(got[k], torch.from_numpy(expected[i][k]).long()) for k in KEYS)
    time.sleep(0.2)  # the thread has filled its queue: batches 13-15 (and one in hand) are made, not taken
    state = json.loads(json.dumps(ahead.state_dict()))
    resumed = Prefetcher(LMBatcher(tmp_path, batch_size=4, unroll_steps=5, seed=3), torch.device("cpu"), depth=2)
    resumed.load_state_dict(state)
    for i in range(12, 30):
        for run in (ahead, resumed):
            got = run.next()
            assert all(torch.equal(got[k], torch.from_numpy(expected[i][k]).long()) for k in KEYS), (i, run)
    ahead.close()
    assert ahead.batcher.state_dict() == plain.state_dict()  # close() puts the generator back where it was taken
    resumed.close()


def test_prefetch_ends_a_finite_pass_and_hands_errors_to_the_trainer(tmp_path):
    import torch

    from elmo_core.data.prefetch import Prefetcher

    _corpus(tmp_path, 20)
    finite = Prefetcher(LMBatcher(tmp_path, 2, 3, shuffle=False, loop=False), torch.device("cpu"), depth=2)
    taken = 0
    while finite.next() is not None:
        taken += 1
    assert taken == sum(1 for _ in LMBatcher(tmp_path, 2, 3, shuffle=False, loop=False))
    finite.close()
    broken = LMBatcher(tmp_path, 2, 3)
    broken.next_batch = lambda: (_ for _ in ()).throw(OSError("disk gone"))  # type: ignore[method-assign]
    with pytest.raises(OSError, match="disk gone"):
        Prefetcher(broken, torch.device("cpu"), depth=2).next()
