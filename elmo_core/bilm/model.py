"""The ELMo biLM, top to bottom in the order it computes.

    char ids (B, T, C) ─► CharCNN ─► Highway × k ─► projection            = token embedding e (B, T, P)
                      ─► ElmoLstm: L layers × {forward, backward}, each an LSTM with a projection,
                         cell/projection clipping and (layers ≥ 1) a residual    = (B, T, P) per layer/direction
                      ─► activations: [e;e], [fwd_1;bwd_1], …, [fwd_L;bwd_L]     = L+1 tensors (B, T, 2P)
                      ─► ScalarMix (optional, ``scalar_mix.py``)                 = (B, T, 2P)

Shapes: B batch rows, T time steps, C chars per token, F CNN filters, H LSTM cell, P projection, N real steps
(packed), U distinct tokens of a batch. The numerics follow bilm-tf exactly (``docs/elmo-format.md`` §4); the
TensorFlow weight layout is converted in ``weights.py``, never here.

One forward path: ``BiLM.forward`` serves inference (it adds ``<S>``/``</S>``; the backward LSTM reads each row
reversed) and training (two independent streams of windows, ``backward_inputs``, as bilm-tf trains). Either way
each distinct token runs through the char CNN once, the LSTMs run on packed rows (no work on padding), and one
gather (``Packing.unpack``) lays the outputs out, padded (B, T, 2P) or as the rows of the real tokens.

State is explicit: ``forward`` takes an optional LSTM state and returns the new one (``inference.StateCarry``
carries it for bilm-tf's stateful protocol). The LSTMs (step 2) are ``lstm.py``'s ``ElmoLstm``: with clips (every
published model) ``LstmCell`` stepped by ``_recurrence``, else ``nn.LSTM`` itself (cuDNN on GPU). What runs is chosen
once (``KernelChoice``): ``BiLM.prepare(precision)`` picks the inference kernels of ``bilm/kernels/`` (prepared
weights, oneDNN packing, C gates, a layer's steps in one C loop), ``prepare_training()`` the training ones.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from elmo_core.bilm import inference
from elmo_core.bilm.inference import LstmState, SharedRows
from elmo_core.bilm.kernels import Kernels, TrainingKernels, choose, choose_training
from elmo_core.bilm.kernels.char_cnn import conv_max
from elmo_core.bilm.lstm import Cell, Clips, ElmoLstm, LstmCell
from elmo_core.bilm.manylangs import Dictionaries, read_model, spelling, write_model
from elmo_core.bilm.packing import Packing, TokenBatch, with_boundaries
from elmo_core.config import CharCNNConfig, LstmConfig, ManyLangsConfig, ModelConfig
from elmo_core.defaults import DEFAULT_INFERENCE_PRECISION
from elmo_core.errors import WeightFileError
from elmo_core.precision import resolve_precision
from elmo_core.text.chars import N_CHARS, PAD_ID

# ----- 1. context-independent token encoder ---------------------------------------------------------


# (embedded chars (N, D, 1, C) without gradients, ids (N, C), table, weight, bias) ─► (N, F): kernels.char_cnn.conv_max
ConvMax = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


class CharCNN(nn.Module):
    """(N, C) char ids ─► (N, F): embed chars, one 1-D conv per width, max over positions, activation."""

    def __init__(self, config: CharCNNConfig, n_chars: int = N_CHARS, pad_id: int = PAD_ID) -> None:
        super().__init__()
        dim = config.embedding.dim
        # Row 0 is the padding-token row of the +1 scheme: always zero, never trained.
        self.char_embedding, self.pad_id = nn.Embedding(n_chars, dim, padding_idx=0), pad_id
        self.convs = nn.ModuleList(nn.Conv1d(dim, count, width) for width, count in config.filters)
        self.max_width = max(width for width, _ in config.filters)
        self.activation = torch.relu if config.activation == "relu" else torch.tanh

    def forward(self, char_ids: Tensor, conv_max: ConvMax | None = None) -> Tensor:
        """``conv_max``: what runs each width's convolution and max in a call with gradients (the training
        kernels' ``kernels.char_cnn.conv_max``: the same values, the backward at the max's position only)."""
        # Positions after a word's end-of-word marker hold the in-word padding id, and every window lying
        # wholly in that padding gives the same value. Convolving up to the longest word plus the widest
        # filter keeps at least one such window, so the max over positions is unchanged and the work halves.
        content = (char_ids != self.pad_id) * torch.arange(1, char_ids.shape[-1] + 1, device=char_ids.device)
        keep = int(content.amax()) + self.max_width if char_ids.numel() else char_ids.shape[-1]
        if keep < char_ids.shape[-1]:
            char_ids = char_ids[..., :keep]
        # (N, D_c, 1, C) as a view of the (N, C, D_c) embeddings: channels-last, the layout oneDNN's convolution
        # wants, and the max over positions then runs across whole filter vectors. Measured against Conv1d on the
        # (N, D_c, C) transpose: faster with and without gradients, in fp32 and bf16, the same values.
        if conv_max is not None and torch.is_grad_enabled():
            table = self.char_embedding.weight
            x = nn.functional.embedding(char_ids, table.detach()).transpose(1, 2).unsqueeze(2)  # conv_max's gradient
            pooled = [conv_max(x, char_ids, table, conv.weight, conv.bias) for conv in self.convs]
        else:
            x = self.char_embedding(char_ids).transpose(1, 2).unsqueeze(2)
            convolved = (nn.functional.conv2d(x, conv.weight.unsqueeze(2), conv.bias) for conv in self.convs)
            # bias is inside the max; the activation is monotone, so it commutes with the max. Same values either
            # way: with gradients max pooling (its backward scatters to the argmax) is faster than amax (an equality
            # mask over every position); without, amax is.
            if torch.is_grad_enabled():
                pooled = [nn.functional.max_pool2d(y, (1, y.shape[-1])).flatten(1) for y in convolved]
            else:
                pooled = [y.amax(dim=(-2, -1)) for y in convolved]
        return torch.cat([self.activation(p) for p in pooled], dim=-1)


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
    """(N, C) char ids ─► (N, P): char CNN, highway layers, linear projection (ManyLangs: of [word; highway(cnn)])."""

    def __init__(self, config: CharCNNConfig, projection_dim: int, ml: ManyLangsConfig | None, pad_id: int) -> None:
        super().__init__()
        self.char_cnn = CharCNN(config, ml.n_characters + 1 if ml else N_CHARS, pad_id)
        n_filters, word_dim = config.n_filters, ml.word_dim if ml else 0
        self.highways = nn.ModuleList(Highway(n_filters) for _ in range(config.n_highway))
        self.word_embedding = nn.Embedding(max(ml.n_words, 1), word_dim) if ml else None  # ManyLangs: width 0 or more
        # bilm-tf creates the projection only when F != P; ELMoForManyLangs always has one
        self.projection = nn.Linear(n_filters + word_dim, projection_dim) if ml or n_filters != projection_dim else None

    def forward(self, char_ids: Tensor, conv_max: ConvMax | None = None) -> Tensor:
        x = self.char_cnn(char_ids[..., :-1] if self.word_embedding is not None else char_ids, conv_max)
        for highway in self.highways:
            x = highway(x)
        if self.word_embedding is not None:  # the row's last id is the word's + 1
            x = torch.cat([self.word_embedding((char_ids[..., -1] - 1).clamp(min=0)), x], dim=-1)
        return x if self.projection is None else self.projection(x)


# ----- 3. the biLM (2., the LSTMs, is lstm.py) ----------------------------------------------------


def _precision_of(kernels: Kernels | None) -> contextlib.AbstractContextManager:
    """The autocast a call runs under: its kernels' (bf16 where chosen), else the caller's own."""
    return kernels.autocast() if kernels is not None else contextlib.nullcontext()


class KernelChoice:
    """What runs a biLM's calls, chosen once and looked up per call; a ``BiLM`` holds one (``bilm.runs``).

    ``kernels``: what runs inference, once ``prepare`` chose it (None: the reference); each choice made keeps its
    prepared weights, so switching precisions back and forth rebuilds nothing. ``training``: what runs calls with
    gradients, once ``prepare_training`` chose it."""

    def __init__(self, lstm: LstmConfig) -> None:
        self.lstm = lstm
        self._kernels: Kernels | None = None
        self.training: TrainingKernels | None = None
        self.wanted: str | None = None  # loaded for this precision: prepared on its first call without gradients
        self._made: dict[Kernels, Kernels] = {}

    @property
    def kernels(self) -> Kernels | None:
        return self._kernels

    @kernels.setter
    def kernels(self, kernels: Kernels | None) -> None:
        self._kernels, self.wanted = kernels, None  # what is set, None included, is what runs from now on

    def prepare(self, device: torch.device, precision: str, **choices: Any) -> Kernels:
        """The model's own API takes a precision's name: resolved here for ``device`` (a runtime passes one it
        resolved, unchanged) and handed to the chooser, which never resolves."""
        chosen = choose(device, resolve_precision(precision, device), self.lstm, **choices)
        self.kernels = self._made.setdefault(chosen, chosen)
        return self.kernels

    def prepare_training(self, device: torch.device, **choices: Any) -> TrainingKernels:
        self.training = choose_training(device, self.lstm, **choices)
        return self.training

    @contextlib.contextmanager
    def prepared(self, device: torch.device, precision: str) -> Iterator[Kernels]:
        previous = self.kernels
        try:  # a name compares equal to its resolved ``Precision``; ``choose`` resolves it where it is new
            if previous is not None and previous.precision == precision and previous.runs_on(device):
                yield previous
            else:
                yield self.prepare(device, precision)
        finally:
            self.kernels = previous

    def for_call(self, device: torch.device) -> Kernels | None:
        """The prepared kernels where they apply to this call: this device, no gradients, and no autocast of the
        caller's that they were not chosen for. Otherwise the reference runs, under whatever autocast is on."""
        if self._kernels is None and self.wanted is not None and not torch.is_grad_enabled():
            self.prepare(device, self.wanted)  # a loaded model's first inference call: its kernels, chosen once
        kernels = self.kernels
        if kernels is None or torch.is_grad_enabled() or not kernels.runs_on(device):
            return None
        if kernels.precision != "bf16" and torch.is_autocast_enabled(kernels.device):
            return None
        return kernels

    def training_for_call(self, device: torch.device) -> TrainingKernels | None:
        """The training kernels where they apply to this call: chosen, on this device, and with gradients."""
        chosen = self.training
        if chosen is None or not torch.is_grad_enabled() or not chosen.runs_on(device):
            return None
        return chosen

    def cell_of_call(
        self, kernels: Kernels | None, device: torch.device
    ) -> Callable[[Sequence[nn.LSTM], Clips], Cell] | None:
        """What runs this call's LSTM layers, as chosen: the inference kernels' cell, the training kernels' (a call
        with gradients), None for PyTorch's ``nn.LSTM`` where either chose it; nothing chosen: the reference."""
        if kernels is not None:
            return None if kernels.nn_lstm else kernels.cell if kernels.cpu_cells else LstmCell
        chosen = self.training_for_call(device)
        if chosen is not None and chosen.nn_lstm:
            return None
        if chosen is not None and chosen.one_node:
            return functools.partial(LstmCell, one_node=True)
        return LstmCell


class BoundaryRows:
    """(2, P) layer 0 of ``<S>`` and ``</S>``, for passes given a token table, kept while the token encoder's weights
    and the kernels stay the same (an optimizer step or a load changes a weight's version). Why: each pass of a
    server's batch ran the char CNN's dozens of small operations for these two rows alone, 1.5 ms a pass on a
    2-vCPU Xeon, and far more while the HTTP process held one of the cores."""

    def __init__(self) -> None:
        self._kept: tuple[tuple, Tensor] | None = None  # (what computed them, the rows)

    def of(self, bilm: BiLM, kernels: Kernels | None) -> Tensor:
        if torch.is_grad_enabled():  # a pass that trains the token encoder needs the rows in its graph
            return bilm._encode(bilm.boundary_char_ids, kernels)
        kind = bilm.device.type
        weights = tuple((w.data_ptr(), w._version) for w in bilm.token_encoder.parameters())
        key = (id(kernels), torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind), weights)
        if self._kept is None or self._kept[0] != key:
            self._kept = (key, bilm._encode(bilm.boundary_char_ids, kernels))
        return self._kept[1]


class BiLM(nn.Module):
    """The bidirectional language model of ELMo: token encoder + forward/backward LSTM stacks (+ softmax).

    ``forward`` takes ids **without** sentence boundaries (as ``batch_to_ids`` makes them), adds ``<S>``/``</S>``,
    and returns the L+1 layers with the boundaries removed, the mask, and the LSTM state after each row's last
    token. Each row starts from ``state`` (zeros when None): pass a call's returned state into the next call
    for bilm-tf's stateful protocol (``inference.StateCarry`` does so across batches of changing size).
    """

    def __init__(self, config: ModelConfig, vocab: Sequence[str] | None = None, dics: Dictionaries | None = None):
        super().__init__()
        self.config, self.dictionaries, p = config, dics, config.lstm.projection_dim  # dics: a ManyLangs model's
        self.spelling = spelling(config.char_cnn.max_characters_per_token, config.manylangs is not None, dics)
        self.token_encoder = TokenEncoder(config.char_cnn, p, config.manylangs, self.spelling.pad_id)
        self.lstm = ElmoLstm(config.lstm)
        # bilm-tf's softmax: one (V, P) table and bias shared by both directions
        self.softmax = nn.Linear(p, config.n_tokens_vocab) if config.n_tokens_vocab else None
        self.vocab: list[str] | None = list(vocab) if vocab is not None else None  # the softmax's words
        self.boundaries = BoundaryRows()  # layer 0 of <S> and </S>, kept between passes given a token table
        self.runs = KernelChoice(config.lstm)  # what runs each call, chosen once (``prepare``, ``prepare_training``)
        self.register_buffer("boundary_char_ids", torch.from_numpy(self.spelling.boundary_rows()), persistent=False)

    # --- weight files ----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        options_file: str,
        weight_file: str | None = None,
        device: str | torch.device = "cpu",  # a module's weights start on the CPU, as every torch module's
        vocab_file: str | None = None,
        precision: str = DEFAULT_INFERENCE_PRECISION,
    ) -> BiLM:
        """Load bilm-tf / AllenNLP ``options.json`` + ``weights.hdf5`` (a model directory, a released ManyLangs
        folder), in eval mode, for ``precision``: kernels chosen on its first call without gradients, not here."""
        config, state_dict, vocab, dictionaries = read_model(options_file, weight_file, vocab_file)
        model = cls(config, vocab=vocab, dics=dictionaries)
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        if missing or unexpected:
            raise WeightFileError(
                f"{options_file}: weights do not fit the model: missing {missing}, unexpected {unexpected}"
            )
        model = model.to(device).eval()
        model.runs.wanted = precision  # its kernels are chosen where it first runs (a runtime chooses them itself)
        return model

    def save_pretrained(self, directory: str) -> None:
        """Write options.json + weights.hdf5 (+ vocab.txt; a ManyLangs model's dictionaries) as bilm-tf writes them."""
        write_model(directory, self.config, self.state_dict(), self.vocab, self.dictionaries)

    @property
    def output_dim(self) -> int:
        return 2 * self.config.lstm.projection_dim

    @property
    def num_layers(self) -> int:
        return self.config.lstm.n_layers + 1

    @property
    def device(self) -> torch.device:
        return self.boundary_char_ids.device

    # --- what runs each call (``KernelChoice``) -------------------------------------------------------
    @property
    def kernels(self) -> Kernels | None:
        """What runs inference, once ``prepare`` chose it; None (or set to None): the reference."""
        return self.runs.kernels

    @kernels.setter
    def kernels(self, kernels: Kernels | None) -> None:
        self.runs.kernels = kernels

    def prepare(self, precision: str = DEFAULT_INFERENCE_PRECISION, **choices: Any) -> Kernels:
        """Choose, once, what runs this model's inference on its device in ``precision`` (``kernels.choose``;
        ``choices`` force one kernel or another). Calls without gradients then run it; returns the choice."""
        return self.runs.prepare(self.device, precision, **choices)

    def prepare_training(self, **choices: Any) -> TrainingKernels:
        """Choose, once, what runs this model's calls with gradients on its device (``kernels.choose_training``;
        ``choices`` force it): the reference cell, its gates in C on a CPU. Returns the choice, for the log."""
        return self.runs.prepare_training(self.device, **choices)

    def prepared(self, precision: str) -> contextlib.AbstractContextManager[Kernels]:
        """The block runs the kernels of ``precision`` (the model's own where prepared so), then the model's again."""
        return self.runs.prepared(self.device, precision)

    # --- token embeddings (layer 0) ------------------------------------------------------------------
    def _encode(self, char_ids: Tensor, kernels: Kernels | None) -> Tensor:
        if kernels is not None:
            return kernels.token_encoder(self.token_encoder)(char_ids)
        chosen = self.runs.training_for_call(self.device)
        return self.token_encoder(char_ids, conv_max if chosen is not None and chosen.sparse_char_cnn else None)

    def _distinct_chars(self, flat: Tensor, kernels: Kernels | None) -> tuple[Tensor, Tensor]:
        """(N, C) char ids ─► table (U + 1, P) of the distinct words' embeddings (last row zero) and index (N,)."""
        real = (flat > 0).any(-1)
        unique, inverse = self.spelling.distinct(self.spelling.own(flat)[real])  # a ManyLangs model's own rows
        if unique.shape[0]:
            encoded = self._encode(unique, kernels)
        else:
            encoded = self.token_encoder.char_cnn.char_embedding.weight.new_zeros(0, self.config.lstm.projection_dim)
        table = torch.cat([encoded, encoded.new_zeros(1, encoded.shape[1])])
        index = torch.full((flat.shape[0],), unique.shape[0], dtype=torch.long, device=flat.device)
        index[real] = inverse
        return table, index

    def token_embeddings(self, tokens: Sequence[str], batch_size: int = 1024) -> Tensor:
        """(V, P) context-independent embeddings of ``tokens`` (bilm-tf ``dump_token_embeddings``), in the
        prepared precision."""
        chunks = []
        with torch.no_grad():
            kernels = self.runs.for_call(self.device)
            with _precision_of(kernels):
                for start in range(0, len(tokens), batch_size):
                    ids = torch.from_numpy(self.spelling.rows(tokens[start : start + batch_size])).long()
                    chunks.append(self._encode(ids.to(self.device), kernels))
        return torch.cat(chunks) if chunks else torch.zeros(0, self.config.lstm.projection_dim, device=self.device)

    def _tokens(
        self, inputs: Tensor, token_table: Tensor | None, backward_inputs: Tensor | None, kernels: Kernels | None
    ) -> TokenBatch:
        """The batch's token table and reading order; <S>/</S> added around every row unless two streams are given."""
        if backward_inputs is not None:  # training's two streams of windows: boundaries are already in them
            batch, total, chars = inputs.shape
            table, index = self._distinct_chars(torch.cat([inputs, backward_inputs]).view(-1, chars), kernels)
            index, mask = index.view(2 * batch, total), (inputs > 0).any(-1)
            return TokenBatch(table, index[:batch], index[batch:], mask.sum(1), mask, boundaries=False)
        if inputs.dim() == 2 and token_table is None:
            raise ValueError("(B, T) token ids need their token_table (see inference.TokenCache)")
        if inputs.dim() not in (2, 3):
            raise ValueError(f"expected (B, T, C) char ids or (B, T) token ids, got shape {tuple(inputs.shape)}")
        if inputs.dim() == 3:
            ids, lengths, mask = with_boundaries(self.spelling.own(inputs), *self.boundary_char_ids)
            table, index = self._distinct_chars(ids.view(-1, ids.shape[-1]), kernels)
            return TokenBatch(table, index.view(ids.shape[:2]), None, lengths, mask, boundaries=True)
        table = torch.cat([token_table.to(boundary := self.boundaries.of(self, kernels)), boundary])  # type: ignore
        vocab_rows = token_table.shape[0]  # type: ignore[union-attr]
        index, lengths, mask = with_boundaries(inputs, inputs.new_tensor(vocab_rows), inputs.new_tensor(vocab_rows + 1))
        return TokenBatch(table, index, None, lengths, mask, boundaries=True)

    # --- forward -------------------------------------------------------------------------------------
    def forward(
        self,
        inputs: Tensor,
        state: LstmState | None = None,
        token_table: Tensor | None = None,
        keep_boundaries: bool = False,
        *,
        backward_inputs: Tensor | None = None,
        dropout: float = 0.0,
        layout: str = "padded",
        shared: SharedRows | None = None,
    ) -> dict:
        """inputs: char ids (B, T, C) in the +1 scheme, or token ids (B, T) into ``token_table``; no boundaries.

        Returns ``{"activations": [L+1 × (B, T, 2P)], "mask": (B, T) bool, "state": (h, c)}``, zero at padding;
        with ``keep_boundaries`` the layers are (B, T+2, 2P) with ``<S>`` at 0 and ``</S>`` at length+1
        (AllenNLP's ``_ElmoBiLm`` view) and the mask covers them. ``layout="tokens"``: each layer as (N, 2P) rows,
        the tokens of row 0, then row 1, …, and ``"counts"`` (B,) instead of the mask: what embedding jobs write,
        with no padded tensor built, so the cost per token does not depend on the length spread.

        Training passes ``backward_inputs``, the backward LSTM's own stream (B, T, C) beside the forward one
        (bilm-tf's windows, boundaries already in both): nothing is added, the backward half of each layer is in
        that stream's order, and ``dropout`` applies to each LSTM layer's input. ``shared``: ``inference.SharedRows``.
        """
        kernels = self.runs.for_call(self.device)
        with _precision_of(kernels):
            tokens = self._tokens(inputs, token_table, backward_inputs, kernels)
            packing = Packing.of(tokens.lengths)
            ids = packing.read(tokens.forward, tokens.backward)
            if state is None:
                state = self.lstm.zero_state(len(tokens.lengths), tokens.table.device, tokens.table.dtype)
            cell, lstm = self.runs.cell_of_call(kernels, self.device), self.lstm
            outputs, new_state = lstm(tokens.table, ids, packing, state, make_cell=cell, dropout=dropout, shared=shared)
        if layout == "tokens":
            slots, counts = packing.token_slots(tokens)
        elif layout == "padded":
            slots, shape, mask = packing.padded_slots(tokens, keep_boundaries)
        else:
            raise ValueError(f"layout must be 'padded' or 'tokens', got {layout!r}")
        layers = [slots.embeddings(tokens.table, ids), *(slots.unpack(out) for out in outputs)]
        if layout == "tokens":
            return {"activations": layers, "counts": counts, "state": new_state}
        return {"activations": [layer.view(*shape, -1) for layer in layers], "mask": mask, "state": new_state}

    def token_rows(
        self,
        inputs: Tensor,
        state: LstmState | None = None,
        token_table: Tensor | None = None,
        shared: SharedRows | None = None,
    ) -> tuple[list[Tensor], Tensor, LstmState]:
        """``forward`` with ``layout="tokens"``: (L+1 × (N, 2P) rows, each row's token count (B,), the new state)."""
        out = self(inputs, state=state, token_table=token_table, layout="tokens", shared=shared)
        return out["activations"], out["counts"], out["state"]

    # --- the convenience API -------------------------------------------------------------------------
    def embed_sentences(self, sentences: Sequence[Sequence[str]], **options: Any) -> list[np.ndarray]:
        """One float32 array (L+1, n_tokens, 2P) per sentence, boundaries removed; ``options`` as
        ``inference.embed_sentences`` takes them (batch_size, stateful, carry, precision, max_batch_tokens)."""
        return inference.embed_sentences(self, sentences, **options)
