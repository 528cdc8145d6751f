"""Where each token of a batch sits when the LSTMs read it packed and time-major, and where each output position
takes its vectors from: the bookkeeping between a (B, T) batch and ``PackedSequence``-style data, kept apart from
the network (``model.py``) so the model reads as layers.

    TokenBatch   each distinct token's embedding once, and which one every (row, step) takes
    Packing      rows sorted longest first; step t holds the first ``batch_sizes[t]`` of them
    Slots        packed outputs ─► a layout: padded (B, W), or the rows of the real tokens
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TokenBatch:
    """A batch as the LSTMs read it: each distinct token's embedding once, and which one every (row, step) takes."""

    table: Tensor  # (U, P)
    forward: Tensor  # (B, W) table rows in reading order
    backward: Tensor | None  # (B, W) the backward LSTM's own stream (training); None: it reads each row reversed
    lengths: Tensor  # (B,) steps of each row, boundaries included
    mask: Tensor  # (B, T) real tokens of the input
    boundaries: bool  # whether <S>/</S> were added around each row


@dataclass
class Packing:
    """Where each (row, step) of a batch sits in packed, time-major data (rows sorted longest first).

    Step t holds the first ``batch_sizes[t]`` sorted rows; ``position(row, t) = offsets[t] + rank[row]``.
    """

    order: Tensor  # (B,) original row of each sorted row
    rank: Tensor  # (B,) sorted position of each original row
    batch_sizes: list[int]
    offsets: Tensor  # (T,) packed index of step t's first row
    lengths: Tensor  # (B,) original order, on the CPU, at least 1
    real_lengths: Tensor  # (B,) the same before the clamp: 0 for a row with nothing to read

    @classmethod
    def of(cls, lengths: Tensor) -> Packing:
        real = lengths.detach().cpu()
        lengths = real.clamp(min=1)  # a 0-length row runs one dummy step (its outputs are dropped)
        order = torch.sort(lengths, descending=True, stable=True).indices
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order))
        total = int(lengths.max()) if len(lengths) else 0
        counts = (lengths[None, :] > torch.arange(total)[:, None]).sum(1)
        offsets = torch.zeros(total, dtype=torch.long)
        if total > 1:
            offsets[1:] = counts.cumsum(0)[:-1]
        return cls(order, rank, counts.tolist(), offsets, lengths, real)

    def position(self, rows: Tensor, steps: Tensor) -> Tensor:
        return self.offsets[steps] + self.rank[rows]

    def read(self, forward: Tensor, backward: Tensor | None) -> Tensor:
        """(2, N): the table row each direction reads at each packed position. The backward LSTM reads its own
        stream, or else each row from its end."""
        sorted_lengths = self.lengths[self.order]
        t, r = torch.nonzero(torch.arange(len(self.offsets))[:, None] < sorted_lengths[None, :], as_tuple=True)
        rows, steps = (x.to(forward.device) for x in (self.order[r], t))
        if backward is not None:
            return torch.stack([forward[rows, steps], backward[rows, steps]])
        reversed_steps = self.lengths.to(forward.device)[rows] - 1 - steps
        return torch.stack([forward[rows, steps], forward[rows, reversed_steps]])

    def slots(self, rows: Tensor, steps: Tensor, aligned: bool, device: torch.device, valid: Tensor | None) -> Slots:
        """The packed positions whose outputs go to output slots (rows, steps) (CPU, steps < each row's length).
        ``aligned``: the backward output of step t comes from the backward LSTM's step length-1-t."""
        forward = self.position(rows, steps)
        backward = self.position(rows, self.lengths[rows] - 1 - steps) if aligned else forward
        mask = valid.reshape(-1, 1).to(device) if valid is not None else None
        return Slots(forward.to(device), backward.to(device), aligned, mask)

    def padded_slots(self, tokens: TokenBatch, keep_boundaries: bool) -> tuple[Slots, tuple[int, int], Tensor]:
        """Slots of the (B, T) (or (B, T+2) with the boundaries kept) layout, and its mask."""
        batch, width = tokens.forward.shape
        shift = 1 if tokens.boundaries and not keep_boundaries else 0  # slot t shows step t + 1: after <S>
        out_width = width - 2 * shift
        rows = torch.arange(batch).repeat_interleave(out_width)
        steps = torch.arange(out_width).repeat(batch) + shift
        valid = steps < tokens.lengths.cpu()[rows] - shift
        slots = self.slots(rows, torch.where(valid, steps, 0), tokens.backward is None, tokens.table.device, valid)
        if tokens.boundaries and keep_boundaries:
            mask = torch.arange(width, device=tokens.lengths.device)[None, :] < tokens.lengths[:, None]
        else:
            mask = tokens.mask
        return slots, (batch, out_width), mask

    def token_slots(self, tokens: TokenBatch) -> tuple[Slots, Tensor]:
        """Slots of the real tokens, row after row (boundaries left out), and each row's count."""
        counts = tokens.lengths.cpu() - (2 if tokens.boundaries else 0)
        rows = torch.repeat_interleave(torch.arange(len(counts)), counts)
        starts = torch.cumsum(counts, 0) - counts
        steps = torch.arange(len(rows)) - starts[rows] + (1 if tokens.boundaries else 0)
        return self.slots(rows, steps, tokens.backward is None, tokens.table.device, None), counts


@dataclass
class Slots:
    """Where each output position takes its vectors from: indices into the packed forward and backward outputs.
    The one place packed outputs become a layout (padded (B, W) or the rows of the real tokens)."""

    forward: Tensor  # (M,)
    backward: Tensor  # (M,)
    aligned: bool
    valid: Tensor | None  # (M, 1) bool: False at padding (zeroed); None where every slot is a real step

    def unpack(self, out: Tensor) -> Tensor:
        """Packed outputs (2, N, P) of one layer ─► (M, 2P): [forward; backward] per slot."""
        x = torch.cat([out[0].index_select(0, self.forward), out[1].index_select(0, self.backward)], dim=-1)
        return x * self.valid.to(x.dtype) if self.valid is not None else x

    def embeddings(self, table: Tensor, ids: Tensor) -> Tensor:
        """Layer 0, [e; e] per slot: the token embeddings each direction read there (the same token where aligned)."""
        e_f = table.index_select(0, ids[0].index_select(0, self.forward))
        e_b = e_f if self.aligned else table.index_select(0, ids[1].index_select(0, self.backward))
        x = torch.cat([e_f, e_b], dim=-1)
        return x * self.valid.to(x.dtype) if self.valid is not None else x


def with_boundaries(inputs: Tensor, bos: Tensor, eos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Every row of ids (B, T[, C]) (0 = padding) becomes ``<S> tokens </S>``, empty rows too, as AllenNLP's
    ``add_sentence_boundary_token_ids``: (ids (B, T+2[, C]), lengths with the boundaries (B,), mask (B, T))."""
    mask = (inputs > 0).any(-1) if inputs.dim() == 3 else inputs > 0
    batch, total = inputs.shape[:2]
    lengths = mask.sum(1)
    rows = torch.arange(batch, device=inputs.device)
    ids = inputs.new_zeros(batch, total + 2, *inputs.shape[2:])
    ids[:, 1 : total + 1] = inputs * (mask.unsqueeze(-1) if inputs.dim() == 3 else mask)
    ids[:, 0] = bos
    ids[rows, lengths + 1] = eos
    return ids, lengths + 2, mask
