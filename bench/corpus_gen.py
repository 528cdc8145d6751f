"""Synthetic Zipfian corpora for the data-layer benchmarks (made-up words; nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def zipf_words(n_types: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lengths = np.clip(rng.poisson(5, size=n_types) + 1, 1, 20)
    return np.array(["".join(rng.choice(letters, size=k)) + str(i % 10) for i, k in enumerate(lengths)], dtype=object)


def write_text_corpus(path: Path, target_bytes: int, n_types: int = 200_000, seed: int = 0) -> int:
    """Lines of 5–40 Zipf-distributed tokens until ``target_bytes``; returns the token count."""
    rng = np.random.default_rng(seed)
    words = zipf_words(n_types, seed)
    written = tokens = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target_bytes:
            lengths = rng.integers(5, 41, size=10_000)
            ids = np.minimum(rng.zipf(1.2, size=int(lengths.sum())) - 1, n_types - 1)
            flat = words[ids]
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            block = "".join(" ".join(flat[s : s + k]) + "\n" for s, k in zip(starts, lengths))
            f.write(block)
            written += len(block.encode())
            tokens += int(lengths.sum())
    return tokens
