"""Character ids against bilm-tf's own batcher test (values listed in the fixtures README)."""

import numpy as np
import torch

from elmo_core.text.chars import batch_to_ids, char_ids, distinct_rows, raw_char_ids, tokens_to_char_array

PAD = [261]


def test_bilm_tf_batcher_examples():
    assert char_ids("<S>") == [259, 257, 260] + PAD * 47
    assert char_ids("</S>") == [259, 258, 260] + PAD * 47
    assert char_ids("The") == [259, 85, 105, 102, 260] + PAD * 45
    assert char_ids("first")[:8] == [259, 103, 106, 115, 116, 117, 260, 261]
    assert char_ids("sentence")[:11] == [259, 116, 102, 111, 117, 102, 111, 100, 102, 260, 261]
    assert char_ids("Second")[:9] == [259, 84, 102, 100, 112, 111, 101, 260, 261]
    assert char_ids(".")[:4] == [259, 47, 260, 261]


def test_batch_to_ids_pads_with_zero_tokens_and_adds_no_boundaries():
    ids = batch_to_ids([["The", "first", "sentence"], ["Second", "."]])
    assert ids.shape == (2, 3, 50) and ids.dtype == torch.int64
    assert ids[1, 0].tolist() == char_ids("Second")
    assert ids[1, 2].tolist() == [0] * 50  # padding token
    assert batch_to_ids([[], []]).shape == (2, 0, 50)


def test_raw_scheme_is_inference_minus_one():
    raw = tokens_to_char_array(["apple", "<S>"], raw=True)
    assert (raw + 1 == tokens_to_char_array(["apple", "<S>"])).all()
    assert raw.max() <= 260 and raw.min() >= 0


def test_unicode_is_utf8_bytes():
    # 苹 = e8 8b b9, 果 = e6 9e 9c
    assert list(raw_char_ids("苹果")[:8]) == [258, 0xE8, 0x8B, 0xB9, 0xE6, 0x9E, 0x9C, 259]


def test_long_tokens_are_cut_to_48_bytes_even_mid_character():
    word = "é" * 30  # 60 bytes
    row = raw_char_ids(word)
    assert len(row) == 50
    assert row[0] == 258 and row[49] == 259
    assert bytes(row[1:49]) == word.encode()[:48]
    assert raw_char_ids("x" * 1000)[49] == 259


def test_distinct_rows_is_torch_unique_over_rows():
    """The model's distinct-word step gives exactly what torch.unique(dim=0) gives: rows and inverse, on Zipfian
    batches of real-looking words, one row, all rows equal, and rows that differ only in their last id."""
    rng = np.random.default_rng(0)
    words = torch.from_numpy(tokens_to_char_array([f"w{i}ord{'x' * (i % 9)}" for i in range(500)])).long()
    tail = torch.full((3, 50), 261)
    tail[1, -1], tail[2, -1] = 7, 8
    cases = [words[torch.from_numpy(rng.zipf(1.3, 1280) % 500)], words[:1], words[[3] * 40], tail, words[:0]]
    for rows in cases:
        expected = torch.unique(rows, dim=0, return_inverse=True)
        got = distinct_rows(rows)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
