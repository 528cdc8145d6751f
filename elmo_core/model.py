"""The ELMo biLM, top to bottom in the order it computes.

    char ids (B, T, C) ─► CharCNN ─► Highway × k ─► projection            = token embedding e (B, T, P)
                      ─► ElmoLstm: L layers × {forward, backward}, each an LSTM with a projection,
                         cell/projection clipping and (layers ≥ 1) a residual    = (B, T, P) per layer/direction
                      ─► activations: [e;e], [fwd_1;bwd_1], …, [fwd_L;bwd_L]     = L+1 tensors (B, T, 2P)
                      ─► ScalarMix (optional)                                    = (B, T, 2P)

Shapes: B batch rows, T time steps, C chars per token, F CNN filters, H LSTM cell, P projection.
The numerics follow bilm-tf exactly (see ``docs/elmo-format.md`` §4 in the shared folder); the conversion
from the TensorFlow weight layout lives in ``weights.py``, not here.

Parameters of each LSTM are held by a ``torch.nn.LSTM(proj_size=P)`` in PyTorch's layout (gates i, f, g, o;
``bias_hh`` holds TensorFlow's constant forget-gate +1 and is frozen). With clipping (every published model)
the recurrence runs in ``_clipped_lstm``: one matmul for the input-to-gates product of all steps, then one
recurrent matmul per step for the whole batch. Without clipping ``nn.LSTM`` itself runs (cuDNN on GPU).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from elmo_core.chars import BOS_TOKEN, EOS_TOKEN, N_CHARS, batch_to_ids, tokens_to_char_array
from elmo_core.config import CharCNNConfig, LstmConfig, ModelConfig

# (h, c) of every layer and direction: h (L, 2, B, P), c (L, 2, B, H); direction 0 forward, 1 backward.
LstmState = tuple[Tensor, Tensor]


# ----- 1. context-independent token encoder ---------------------------------------------------------


class CharCNN(nn.Module):
    """(N, C) char ids ─► (N, F): embed chars, one 1-D conv per width, max over positions, activation."""

    def __init__(self, config: CharCNNConfig) -> None:
        super().__init__()
        dim = config.embedding.dim
        # Row 0 is the padding-token row of the +1 scheme: always zero, never trained.
        self.char_embedding = nn.Embedding(N_CHARS, dim, padding_idx=0)
        self.convs = nn.ModuleList(nn.Conv1d(dim, count, width) for width, count in config.filters)
        self.activation = torch.relu if config.activation == "relu" else torch.tanh

    def forward(self, char_ids: Tensor) -> Tensor:
        x = self.char_embedding(char_ids).transpose(1, 2)  # (N, D_c, C)
        # bias is inside the max; the activation is monotone, so it commutes with the max
        return torch.cat([self.activation(conv(x).amax(dim=-1)) for conv in self.convs], dim=-1)


class Highway(nn.Module):
    """y = t ⊙ relu(W_transform x) + (1 − t) ⊙ x with t = σ(W_carry x): σ(carry) gates the *transform*."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.carry = nn.Linear(width, width)
        self.transform = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        gate = torch.sigmoid(self.carry(x))
        return gate * torch.relu(self.transform(x)) + (1.0 - gate) * x


class TokenEncoder(nn.Module):
    """(N, C) char ids ─► (N, P) token embeddings: char CNN, highway layers, linear projection."""

    def __init__(self, config: CharCNNConfig, projection_dim: int) -> None:
        super().__init__()
        self.char_cnn = CharCNN(config)
        n_filters = config.n_filters
        self.highways = nn.ModuleList(Highway(n_filters) for _ in range(config.n_highway))
        # bilm-tf creates the projection only when F != P
        self.projection = nn.Linear(n_filters, projection_dim) if n_filters != projection_dim else None

    def forward(self, char_ids: Tensor) -> Tensor:
        x = self.char_cnn(char_ids)
        for highway in self.highways:
            x = highway(x)
        return self.projection(x) if self.projection is not None else x


# ----- 2. LSTM with projection and clipping ---------------------------------------------------------


def _clipped_lstm(
    x: Tensor,
    lengths: Tensor,
    n_full: int,
    n_steps: int,
    lstm: nn.LSTM,
    h0: Tensor,
    c0: Tensor,
    cell_clip: float | None,
    proj_clip: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One direction of one layer, TF ``LSTMCell(num_proj, cell_clip, proj_clip)`` semantics.

    x (B, T, in), rows right-padded; step t updates row b only while t < lengths[b], so a row's final state is
    the state after its last real step and rows of length 0 keep (h0, c0). Steps < ``n_full`` are real for
    every row (no masking needed). Returns outputs (B, T, P) (zero at padding), h_n (B, P), c_n (B, H).
    """
    batch, total, _ = x.shape
    hidden = lstm.hidden_size
    w_hh_t = lstm.weight_hh_l0.t()
    w_hr_t = lstm.weight_hr_l0.t() if lstm.proj_size > 0 else None
    bias = lstm.bias_ih_l0 + lstm.bias_hh_l0
    # input-to-gates for every step in one matmul; only h @ W_hh stays inside the loop
    gates_x = torch.addmm(bias, x.reshape(batch * total, -1), lstm.weight_ih_l0.t()).view(batch, total, -1)
    active = (torch.arange(n_steps, device=x.device)[None, :] < lengths[:, None]).unsqueeze(-1)  # (B, T', 1)
    h, c = h0, c0
    outputs = []
    for t in range(n_steps):
        z = torch.addmm(gates_x[:, t], h, w_hh_t)
        sig = torch.sigmoid(z)  # gate blocks i, f, g, o (g gets tanh below)
        c_new = sig[:, hidden : 2 * hidden] * c + sig[:, :hidden] * torch.tanh(z[:, 2 * hidden : 3 * hidden])
        if cell_clip is not None:
            c_new = c_new.clamp(-cell_clip, cell_clip)
        m = sig[:, 3 * hidden :] * torch.tanh(c_new)
        h_new = m @ w_hr_t if w_hr_t is not None else m
        if proj_clip is not None:
            h_new = h_new.clamp(-proj_clip, proj_clip)
        if t < n_full:
            h, c = h_new, c_new
            outputs.append(h_new)
        else:
            keep = active[:, t]
            h, c = torch.where(keep, h_new, h), torch.where(keep, c_new, c)
            outputs.append(h_new * keep)
    out = torch.stack(outputs, dim=1) if outputs else x.new_zeros(batch, 0, h0.shape[-1])
    if n_steps < total:
        out = torch.cat([out, out.new_zeros(batch, total - n_steps, out.shape[-1])], dim=1)
    return out, h, c


def _fused_lstm(x: Tensor, lengths: Tensor, n_full: int, lstm: nn.LSTM, h0: Tensor, c0: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The same computation without clipping, by ``nn.LSTM`` itself (cuDNN on GPU)."""
    batch, total, _ = x.shape
    state = (h0.unsqueeze(0).contiguous(), c0.unsqueeze(0).contiguous())
    if n_full == total:  # every row full (training windows): no packing
        out, (h, c) = lstm(x, state)
        return out, h[0], c[0]
    packed = pack_padded_sequence(x, lengths.clamp(min=1).cpu(), batch_first=True, enforce_sorted=False)
    out, (h, c) = lstm(packed, state)
    out, _ = pad_packed_sequence(out, batch_first=True, total_length=total)
    ran = (lengths > 0)[:, None]
    out = out * (torch.arange(total, device=x.device)[None, :] < lengths[:, None]).unsqueeze(-1)
    return out, torch.where(ran, h[0], h0), torch.where(ran, c[0], c0)


def _forget_gate_one(lstm: nn.LSTM) -> Tensor:
    """TensorFlow's constant +1 on the forget gate, as a bias vector in PyTorch gate order (i, f, g, o)."""
    h = lstm.hidden_size
    one = torch.zeros(4 * h)
    one[h : 2 * h] = 1.0
    return one


class ElmoLstm(nn.Module):
    """L layers of forward and backward LSTMs with projection, clipping and the residual for layers ≥ 1.

    ``forward`` takes the two directions' inputs separately: inference passes the same sentence, the
    backward copy reversed within each row's length; training passes two independent streams.
    """

    def __init__(self, config: LstmConfig, use_fused: bool | None = None) -> None:
        super().__init__()
        self.config = config
        p, h = config.projection_dim, config.dim
        proj = p if p < h else 0

        def layers() -> nn.ModuleList:
            return nn.ModuleList(nn.LSTM(p, h, proj_size=proj, batch_first=True) for _ in range(config.n_layers))

        self.forward_layers = layers()
        self.backward_layers = layers()
        for lstm in self._all_layers():
            lstm.bias_hh_l0.requires_grad_(False)
            with torch.no_grad():
                lstm.bias_hh_l0.copy_(_forget_gate_one(lstm))
        # The fused path cannot clip; it is only allowed (and the default) when both clips are off.
        self.use_fused = (not config.clipped) if use_fused is None else use_fused
        if self.use_fused and config.clipped:
            raise ValueError("the fused nn.LSTM path cannot clip; set cell_clip and proj_clip to null")

    def _all_layers(self) -> list[nn.LSTM]:
        return [*self.forward_layers, *self.backward_layers]

    def zero_state(self, batch: int, device: torch.device, dtype: torch.dtype = torch.float32) -> LstmState:
        cfg = self.config
        return (
            torch.zeros(cfg.n_layers, 2, batch, cfg.projection_dim, device=device, dtype=dtype),
            torch.zeros(cfg.n_layers, 2, batch, cfg.dim, device=device, dtype=dtype),
        )

    def forward(
        self,
        inputs: tuple[Tensor, Tensor],
        lengths: Tensor,
        state: LstmState | None = None,
        dropout: float = 0.0,
    ) -> tuple[list[tuple[Tensor, Tensor]], LstmState]:
        """inputs: (forward (B, T, P), backward (B, T, P) already time-reversed); lengths (B,).

        Returns per layer (forward out, backward out) in the *input* time order of each direction, and the
        new state. ``dropout`` (training) applies to each layer's input; the residual adds the dropped input,
        as TF's ``DropoutWrapper`` inside ``ResidualWrapper`` does.
        """
        batch, total, _ = inputs[0].shape
        if state is None:
            state = self.zero_state(batch, inputs[0].device, inputs[0].dtype)
        h_state, c_state = state
        cfg = self.config
        lengths = lengths.to(inputs[0].device)
        n_steps = int(lengths.max()) if batch else 0
        n_full = int(lengths.min()) if batch else 0
        new_h, new_c, outputs = [], [], []
        xs = list(inputs)
        for layer in range(cfg.n_layers):
            layer_out, layer_h, layer_c = [], [], []
            for direction, lstm in enumerate((self.forward_layers[layer], self.backward_layers[layer])):
                x = xs[direction]
                if dropout > 0.0 and self.training:
                    x = nn.functional.dropout(x, dropout, training=True)
                h0, c0 = h_state[layer, direction], c_state[layer, direction]
                if self.use_fused:
                    out, h, c = _fused_lstm(x, lengths, n_full, lstm, h0, c0)
                else:
                    out, h, c = _clipped_lstm(x, lengths, n_full, n_steps, lstm, h0, c0, cfg.cell_clip, cfg.proj_clip)
                if layer > 0 and cfg.use_skip_connections:
                    out = out + x  # the residual changes the output only, never the recurrent state
                layer_out.append(out)
                layer_h.append(h)
                layer_c.append(c)
            outputs.append((layer_out[0], layer_out[1]))
            new_h.append(torch.stack(layer_h))
            new_c.append(torch.stack(layer_c))
            xs = layer_out
        return outputs, (torch.stack(new_h), torch.stack(new_c))


def reverse_padded(x: Tensor, lengths: Tensor) -> Tensor:
    """Reverse each row of (B, T, ...) within its own length; padding stays at the end. Self-inverse."""
    total = x.shape[1]
    steps = torch.arange(total, device=x.device)[None, :]
    lengths = lengths.to(x.device)[:, None]
    index = torch.where(steps < lengths, lengths - 1 - steps, steps)
    return x.gather(1, index.view(*index.shape, *([1] * (x.dim() - 2))).expand_as(x))


# ----- 3. the biLM ----------------------------------------------------------------------------------


class BiLM(nn.Module):
    """The bidirectional language model of ELMo: token encoder + forward/backward LSTM stacks (+ softmax).

    ``forward`` takes ids **without** sentence boundaries (as ``batch_to_ids`` makes them), adds ``<S>``/``</S>``,
    and returns the L+1 layers with the boundaries removed. It is stateless unless ``stateful=True``, which
    carries each row's final LSTM state into the same row of the next stateful call (bilm-tf / AllenNLP
    semantics: rows beyond the batch keep theirs; ``reset_states()`` clears them).
    """

    def __init__(self, config: ModelConfig, vocab: Sequence[str] | None = None, use_fused: bool | None = None) -> None:
        super().__init__()
        self.config = config
        p = config.lstm.projection_dim
        self.token_encoder = TokenEncoder(config.char_cnn, p)
        self.lstm = ElmoLstm(config.lstm, use_fused=use_fused)
        # bilm-tf's softmax: one (V, P) table and bias shared by both directions
        self.softmax = nn.Linear(p, config.n_tokens_vocab) if config.n_tokens_vocab else None
        self.vocab: list[str] | None = list(vocab) if vocab is not None else None
        max_chars = config.char_cnn.max_characters_per_token
        self.register_buffer("boundary_char_ids", torch.from_numpy(tokens_to_char_array([BOS_TOKEN, EOS_TOKEN], max_chars)).long(), persistent=False)
        self._state: LstmState | None = None
        self._token_table: Tensor | None = None  # token-input mode: (V + 1, P), row 0 = padding

    # --- construction, I/O ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        options_file: str,
        weight_file: str | None = None,
        device: str | torch.device = "cpu",
        vocab_file: str | None = None,
    ) -> "BiLM":
        """Load bilm-tf / AllenNLP ``options.json`` + ``weights.hdf5`` (or a model directory), in eval mode."""
        from elmo_core.weights import load_pretrained

        return load_pretrained(options_file, weight_file, vocab_file).to(device).eval()

    def save_pretrained(self, directory: str) -> None:
        """Write options.json + weights.hdf5 (+ vocab.txt) that bilm-tf and AllenNLP load unchanged."""
        from elmo_core.weights import save_pretrained

        save_pretrained(self, directory)

    @property
    def output_dim(self) -> int:
        return 2 * self.config.lstm.projection_dim

    @property
    def num_layers(self) -> int:
        return self.config.lstm.n_layers + 1

    @property
    def device(self) -> torch.device:
        return self.boundary_char_ids.device

    def reset_states(self) -> None:
        self._state = None

    # --- token embeddings (layer 0) ------------------------------------------------------------------
    def embed_chars(self, char_ids: Tensor) -> Tensor:
        """(..., C) ids ─► (..., P). Each distinct word runs through the char CNN once."""
        flat = char_ids.reshape(-1, char_ids.shape[-1])
        real = (flat > 0).any(-1)
        out = self.token_encoder.char_cnn.char_embedding.weight.new_zeros(flat.shape[0], self.config.lstm.projection_dim)
        if bool(real.any()):
            unique, inverse = torch.unique(flat[real], dim=0, return_inverse=True)
            out = out.index_put((real.nonzero().squeeze(1),), self.token_encoder(unique)[inverse].to(out.dtype))
        return out.view(*char_ids.shape[:-1], -1)

    def token_embeddings(self, tokens: Sequence[str], batch_size: int = 1024) -> Tensor:
        """(V, P) context-independent embeddings of ``tokens`` (bilm-tf ``dump_token_embeddings``)."""
        max_chars = self.config.char_cnn.max_characters_per_token
        chunks = []
        with torch.no_grad():
            for start in range(0, len(tokens), batch_size):
                ids = torch.from_numpy(tokens_to_char_array(tokens[start : start + batch_size], max_chars)).long()
                chunks.append(self.token_encoder(ids.to(self.device)))
        return torch.cat(chunks) if chunks else torch.zeros(0, self.config.lstm.projection_dim, device=self.device)

    def cache_token_embeddings(self, vocab: Sequence[str]) -> None:
        """Token-input mode: precompute layer 0 for ``vocab``; ``forward`` then accepts (B, T) ids = index + 1."""
        self.vocab = list(vocab)
        table = self.token_embeddings(self.vocab)
        self._token_table = torch.cat([table.new_zeros(1, table.shape[1]), table])

    def batch_to_token_ids(self, sentences: Sequence[Sequence[str]]) -> Tensor:
        """(B, T) token-input ids (vocab index + 1, 0 = padding), without boundaries, for cached mode."""
        if self.vocab is None:
            raise ValueError("no vocabulary: call cache_token_embeddings(vocab) first")
        index = {token: i + 1 for i, token in enumerate(self.vocab)}
        longest = max((len(s) for s in sentences), default=0)
        ids = torch.zeros(len(sentences), longest, dtype=torch.long)
        for b, sentence in enumerate(sentences):
            for t, token in enumerate(sentence):
                if token not in index:
                    raise KeyError(f"token {token!r} (sentence {b}, position {t}) is not in the cached vocabulary")
                ids[b, t] = index[token]
        return ids

    # --- forward -------------------------------------------------------------------------------------
    def forward(self, inputs: Tensor, stateful: bool = False, keep_boundaries: bool = False) -> dict[str, list[Tensor] | Tensor]:
        """inputs: char ids (B, T, C) in the +1 scheme, or token ids (B, T) in cached mode; no boundaries.

        Returns ``{"activations": [L+1 × (B, T, 2P)], "mask": (B, T) bool}``; with ``keep_boundaries`` the
        tensors are (B, T+2, 2P) with ``<S>`` at 0 and ``</S>`` at length+1 (AllenNLP's ``_ElmoBiLm`` view).
        """
        if inputs.dim() == 3:
            mask = (inputs > 0).any(-1)
            embedded = self.embed_chars(inputs)
        elif inputs.dim() == 2:
            if self._token_table is None:
                raise ValueError("(B, T) token ids need cache_token_embeddings(vocab) first")
            mask = inputs > 0
            embedded = self._token_table.to(inputs.device)[inputs]
        else:
            raise ValueError(f"expected (B, T, C) char ids or (B, T) token ids, got shape {tuple(inputs.shape)}")
        layers, mask_b = self._contextualize(embedded, mask, stateful)
        if keep_boundaries:
            return {"activations": layers, "mask": mask_b}
        total = inputs.shape[1]
        keep = mask.unsqueeze(-1).to(layers[0].dtype)
        return {"activations": [layer[:, 1 : total + 1] * keep for layer in layers], "mask": mask}

    def _contextualize(self, embedded: Tensor, mask: Tensor, stateful: bool) -> tuple[list[Tensor], Tensor]:
        batch, total, dim = embedded.shape
        lengths = mask.sum(1)
        # add <S> at 0 and </S> at length + 1 of every row (empty sentences included)
        boundary = self.embed_chars(self.boundary_char_ids).to(embedded.dtype)
        x = embedded.new_zeros(batch, total + 2, dim)
        x[:, 1 : total + 1] = embedded * mask.unsqueeze(-1).to(embedded.dtype)
        rows = torch.arange(batch, device=x.device)
        x[:, 0] = boundary[0]
        x[rows, lengths + 1] = boundary[1]
        lengths_b = lengths + 2
        mask_b = torch.arange(total + 2, device=x.device)[None, :] < lengths_b[:, None]

        state = self._take_state(batch, x.device, x.dtype) if stateful else None
        outputs, new_state = self.lstm((x, reverse_padded(x, lengths_b)), lengths_b, state)
        if stateful:
            self._store_state(new_state)

        keep = mask_b.unsqueeze(-1).to(x.dtype)
        layers = [torch.cat([x, x], dim=-1) * keep]
        for fwd, bwd in outputs:
            layers.append(torch.cat([fwd, reverse_padded(bwd, lengths_b)], dim=-1) * keep)
        return layers, mask_b

    def _take_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> LstmState:
        zero = self.lstm.zero_state(batch, device, dtype)
        if self._state is None:
            return zero
        rows = min(batch, self._state[0].shape[2])
        return tuple(torch.cat([s[:, :, :rows].to(device, dtype), z[:, :, rows:]], dim=2) for s, z in zip(self._state, zero))  # type: ignore[return-value]

    def _store_state(self, new_state: LstmState) -> None:
        new_state = tuple(s.detach() for s in new_state)  # type: ignore[assignment]
        batch = new_state[0].shape[2]
        if self._state is None or self._state[0].shape[2] <= batch:
            self._state = new_state
        else:  # rows beyond this batch keep their state
            self._state = tuple(torch.cat([n, s[:, :, batch:]], dim=2) for n, s in zip(new_state, self._state))  # type: ignore[assignment]

    # --- the convenience API -------------------------------------------------------------------------
    @torch.no_grad()
    def embed_sentences(
        self,
        sentences: Sequence[Sequence[str]],
        batch_size: int = 64,
        stateful: bool = False,
        bf16: bool = False,
    ) -> list[np.ndarray]:
        """One float32 array (L+1, n_tokens, 2P) per sentence, boundaries removed.

        Stateless (default): sentences are bucketed by length and each starts from zero state, so its vectors
        do not depend on the rest of the batch. ``stateful=True``: batches of ``batch_size`` in the given order,
        state carried per row like AllenNLP's ``ElmoEmbedder``. ``bf16`` autocasts on CUDA only.
        """
        order = list(range(len(sentences)))
        if not stateful:
            order.sort(key=lambda i: len(sentences[i]))
        results: list[np.ndarray | None] = [None] * len(sentences)
        use_bf16 = bf16 and self.device.type == "cuda"
        max_chars = self.config.char_cnn.max_characters_per_token
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            ids = batch_to_ids([sentences[i] for i in chunk], max_chars).to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_bf16):
                layers = self(ids, stateful=stateful)["activations"]
            stacked = torch.stack(layers, dim=1).float().cpu().numpy()  # (B, L+1, T, 2P)
            for row, i in enumerate(chunk):
                results[i] = np.ascontiguousarray(stacked[row, :, : len(sentences[i])])
        return results  # type: ignore[return-value]


# ----- 4. scalar mix --------------------------------------------------------------------------------


class ScalarMix(nn.Module):
    """ELMo's task mix γ · Σ_j softmax(w)_j · LN?(layer_j), as AllenNLP computes it.

    With ``do_layer_norm`` each layer is normalised by one mean and variance over all unmasked positions and
    features, ε = 1e-13, no affine parameters. Given ``initial_scalar_parameters`` the weights are frozen.
    """

    def __init__(
        self,
        mixture_size: int,
        do_layer_norm: bool = False,
        initial_scalar_parameters: Sequence[float] | None = None,
        trainable: bool = True,
        gamma: float = 1.0,
    ) -> None:
        super().__init__()
        self.mixture_size = mixture_size
        self.do_layer_norm = do_layer_norm
        values = list(initial_scalar_parameters) if initial_scalar_parameters is not None else [0.0] * mixture_size
        if len(values) != mixture_size:
            raise ValueError(f"{len(values)} initial scalar parameters for a mixture of {mixture_size} layers")
        self.scalar_parameters = nn.ParameterList(nn.Parameter(torch.tensor([v]), requires_grad=trainable) for v in values)
        self.gamma = nn.Parameter(torch.tensor([gamma]), requires_grad=trainable)

    def forward(self, tensors: Sequence[Tensor], mask: Tensor | None = None) -> Tensor:
        if len(tensors) != self.mixture_size:
            raise ValueError(f"{len(tensors)} tensors passed to a ScalarMix of size {self.mixture_size}")
        weights = torch.softmax(torch.cat(list(self.scalar_parameters)), dim=0)
        if self.do_layer_norm and mask is None:
            raise ValueError("do_layer_norm needs the mask")
        pieces = []
        for weight, tensor in zip(weights.split(1), tensors):
            if self.do_layer_norm:
                tensor = _masked_layer_norm(tensor, mask)  # type: ignore[arg-type]
            pieces.append(weight * tensor)
        return self.gamma * sum(pieces)


def _masked_layer_norm(tensor: Tensor, mask: Tensor) -> Tensor:
    broadcast_mask = mask.unsqueeze(-1).to(tensor.dtype)
    n = broadcast_mask.sum() * tensor.shape[-1]
    masked = tensor * broadcast_mask
    mean = masked.sum() / n
    variance = (((masked - mean) * broadcast_mask) ** 2).sum() / n
    return (tensor - mean) / torch.sqrt(variance + 1e-13)


# ----- 5. initialisation for training (bilm-tf's recipe, docs §6) ------------------------------------


def init_bilm_tf(model: BiLM) -> None:
    """Initialise a fresh model as bilm-tf does before training."""
    cfg = model.config
    enc = model.token_encoder
    with torch.no_grad():
        nn.init.uniform_(enc.char_cnn.char_embedding.weight, -1.0, 1.0)
        enc.char_cnn.char_embedding.weight[0].zero_()
        for (width, _), conv in zip(cfg.char_cnn.filters, enc.char_cnn.convs):
            if cfg.char_cnn.activation == "relu":
                nn.init.uniform_(conv.weight, -0.05, 0.05)
            else:
                nn.init.normal_(conv.weight, 0.0, math.sqrt(1.0 / (width * cfg.char_cnn.embedding.dim)))
            conv.bias.zero_()
        std = math.sqrt(1.0 / cfg.char_cnn.n_filters)
        for highway in enc.highways:
            nn.init.normal_(highway.carry.weight, 0.0, std)
            nn.init.normal_(highway.transform.weight, 0.0, std)
            highway.carry.bias.fill_(-2.0)
            highway.transform.bias.zero_()
        if enc.projection is not None:
            nn.init.normal_(enc.projection.weight, 0.0, std)
            enc.projection.bias.zero_()
        for lstm in model.lstm._all_layers():
            # TF's default kernel init is Glorot-uniform over the fused [input; recurrent] kernel
            fan_in = lstm.input_size + (lstm.proj_size or lstm.hidden_size)
            bound = math.sqrt(6.0 / (fan_in + 4 * lstm.hidden_size))
            nn.init.uniform_(lstm.weight_ih_l0, -bound, bound)
            nn.init.uniform_(lstm.weight_hh_l0, -bound, bound)
            if lstm.proj_size > 0:
                bound_p = math.sqrt(6.0 / (lstm.hidden_size + lstm.proj_size))
                nn.init.uniform_(lstm.weight_hr_l0, -bound_p, bound_p)
            lstm.bias_ih_l0.zero_()
            lstm.bias_hh_l0.copy_(_forget_gate_one(lstm))
        if model.softmax is not None:
            nn.init.normal_(model.softmax.weight, 0.0, 1.0 / math.sqrt(cfg.lstm.projection_dim))
            model.softmax.bias.zero_()
