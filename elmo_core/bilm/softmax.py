"""The LM softmax: TensorFlow's sampled softmax (log-uniform sampler) for training, the full softmax for evaluation.

bilm-tf trains with ``tf.nn.sampled_softmax_loss`` and its defaults; reproduced here:

* candidates from the log-uniform (Zipfian) distribution over ids 0..V-1, P(k) = log((k+2)/(k+1)) / log(V+1),
  which assumes ids are frequency ranks (our vocab is sorted that way); ``unique=True``: draws are repeated
  until ``num_sampled`` distinct ids are found, and ``num_tries`` counts all draws;
* expected counts ``-expm1(num_tries · log1p(-P(k)))`` for true and sampled ids, whose logs are subtracted
  from the logits ("subtract log Q");
* accidental hits (a sampled id equal to the row's true id) get a logit of -FLOAT_MAX-like value;
* loss = softmax cross-entropy with the true class first, averaged over the rows.
One set of candidates serves the whole batch, as in bilm-tf.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.nn import functional as F

_NEG = -1e30  # stands in for TF's very negative accidental-hit logit without risking inf - inf


class LogUniformSampler:
    """TF's ``log_uniform_candidate_sampler(unique=True)`` over ``n_classes`` ids, with its own RNG state."""

    def __init__(self, n_classes: int, seed: int = 0) -> None:
        self.n_classes = n_classes
        self.log_range = math.log(n_classes + 1)
        self.generator = torch.Generator().manual_seed(seed)

    def probability(self, ids: Tensor) -> Tensor:
        ids = ids.double()
        return (torch.log(ids + 2.0) - torch.log(ids + 1.0)) / self.log_range

    def sample(self, num_sampled: int) -> tuple[Tensor, int]:
        """``num_sampled`` distinct ids (CPU int64) and the number of draws it took."""
        num_sampled = min(num_sampled, self.n_classes)
        found: list[Tensor] = []
        seen = torch.zeros(self.n_classes, dtype=torch.bool)
        count, tries = 0, 0
        while count < num_sampled:
            batch = max(2 * (num_sampled - count), 64)
            u = torch.rand(batch, generator=self.generator, dtype=torch.float64)
            draws = (torch.exp(u * self.log_range).floor().long() - 1).clamp_(0, self.n_classes - 1)
            # first occurrences, in draw order, of ids not seen yet
            new_mask = ~seen[draws]
            draws_new = draws[new_mask]
            unique_ids, first_pos = _first_occurrences(draws_new)
            need = num_sampled - count
            if len(unique_ids) >= need:
                take = unique_ids[:need]
                last_draw_in_new = first_pos[need - 1]
                # number of raw draws up to and including the one that completed the set
                tries += int(torch.nonzero(new_mask)[last_draw_in_new]) + 1
                found.append(take)
                count += need
                break
            found.append(unique_ids)
            seen[unique_ids] = True
            count += len(unique_ids)
            tries += batch
        return torch.cat(found), tries

    def expected_count(self, ids: Tensor, num_tries: int) -> Tensor:
        p = self.probability(ids)
        return (-torch.expm1(num_tries * torch.log1p(-p))).float()

    def state_dict(self) -> dict[str, Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.generator.set_state(state["generator"])


def _first_occurrences(values: Tensor) -> tuple[Tensor, Tensor]:
    """Distinct values in order of first appearance, and the positions of those first appearances."""
    if values.numel() == 0:
        return values, values
    unique, inverse = torch.unique(values, return_inverse=True)
    first = torch.full((len(unique),), values.numel(), dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(values.numel()), reduce="amin")
    order = torch.argsort(first)
    return unique[order], first[order]


def sampled_softmax_loss(
    hidden: Tensor,
    targets: Tensor,
    weight: Tensor,
    bias: Tensor,
    sampled: Tensor,
    num_tries: int,
    sampler: LogUniformSampler,
    sparse: bool = False,
) -> Tensor:
    """Mean sampled-softmax loss of rows ``hidden`` (N, P) with true ids ``targets`` (N,).

    ``sparse`` gathers softmax rows through ``F.embedding(sparse=True)`` so the (V, P) weight gets a sparse
    gradient (bilm-tf's sparse updates; needed for large vocabularies). Under bf16 autocast only the logits
    product runs in bf16; the loss is computed in float32.
    """
    device = hidden.device
    sampled = sampled.to(device)
    true_w = F.embedding(targets, weight, sparse=sparse)  # (N, P)
    samp_w = F.embedding(sampled, weight, sparse=sparse)  # (S, P)
    log_q_true = torch.log(sampler.expected_count(targets.cpu(), num_tries)).to(device)
    log_q_sampled = torch.log(sampler.expected_count(sampled.cpu(), num_tries)).to(device)
    # "subtract log Q" is folded into the biases; the true logits are a row-wise dot product, in float32
    true_logits = (hidden.float() * true_w.float()).sum(-1) + (bias.index_select(0, targets) - log_q_true)
    # accidental hits (a row's true id among the sampled ones), found by binary search: O(N log S), not O(N S)
    ordered, order = torch.sort(sampled)
    at = torch.searchsorted(ordered, targets).clamp_(max=len(ordered) - 1)
    hit_rows = torch.nonzero(ordered[at] == targets).squeeze(1)
    hit_cols = order[at[hit_rows]]
    compute_dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else hidden.dtype
    samp_lse = _SampledLogSumExp.apply(
        hidden, samp_w, bias.index_select(0, sampled) - log_q_sampled, hit_rows, hit_cols, compute_dtype
    )
    # cross-entropy with the true class first: mean(logsumexp([true, sampled]) - true), without concatenating
    log_total = torch.logaddexp(true_logits, samp_lse)
    return (log_total - true_logits).mean()


class _SampledLogSumExp(torch.autograd.Function):
    """Per row, the float32 logsumexp of the logits ``hidden @ samp_w.T + samp_bias`` (accidental hits excluded),
    computed block by block of ``BLOCK_ROWS`` rows, and recomputed the same way for the gradient.

    Why: the whole (N, S) logits (2560 x 8192 per direction and step in bilm-tf's setup) are 84 MB of float32;
    logsumexp and its gradient then make about eight passes over them through memory, which measured more than a
    quarter of a bf16 CPU training step. A block's logits stay in cache; recomputing its product in the backward
    costs less than those passes. The products run in ``compute_dtype`` (bf16 under autocast), the rest in float32.
    A GPU gets one block: its memory is fast, and small blocks would only cost launches and host syncs.
    """

    BLOCK_ROWS = 256

    @staticmethod
    def _blocks(h: Tensor) -> list[tuple[int, int]]:
        size = _SampledLogSumExp.BLOCK_ROWS if h.device.type == "cpu" else max(len(h), 1)
        return [(start, min(start + size, len(h))) for start in range(0, len(h), size)]

    @staticmethod
    def _logits(h: Tensor, w: Tensor, b: Tensor, hit_rows: Tensor, hit_cols: Tensor, start: int, end: int) -> Tensor:
        logits = torch.mm(h[start:end], w.t()).float().add_(b)
        if start > 0 or end < len(h):  # a block of the CPU's: its own hits
            inside = (hit_rows >= start) & (hit_rows < end)
            hit_rows, hit_cols = hit_rows[inside] - start, hit_cols[inside]
        logits.index_put_((hit_rows, hit_cols), torch.tensor(_NEG, dtype=logits.dtype, device=h.device))
        return logits

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: Tensor,
        samp_w: Tensor,
        samp_bias: Tensor,
        hit_rows: Tensor,
        hit_cols: Tensor,
        compute_dtype: torch.dtype,
    ) -> Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            h, w, b = hidden.to(compute_dtype), samp_w.to(compute_dtype), samp_bias.float()
            lse = torch.empty(len(h), dtype=torch.float32, device=h.device)
            for start, end in _SampledLogSumExp._blocks(h):
                lse[start:end] = torch.logsumexp(_SampledLogSumExp._logits(h, w, b, hit_rows, hit_cols, start, end), 1)
        ctx.save_for_backward(h, w, b, hit_rows, hit_cols, lse)
        ctx.dtypes = (hidden.dtype, samp_w.dtype, samp_bias.dtype)
        return lse

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_lse: Tensor) -> tuple:  # type: ignore[override]
        h, w, b, hit_rows, hit_cols, lse = ctx.saved_tensors
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        grad_b = torch.zeros(b.shape, dtype=torch.float32, device=b.device)
        with torch.autocast(h.device.type, enabled=False):
            for start, end in _SampledLogSumExp._blocks(h):
                logits = _SampledLogSumExp._logits(h, w, b, hit_rows, hit_cols, start, end)
                # d lse / d logits = softmax; hits at -1e30 get exactly 0
                grad_logits = logits.sub_(lse[start:end, None]).exp_().mul_(grad_lse[start:end, None].float())
                grad_b += grad_logits.sum(0)
                g = grad_logits.to(h.dtype)
                grad_h[start:end] = torch.mm(g, w)
                grad_w += torch.mm(g.t(), h[start:end]).float()
        hidden_dtype, w_dtype, b_dtype = ctx.dtypes
        return grad_h.to(hidden_dtype), grad_w.to(w_dtype), grad_b.to(b_dtype), None, None, None


def full_softmax_loss(hidden: Tensor, targets: Tensor, weight: Tensor, bias: Tensor, reduction: str = "mean") -> Tensor:
    """Cross-entropy over the whole vocabulary (evaluation)."""
    return F.cross_entropy((hidden @ weight.t() + bias).float(), targets, reduction=reduction)
