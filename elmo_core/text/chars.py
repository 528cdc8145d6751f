"""Character ids: the bilm-tf / AllenNLP scheme, and the only place its conventions live.

Two schemes share one layout (a row of ``max_chars`` ids per token):

* **raw** (bilm-tf training, ``n_characters`` 261): byte values 0..255, then
  256 begin-of-sentence, 257 end-of-sentence, 258 begin-of-word, 259 end-of-word, 260 in-word padding.
* **inference** (bilm-tf ``Batcher``, AllenNLP ``batch_to_ids``): every raw id + 1, so that 0 is free to mean
  "padding token" (a whole row of zeros). The model's char table has 262 rows, row 0 all zeros.

The model always works in the inference scheme; training batches hold raw ids, which ``model_ids`` converts.
A token is its UTF-8 bytes cut to ``max_chars - 2`` (a cut may split a multi-byte character, as upstream).
The strings ``<S>`` and ``</S>`` always get the sentence-boundary patterns (AllenNLP's behaviour).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported where a tensor is made: the CLI reads these constants without loading it
    import torch

MAX_CHARS = 50
N_RAW_CHARS = 261  # rows of bilm-tf's trained char_embed
N_CHARS = 262  # rows of the inference char table (raw + the zero padding row)

BOS_CHAR = 256
EOS_CHAR = 257
BOW_CHAR = 258
EOW_CHAR = 259
PAD_CHAR = 260

BOS_TOKEN = "<S>"
EOS_TOKEN = "</S>"
UNK_TOKEN = "<UNK>"

# A training vocabulary (bilm-tf's vocab.txt) starts with these three, in this order; their ids are fixed.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
BOS_ID, EOS_ID, UNK_ID = 0, 1, 2

# Inference ids are raw ids + 1, which frees 0 to mean "padding token"; the model reads only those.
INFERENCE_OFFSET = 1
PAD_ID = PAD_CHAR + INFERENCE_OFFSET  # in-word padding as the model reads it


def _marker_row(char: int, max_chars: int) -> tuple[int, ...]:
    row = [PAD_CHAR] * max_chars
    row[0], row[1], row[2] = BOW_CHAR, char, EOW_CHAR
    return tuple(row)


@lru_cache(maxsize=1 << 14)  # hot tokens; bounded so long jobs keep flat memory
def raw_char_ids(token: str, max_chars: int = MAX_CHARS) -> tuple[int, ...]:
    """Raw (0..260) char ids of one token: ``[BOW, bytes[:max_chars-2], EOW, PAD...]``."""
    if token == BOS_TOKEN:
        return _marker_row(BOS_CHAR, max_chars)
    if token == EOS_TOKEN:
        return _marker_row(EOS_CHAR, max_chars)
    data = token.encode("utf-8", "ignore")[: max_chars - 2]
    row = [PAD_CHAR] * max_chars
    row[0] = BOW_CHAR
    row[1 : 1 + len(data)] = data
    row[1 + len(data)] = EOW_CHAR
    return tuple(row)


def char_ids(token: str, max_chars: int = MAX_CHARS) -> list[int]:
    """Inference (+1) char ids of one token, as bilm-tf's ``Batcher`` and AllenNLP produce them."""
    return [c + INFERENCE_OFFSET for c in raw_char_ids(token, max_chars)]


def tokens_to_char_array(tokens: Sequence[str], max_chars: int = MAX_CHARS, raw: bool = False) -> np.ndarray:
    """(n_tokens, max_chars) int32 ids for a list of tokens; +1 scheme unless ``raw``."""
    out = np.empty((len(tokens), max_chars), dtype=np.int32)
    for i, token in enumerate(tokens):
        out[i] = raw_char_ids(token, max_chars)
    if not raw:
        out += INFERENCE_OFFSET
    return out


def batch_to_ids(sentences: Sequence[Sequence[str]], max_chars: int = MAX_CHARS) -> torch.Tensor:
    """(B, T, max_chars) int64 inference ids **without** sentence boundaries, right-padded with 0-rows.

    Same contract as AllenNLP's ``batch_to_ids``: the biLM adds ``<S>``/``</S>`` itself.
    """
    import torch

    longest = max((len(s) for s in sentences), default=0)
    out = np.zeros((len(sentences), longest, max_chars), dtype=np.int64)
    for b, sentence in enumerate(sentences):
        if sentence:
            out[b, : len(sentence)] = tokens_to_char_array(sentence, max_chars)
    return torch.from_numpy(out)


def model_ids(raw: torch.Tensor) -> torch.Tensor:
    """Raw char ids (training batches, bilm-tf's scheme) ─► the inference ids the model reads."""

    return raw + INFERENCE_OFFSET


def boundary_char_ids(max_chars: int = MAX_CHARS) -> tuple[torch.Tensor, torch.Tensor]:
    """Inference ids of ``<S>`` and ``</S>`` as (max_chars,) int64 tensors."""
    import torch

    bos = torch.tensor(char_ids(BOS_TOKEN, max_chars), dtype=torch.int64)
    eos = torch.tensor(char_ids(EOS_TOKEN, max_chars), dtype=torch.int64)
    return bos, eos


def distinct_rows(char_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(char_ids, dim=0, return_inverse=True)`` for (N, C) char ids (< 512), the same result 2-4x
    faster: seven 9-bit ids packed into each int64 key keep the rows' lexicographic order, and stable sorts from
    the last key to the first sort the rows (``unique`` with ``dim`` compares rows one pair at a time)."""
    import torch

    n, c = char_ids.shape
    if n == 0:
        return char_ids, torch.zeros(0, dtype=torch.long, device=char_ids.device)
    per_key = 7
    packed = torch.nn.functional.pad(char_ids.long(), (0, (-c) % per_key)).view(n, -1, per_key)
    keys = (packed * (512 ** torch.arange(per_key - 1, -1, -1, device=char_ids.device))).sum(-1)  # (N, K)
    order = torch.arange(n, device=char_ids.device)
    for k in range(keys.shape[1] - 1, -1, -1):
        order = order[torch.sort(keys[order, k], stable=True).indices]
    ordered = keys[order]
    first = torch.ones(n, dtype=torch.bool, device=char_ids.device)  # where a new distinct row starts
    first[1:] = (ordered[1:] != ordered[:-1]).any(1)
    inverse = torch.empty(n, dtype=torch.long, device=char_ids.device)
    inverse[order] = first.cumsum(0) - 1
    return char_ids[order[first]], inverse
