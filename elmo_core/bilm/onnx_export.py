"""The biLM as one ONNX graph (``elmo onnx``): what ONNX Runtime, Triton or another language's runtime loads.

    char_ids (B, T, 50) int64, AllenNLP's ``batch_to_ids`` (0 = padding)
      ─► <S>/</S> added around each sentence, in the graph (AllenNLP's ``_ElmoBiLm`` does the same)
      ─► token encoder: char embedding, one Conv per filter width, max over positions, activation, highways,
         projection                                                                   = e (B, T+2, P)
         or, where the caller passes ``token_embeddings`` (B, T, P), those with the boundaries' rows around them
      ─► per layer and direction a Scan over time of TensorFlow's LSTMCell with projection and clips; the backward
         direction reads each sentence reversed within its own length (ReverseSequence); the residual for layers ≥ 1
      ─► layers (L+1, B, T, 2P) float32: [e; e], [fwd_1; bwd_1], … with the boundaries removed, zero at padding;
         mask (B, T) int64

Why a graph written node by node and not a trace: ONNX's ``LSTM`` operator has a cell clip but neither a
projection nor its clip, so ELMo's LSTMP needs a loop of its own, and a trace would unroll the time steps for one
length with the weights copied per step. Here each weight is one initializer that the loop's body reads from the
outer graph: the file is the size of the biLM's float32 parameters (the softmax is left out), and batch and length
are dynamic. The arithmetic is ``lstm_math.reference_gates`` and ``model.CharCNN``'s, in float32; the input
products of a layer run once for all steps before the loop, as the runtime's ``LstmCell.steps`` does.

``token_embeddings`` is optional (an input with an empty default, left out of ``InferenceSession.get_inputs``):
the first P columns of layer 0 that an earlier run gave these tokens. A word's layer 0 depends on the word alone,
and the token encoder is about half of a run of short sentences (the small shape, groups of 6 sentences on a 2-vCPU
Xeon: 1.40 s of 3.04 s), so a caller that keeps it per word (``elmo serve FILE.onnx`` does, as the runtime's
``WordCache``) pays it once per word instead of once per run. Given, the char ids only mark where the sentences end.

Opset 17 (ONNX Runtime 1.13 and later, Triton's onnxruntime backend since 22.11); the file's metadata names the
exporter, the opset and the model's exact identity (``runtime.reference.ModelRef.identity``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from elmo_core.bilm.model import BiLM
from elmo_core.text.manylangs_chars import ONNX_METADATA_KEY

OPSET = 17
IR_VERSION = 8  # the IR of opset 17: files that older runtimes still open
INPUT, LAYERS, MASK = "char_ids", "layers", "mask"
TOKEN_EMBEDDINGS = "token_embeddings"  # optional: layer 0 as an earlier run gave it (module docstring)
DICTIONARIES = ONNX_METADATA_KEY  # an ELMoForManyLangs model's char.dic and word.dic (``Dictionaries.state``)


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(torch.float32).cpu().numpy()


class _Graph:
    """Nodes and initializers being added, with fresh names (``onnx.helper`` builds the protobufs)."""

    def __init__(self) -> None:
        import onnx

        self.helper, self.numpy_helper = onnx.helper, onnx.numpy_helper
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self.count = 0

    def name(self, hint: str) -> str:
        self.count += 1
        return f"{hint}_{self.count}"

    def weight(self, hint: str, value: np.ndarray) -> str:
        name = self.name(hint)
        value = np.ascontiguousarray(value) if value.ndim else value  # (ascontiguousarray makes a scalar 1-D)
        self.initializers.append(self.numpy_helper.from_array(value, name))
        return name

    def const(self, value: Any, dtype: Any = np.int64) -> str:
        return self.weight("const", np.asarray(value, dtype=dtype))

    def op(self, kind: str, inputs: list[str], hint: str | None = None, outputs: int = 1, **attrs: Any) -> Any:
        names = [self.name(hint or kind.lower()) for _ in range(outputs)]
        self.nodes.append(self.helper.make_node(kind, inputs, names, **attrs))
        return names[0] if outputs == 1 else names


@dataclass(frozen=True)
class _Boundaries:
    ids: str  # (B, T+2, C): <S> at 0 and </S> after each sentence's last token
    lengths: str  # (B,), the boundaries counted
    mask: str  # (B, T) int64
    at_bos: str  # (1, T+2, 1) bool
    at_eos: str  # (B, T+2, 1) bool


def _boundaries(g: _Graph, char_ids: str, bos: np.ndarray, eos: np.ndarray) -> _Boundaries:
    present = g.op("Greater", [char_ids, g.const(0)])
    mask = g.op("ReduceMax", [g.op("Cast", [present], to=7)], axes=[2], keepdims=0, hint="mask")  # (B, T) int64
    lengths = g.op("ReduceSum", [mask, g.const([1])], keepdims=0, hint="lengths")
    padded = g.op("Pad", [char_ids, g.const([0, 1, 0, 0, 1, 0])])  # (B, T+2, C), zeros at both ends of time
    steps = g.op("Gather", [g.op("Shape", [padded]), g.const(1)])
    position = g.op("Reshape", [g.op("Range", [g.const(0), steps, g.const(1)]), g.const([1, -1, 1])])
    at_bos = g.op("Equal", [position, g.const(0)])
    end = g.op("Reshape", [g.op("Add", [lengths, g.const(1)]), g.const([-1, 1, 1])])
    at_eos = g.op("Equal", [position, end])
    ids = g.op("Where", [at_eos, g.const(eos.reshape(1, 1, -1)), padded])
    ids = g.op("Where", [at_bos, g.const(bos.reshape(1, 1, -1)), ids], hint="ids")
    return _Boundaries(ids, g.op("Add", [lengths, g.const(2)], hint="lengths_with_boundaries"), mask, at_bos, at_eos)


def _branch(g: _Graph, hint: str, make: Any) -> Any:
    """``make(g)``'s nodes as a graph of their own (an ``If`` branch) whose output is what ``make`` returns."""
    outer, g.nodes = g.nodes, []
    out = make(g)
    branch = g.helper.make_graph(g.nodes, g.name(hint), [], [g.helper.make_tensor_value_info(out, 1, None)])
    g.nodes = outer
    return branch


def _token_layer(g: _Graph, bilm: BiLM, edges: _Boundaries) -> str:
    """(B, T+2, P): the token encoder over the chars, or ``token_embeddings`` where the caller gives them (module
    docstring), with the boundaries' rows (computed here, at export) around each sentence."""
    with torch.no_grad():
        bos, eos = _array(bilm.token_encoder(bilm.boundary_char_ids))

    def given(g: _Graph) -> str:
        padded = g.op("Pad", [TOKEN_EMBEDDINGS, g.const([0, 1, 0, 0, 1, 0])])
        with_eos = g.op("Where", [edges.at_eos, g.weight("eos_embedding", eos.reshape(1, 1, -1)), padded])
        return g.op("Where", [edges.at_bos, g.weight("bos_embedding", bos.reshape(1, 1, -1)), with_eos])

    has = g.op("Greater", [g.op("Size", [TOKEN_EMBEDDINGS]), g.const(0)])
    then, otherwise = _branch(g, "given", given), _branch(g, "chars", lambda g: _token_encoder(g, bilm, edges.ids))
    return g.op("If", [has], hint="token_embeddings", then_branch=then, else_branch=otherwise)


def _token_encoder(g: _Graph, bilm: BiLM, ids: str) -> str:
    """(B, T', C) char ids ─► (B, T', P) token embeddings: ``model.TokenEncoder`` for bilm-tf's spelling, once per
    distinct word of the batch (``Unique`` rows, as the runtime's ``_distinct_chars``), then gathered per token."""
    encoder, cnn = bilm.token_encoder, bilm.token_encoder.char_cnn
    width = bilm.config.char_cnn.max_characters_per_token
    words = encoder.word_embedding is not None  # ELMoForManyLangs: each row's last id is the word's + 1
    flat = g.op("Reshape", [ids, g.const([-1, width + words])])
    rows = _content(
        g, g.op("Slice", [flat, g.const([0]), g.const([width]), g.const([1])]), cnn.pad_id, cnn.max_width, width
    )
    if words:
        rows = g.op(
            "Concat", [rows, g.op("Slice", [flat, g.const([width]), g.const([width + 1]), g.const([1])])], axis=1
        )
    distinct, _, inverse, _ = g.op("Unique", [rows], axis=0, outputs=4)
    spelled = g.op("Slice", [distinct, g.const([0]), g.const([-1]), g.const([1])]) if words else distinct
    chars = g.op("Gather", [g.weight("char_embedding", _array(cnn.char_embedding.weight)), spelled])  # (U, C', D)
    x = g.op("Transpose", [chars], perm=[0, 2, 1])  # (N, D, C)
    activation = "Relu" if cnn.activation is torch.relu else "Tanh"
    pooled = []
    for conv in cnn.convs:
        y = g.op("Conv", [x, g.weight("conv_w", _array(conv.weight)), g.weight("conv_b", _array(conv.bias))])
        pooled.append(g.op(activation, [g.op("ReduceMax", [y], axes=[2], keepdims=0)]))
    h = g.op("Concat", pooled, axis=1)  # (N, F)
    for highway in encoder.highways:
        carry = g.op(
            "Gemm",
            [h, g.weight("carry_w", _array(highway.carry.weight)), g.weight("carry_b", _array(highway.carry.bias))],
            transB=1,
        )
        gate = g.op("Sigmoid", [carry])
        transform = g.op(
            "Gemm",
            [
                h,
                g.weight("transform_w", _array(highway.transform.weight)),
                g.weight("transform_b", _array(highway.transform.bias)),
            ],
            transB=1,
        )
        kept = g.op("Mul", [g.op("Sub", [g.const(1.0, np.float32), gate]), h])
        h = g.op("Add", [g.op("Mul", [gate, g.op("Relu", [transform])]), kept])
    if words and encoder.word_embedding.embedding_dim > 0:  # [word; highway(cnn)], as ``TokenEncoder``
        word = g.op(
            "Squeeze", [g.op("Slice", [distinct, g.const([-1]), g.const([width + 1]), g.const([1])]), g.const([1])]
        )
        row = g.op("Max", [g.op("Sub", [word, g.const(1)]), g.const(0)])
        table = g.weight("word_embedding", _array(encoder.word_embedding.weight))
        h = g.op("Concat", [g.op("Gather", [table, row]), h], axis=1)
    if encoder.projection is not None:
        weight, bias = _array(encoder.projection.weight), _array(encoder.projection.bias)
        h = g.op("Gemm", [h, g.weight("projection_w", weight), g.weight("projection_b", bias)], transB=1)
    h = g.op("Gather", [h, inverse])  # (N, P): each token its word's row
    shape = g.op("Concat", [g.op("Slice", [g.op("Shape", [ids]), g.const([0]), g.const([2])]), g.const([-1])], axis=0)
    return g.op("Reshape", [h, shape], hint="token_embeddings")


def _content(g: _Graph, flat: str, pad_id: int, max_width: int, width: int) -> str:
    """(N, C) ─► (N, C') with C' the longest word's chars plus the widest filter, at most C: as ``CharCNN`` does,
    the windows cut away all lie in the in-word padding, whose value a kept window still gives, so the max over
    positions is unchanged (padding tokens, all zeros, count for nothing)."""
    chars = g.op("And", [g.op("Not", [g.op("Equal", [flat, g.const(pad_id)])]), g.op("Greater", [flat, g.const(0)])])
    position = g.op("Range", [g.const(1), g.const(width + 1), g.const(1)])
    last = g.op("ReduceMax", [g.op("Mul", [g.op("Cast", [chars], to=7), position])], keepdims=0)
    keep = g.op("Min", [g.op("Add", [last, g.const(max_width)]), g.const(width)])
    return g.op("Slice", [flat, g.const([0]), g.op("Unsqueeze", [keep, g.const([0])]), g.const([1])])


def _cell_body(g: _Graph, lstm: torch.nn.LSTM, clips: tuple[float | None, float | None]) -> Any:
    """The Scan body of one LSTM: (h, c, input gates of the step) ─► (h', c', h'); the recurrent weights are the
    outer graph's initializers."""
    helper, (cell_clip, proj_clip) = g.helper, clips
    hidden = lstm.hidden_size
    w_hh = g.weight("w_hh_t", _array(lstm.weight_hh_l0).T)
    w_hr = g.weight("w_hr_t", _array(lstm.weight_hr_l0).T) if lstm.proj_size > 0 else None
    split = g.const([hidden] * 4)
    body = _Graph.__new__(_Graph)
    body.helper, body.numpy_helper, body.nodes, body.initializers, body.count = (
        g.helper,
        g.numpy_helper,
        [],
        [],
        g.count,
    )
    z = body.op("Add", ["gates_t", body.op("MatMul", ["h_in", w_hh])])
    i, f, gg, o = body.op("Split", [z, split], axis=1, outputs=4)
    c = body.op(
        "Add",
        [
            body.op("Mul", [body.op("Sigmoid", [f]), "c_in"]),
            body.op("Mul", [body.op("Sigmoid", [i]), body.op("Tanh", [gg])]),
        ],
    )
    if cell_clip is not None:
        c = body.op("Clip", [c, g.const(-cell_clip, np.float32), g.const(cell_clip, np.float32)])
    h = body.op("Mul", [body.op("Sigmoid", [o]), body.op("Tanh", [c])])
    if w_hr is not None:
        h = body.op("MatMul", [h, w_hr])
    if proj_clip is not None:
        h = body.op("Clip", [h, g.const(-proj_clip, np.float32), g.const(proj_clip, np.float32)])
    body.nodes += [
        helper.make_node("Identity", [h], ["h_out"]),
        helper.make_node("Identity", [c], ["c_out"]),
        helper.make_node("Identity", [h], ["y_t"]),
    ]
    g.count = body.count
    floats = 1  # TensorProto.FLOAT
    return helper.make_graph(
        body.nodes,
        g.name("lstm_step"),
        [
            helper.make_tensor_value_info("h_in", floats, None),
            helper.make_tensor_value_info("c_in", floats, None),
            helper.make_tensor_value_info("gates_t", floats, None),
        ],
        [
            helper.make_tensor_value_info("h_out", floats, None),
            helper.make_tensor_value_info("c_out", floats, None),
            helper.make_tensor_value_info("y_t", floats, None),
        ],
    )


def _direction(g: _Graph, lstm: torch.nn.LSTM, clips: tuple, x: str, lengths: str, backward: bool) -> str:
    """One LSTM over (B, T', in) ─► (B, T', P): the input products for all steps, then the loop; the backward one
    over each sentence reversed within its length, its outputs put back in reading order."""
    if backward:
        x = g.op("ReverseSequence", [x, lengths], batch_axis=0, time_axis=1)
    bias = _array(lstm.bias_ih_l0) + _array(lstm.bias_hh_l0)  # the forget gate's +1 is in bias_hh
    gates = g.op("Add", [g.op("MatMul", [x, g.weight("w_ih_t", _array(lstm.weight_ih_l0).T)]), g.weight("bias", bias)])
    batch = g.op("Slice", [g.op("Shape", [x]), g.const([0]), g.const([1])])
    out_dim = lstm.proj_size or lstm.hidden_size
    h0 = g.op(
        "ConstantOfShape",
        [g.op("Concat", [batch, g.const([out_dim])], axis=0)],
        value=g.numpy_helper.from_array(np.zeros(1, np.float32)),
    )
    c0 = g.op(
        "ConstantOfShape",
        [g.op("Concat", [batch, g.const([lstm.hidden_size])], axis=0)],
        value=g.numpy_helper.from_array(np.zeros(1, np.float32)),
    )
    body = _cell_body(g, lstm, clips)
    _, _, y = g.op(
        "Scan", [h0, c0, gates], outputs=3, body=body, num_scan_inputs=1, scan_input_axes=[1], scan_output_axes=[1]
    )
    if backward:
        y = g.op("ReverseSequence", [y, lengths], batch_axis=0, time_axis=1)
    return y


def build(bilm: BiLM, metadata: dict[str, str], batch_first: bool = False) -> Any:
    """The ``onnx.ModelProto`` of ``bilm`` (module docstring), ``metadata`` in its metadata_props. ``batch_first``:
    ``layers`` as (B, L+1, T, 2P), the layout Triton batches (it takes the first dimension of every tensor as the
    batch's)."""
    import onnx

    g = _Graph()
    edges = _boundaries(g, INPUT, *(b.cpu().numpy().astype(np.int64) for b in bilm.boundary_char_ids))
    lengths, mask = edges.lengths, edges.mask
    e = _token_layer(g, bilm, edges)
    cfg = bilm.config.lstm
    clips = (cfg.cell_clip, cfg.proj_clip)
    layers = [g.op("Concat", [e, e], axis=2)]
    forward_in = backward_in = e
    for layer in range(cfg.n_layers):
        fwd = _direction(g, bilm.lstm.forward_layers[layer], clips, forward_in, lengths, backward=False)
        bwd = _direction(g, bilm.lstm.backward_layers[layer], clips, backward_in, lengths, backward=True)
        if layer > 0 and cfg.use_skip_connections:
            fwd, bwd = g.op("Add", [fwd, forward_in]), g.op("Add", [bwd, backward_in])
        layers.append(g.op("Concat", [fwd, bwd], axis=2))
        forward_in, backward_in = fwd, bwd
    stacked = g.op("Concat", [g.op("Unsqueeze", [x, g.const([0])]) for x in layers], axis=0)  # (L+1, B, T+2, 2P)
    inner = g.op("Slice", [stacked, g.const([1]), g.const([-1]), g.const([2])])  # the boundaries removed
    keep = g.op("Unsqueeze", [g.op("Cast", [mask], to=1), g.const([0, 3])])
    if batch_first:
        g.nodes.append(g.helper.make_node("Transpose", [g.op("Mul", [inner, keep])], [LAYERS], perm=[1, 0, 2, 3]))
    else:
        g.nodes.append(g.helper.make_node("Mul", [inner, keep], [LAYERS]))
    g.nodes.append(g.helper.make_node("Identity", [mask], [MASK]))
    width = 2 * cfg.projection_dim
    layers_shape = ["batch", cfg.n_layers + 1] if batch_first else [cfg.n_layers + 1, "batch"]
    layers_shape += ["tokens", width]
    dim = cfg.projection_dim
    g.initializers.append(g.numpy_helper.from_array(np.zeros((0, 0, dim), np.float32), TOKEN_EMBEDDINGS))  # default
    graph = g.helper.make_graph(
        g.nodes,
        "elmo_bilm",
        [
            g.helper.make_tensor_value_info(
                INPUT, onnx.TensorProto.INT64, ["batch", "tokens", bilm.boundary_char_ids.shape[-1]]
            ),
            g.helper.make_tensor_value_info(TOKEN_EMBEDDINGS, onnx.TensorProto.FLOAT, ["batch", "tokens", dim]),
        ],
        [
            g.helper.make_tensor_value_info(LAYERS, onnx.TensorProto.FLOAT, layers_shape),
            g.helper.make_tensor_value_info(MASK, onnx.TensorProto.INT64, ["batch", "tokens"]),
        ],
        initializer=g.initializers,
    )
    model = g.helper.make_model(graph, opset_imports=[g.helper.make_opsetid("", OPSET)], producer_name="elmo-pipeline")
    model.ir_version = IR_VERSION
    props = {**metadata, "elmo.opset": str(OPSET), "elmo.config": bilm.config.model_dump_json()}
    if bilm.dictionaries is not None:  # the rows char_ids holds are the model's own: its dictionaries travel with it
        props[DICTIONARIES] = json.dumps(bilm.dictionaries.state(), ensure_ascii=False)
    g.helper.set_model_props(model, props)
    onnx.checker.check_model(model)
    return model
