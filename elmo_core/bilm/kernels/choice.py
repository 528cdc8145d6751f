"""What runs a model, chosen once and printable: ``Kernels`` for inference (``choose``), ``TrainingKernels`` for
calls with gradients (``choose_training``).

``BiLM.prepare(precision)`` calls ``choose`` and keeps the result; every inference call then runs what it says: on a
CPU the prepared cells and their C kernels, on CUDA a clipped model's layers a layer at a time (``layer_steps``:
compiled steps replayed as CUDA graphs), a model without clips PyTorch's ``nn.LSTM``.
``BiLM.prepare_training()`` (the trainer calls it, and logs it) calls ``choose_training``: calls with gradients run
the reference arithmetic of ``model.py``; on a CPU where the C loops build, each LSTM step is one autograd node with
its gates in C, and the char CNN's backward is sparse at each max's position.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from elmo_core import cpu
from elmo_core import precision as precision_module
from elmo_core.bilm.kernels import char_cnn, cuda_graphs, fused_gates, int8, layer_steps, packed, switches, trained_step
from elmo_core.bilm.kernels import step_loop as step_loop_module
from elmo_core.bilm.kernels.cache import WeightCache
from elmo_core.bilm.kernels.cells import CpuCell
from elmo_core.bilm.kernels.layer_steps import LayerCell
from elmo_core.config import LstmConfig
from elmo_core.precision import Precision, autocast, cpu_has_native_bf16, native_bf16

NN_LSTM = "PyTorch's nn.LSTM (cuDNN on a GPU; the model has no clips, which nn.LSTM cannot do)"


def runs_nn_lstm(lstm: LstmConfig, precision: str, forced: bool | None) -> bool:
    """Whether a model's LSTM layers run as PyTorch's own ``nn.LSTM``: by default where the model has no clips (and
    the precision is not int8, whose products only the CPU cells run); ``forced`` True on a clipped model is an
    error, False keeps the cells."""
    if forced and lstm.clipped:
        raise ValueError("nn.LSTM cannot clip: set cell_clip and proj_clip to null to run it")
    return (not lstm.clipped and precision != "int8") if forced is None else forced


@dataclass(frozen=True)
class Kernels:
    """The inference kernels of one model on one device, in one precision.

    ``cpu_cells``: the LSTM steps run this choice's own cell (``cell``): ``cells.CpuCell`` (weights prepared once),
    or ``layer_steps.LayerCell`` where ``layer_at_once`` (CUDA's default; on a CPU where forced); else
    ``lstm.LstmCell``, the reference. ``compiled`` and ``graphs``: how ``LayerCell`` runs its steps
    (``torch.compile``, CUDA graphs), ``layer_note`` why either is off. ``min_packed``: weights of at least this many
    elements per direction run their per-step products on oneDNN-packed copies (None: never). ``gate_kernel``: the
    gate arithmetic runs in C. ``packed_weights`` names which of this model's weights that makes, for the log. In
    ``int8`` the "packed" weights are int8 ones (``kernels.int8``), every per-step product's.
    """

    device: str
    precision: str
    cpu_cells: bool
    nn_lstm: bool = False  # the LSTM layers run PyTorch's nn.LSTM (cuDNN on a GPU): a model without clips
    min_packed: int | None = None
    gate_kernel: bool = False
    packed_weights: str = ""
    gate_kernel_note: str = ""
    step_loop: bool = False  # fp32: a layer's steps in one C call (``step_loop``), every one or the last few
    word_gates_bf16: bool = False  # int8 with native bf16: layer 0's per-word input product in bf16 (``CpuCell``)
    encoder_bf16: bool = False  # int8 with native bf16 and 8-bit activations: layer 0 in bf16 (``_encoder_bf16``)
    layer_at_once: bool = False  # the steps run ``layer_steps.LayerCell`` (a whole layer per call, fixed shapes)
    compiled: bool = False
    graphs: bool = False
    layer_note: tuple[str, str] = ("", "")  # (torch.compile's backend or why not, CUDA graphs or why not)
    cache: WeightCache = field(default_factory=WeightCache, compare=False, repr=False)

    def __str__(self) -> str:
        return self._describe() + switches.line()  # the environment's switches, where any is set, on every line

    def _describe(self) -> str:
        if self.nn_lstm:
            return f"precision {self.precision} on {self.device}: {NN_LSTM}"
        if not self.cpu_cells:
            return f"precision {self.precision} on {self.device}: the reference LSTM cell (PyTorch ops, autocast)"
        if self.layer_at_once:
            how = layer_steps.describe(self.compiled, self.graphs, *self.layer_note)
            return f"precision {self.precision} on {self.device}: {how}"
        products = (
            f"LSTM step products in int8 {self.packed_weights} ({int8.describe()}), layer 0 (char CNN, highway, "
            f"projection) in {'bf16' if self.encoder_bf16 else 'fp32'}, layer 0's per-word input "
            f"products in {'bf16' if self.word_gates_bf16 else 'fp32'}"
            if self.precision == "int8"
            else f"LSTM step weights packed for oneDNN {self.packed_weights}"
        )
        return (
            f"precision {self.precision} on {self.device}: {cpu.facts().line()}, torch CPU kernels "
            f"{cpu.torch_capability()}, native bf16 "
            f"{'yes' if cpu_has_native_bf16() else 'no'}, {products}, "
            f"LSTM gates fused in C {self.gate_kernel_note}, a layer's steps in one C loop "
            f"{step_loop_module.describe() if self.step_loop else 'no'}"
        )

    def runs_on(self, device: torch.device) -> bool:
        return device.type == self.device

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast context the model runs in: bf16 products where asked (and on the reference cell)."""
        return autocast(self.device, self.precision)

    def cell(self, pair: Sequence[nn.LSTM], clips: tuple[float | None, float | None]) -> CpuCell | LayerCell:
        if self.layer_at_once:
            dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
            return LayerCell(pair, clips, dtype=dtype, cache=self.cache, compiled=self.compiled, graphs=self.graphs)
        return CpuCell(
            pair,
            clips,
            dtype=torch.bfloat16 if self.precision == "bf16" else torch.float32,
            cache=self.cache,
            min_packed=self.min_packed,
            gate_kernel=self.gate_kernel,
            int8=self.precision == "int8",
            c_loop=self.step_loop,
            word_gates_bf16=self.word_gates_bf16,
        )

    def token_encoder(self, encoder: nn.Module) -> Callable[[Tensor], Tensor]:
        """The token encoder to run: in bf16 on the CPU, a bfloat16 copy made once per weight version (autocast
        would cast the same weights on every call; the numbers are the same); under int8 (``encoder_bf16``) the
        same copy, its rows handed on in float32 as the int8 cells read them."""
        if not (self.device == "cpu" and self.cpu_cells and (self.precision == "bf16" or self.encoder_bf16)):
            return encoder
        in_bf16 = self.cache.get((encoder,), "bf16-encoder", lambda: copy.deepcopy(encoder).to(torch.bfloat16))
        return in_bf16 if self.precision == "bf16" else lambda char_ids: in_bf16(char_ids).float()


def offered_precisions(device: torch.device | str) -> tuple[str, ...]:
    """The precisions inference on ``device`` runs usefully (``elmo info`` lists them): fp32 everywhere, bf16 where
    the device computes it natively (elsewhere it is refused, ``precision.py``), int8 on a CPU whose torch runs
    dynamic int8 products (``int8.py``). ``auto`` never picks int8: it is not exact, so it is asked for."""
    offered = ("fp32", "bf16") if native_bf16(device)[0] else ("fp32",)
    return (*offered, "int8") if torch.device(device).type == "cpu" and int8.available() else offered


def _resolved_for(device: torch.device, precision: Precision) -> None:
    """The chooser takes a precision decided above it (``runtime.place``, ``BiLM.prepare``), and never decides one."""
    if not isinstance(precision, Precision) or precision.device != device.type:
        raise TypeError(f"choose takes a Precision resolved for {device.type} (runtime.place), not {precision!r}")


def choose(
    device: torch.device,
    precision: Precision,
    lstm: LstmConfig,
    *,
    cpu_cells: bool | None = None,
    min_packed: int | None | str = "auto",
    gate_kernel: bool | None = None,
    nn_lstm: bool | None = None,
    step_loop: bool | None = None,
    layer_at_once: bool | None = None,
    compiled: bool | None = None,
    graphs: bool | None = None,
    word_gates_bf16: bool | None = None,
    encoder_bf16: bool | None = None,
) -> Kernels:
    """The kernels for a model of ``lstm``'s shape on ``device``: PyTorch's ``nn.LSTM`` for a model without clips;
    else on the CPU the prepared cells, oneDNN-packed products for weights from ``packed.MIN_ELEMENTS`` up, and the C
    gate kernel where it builds; on CUDA ``layer_steps.LayerCell`` (below). Each choice can be forced (the tests run
    every combination); ``ELMO_NO_PACKED_WEIGHTS=1`` and ``ELMO_NO_FUSED_GATES=1`` turn the two CPU kernels off. In
    fp32 with the C library a layer's steps run in one C loop (``step_loop``; ``step_loop=False`` or
    ``ELMO_NO_STEP_LOOP=1``: never). On CUDA a clipped model runs ``layer_steps.LayerCell`` (``layer_at_once``;
    ``ELMO_NO_LAYER_STEPS=1`` or False: the reference, as does ``cpu_cells=False``), its steps compiled where
    ``torch.compile`` runs (``compiled``; ``ELMO_NO_COMPILE=1``) and replayed as CUDA graphs (``graphs``;
    ``ELMO_NO_CUDA_GRAPHS=1``); on a CPU only where ``layer_at_once=True`` (never in int8, whose products only
    ``CpuCell`` runs). ``word_gates_bf16`` and ``encoder_bf16``: int8's per-word input product and layer 0 in bf16
    where chosen (``_word_gates_bf16``, ``_encoder_bf16``; False: fp32; True cannot force them)."""
    _resolved_for(device, precision)
    if runs_nn_lstm(lstm, precision, nn_lstm):
        return Kernels(device.type, precision, cpu_cells=False, nn_lstm=True)
    if cpu_cells is not False and _layer_at_once(device, precision, layer_at_once):
        return _layer_kernels(device, precision, compiled, graphs)
    on_cpu = device.type == "cpu"
    if not (on_cpu if cpu_cells is None else cpu_cells):
        return Kernels(device.type, precision, cpu_cells=False)
    if precision == "int8":  # every per-step product on int8 weights, at any size (resolve_precision probed them)
        can_pack, why_not, smallest = True, "", 0
    else:
        can_pack, why_not = packed.packing(torch.bfloat16 if precision == "bf16" else torch.float32)
        smallest = packed.MIN_ELEMENTS
    if min_packed == "auto":
        min_packed = smallest if can_pack else None
    elif min_packed is not None and not can_pack:
        min_packed = None
    if gate_kernel is False:
        gate_note = "no (not chosen)"
    else:
        gate_kernel, gate_note = fused_gates.available(), fused_gates.describe()
    return Kernels(
        device.type,
        precision,
        cpu_cells=True,
        min_packed=min_packed,  # type: ignore[arg-type]
        gate_kernel=gate_kernel,
        packed_weights=_describe_packing(lstm, min_packed, why_not),  # type: ignore[arg-type]
        gate_kernel_note=gate_note,
        step_loop=precision == "fp32" and bool(gate_kernel) and step_loop is not False and step_loop_module.on(),
        word_gates_bf16=_word_gates_bf16(precision, bool(gate_kernel), word_gates_bf16),
        encoder_bf16=_encoder_bf16(precision, encoder_bf16),
    )


def _word_gates_bf16(precision: str, gate_kernel: bool, forced: bool | None) -> bool:
    """int8: layer 0's per-word input product (one per distinct word a call), which int8 does not quantize (int8
    activations scaled per call over every word's row fell below int8's cosine bar, 0.9976 against 0.999 in
    tests/test_int8.py), in bf16, which holds it at 1.22x int8's tokens/s on the original size
    (bench/int8_word_gates.py): where the CPU has bf16 products (emulated they are slower than fp32) and the C gate
    kernel reads the bf16 rows. ``forced`` False: fp32."""
    return precision == "int8" and gate_kernel and forced is not False and cpu_has_native_bf16()


def _encoder_bf16(precision: str, forced: bool | None) -> bool:
    """int8: layer 0 (char CNN, highway, projection, once per distinct word) in bf16 where the CPU has bf16 products
    and the int8 products take 8-bit activations (``precision.int8_engine``). Why: in fp32 it was the largest cost
    after the products, 6.2 of 38.8 s of an ELMoForManyLangs release's batch job, and bf16 runs it 2.2x faster. Why
    only with 8-bit activations: with 7-bit ones the TF-trained fixture's worst layer-1 cosine to fp32 fell to 0.99900
    with it (0.99907 without), on tests/test_int8.py's bar; with 8-bit ones it is 0.99971 with it (0.99977 without),
    and layer 0's own 0.99994. ``forced`` False: fp32 (layer 0 then equals fp32's)."""
    if precision != "int8" or forced is False or not cpu_has_native_bf16():
        return False
    return precision_module.int8_engine()[1] == 8  # int8 was resolved above: its products run here


def _layer_at_once(device: torch.device, precision: str, forced: bool | None) -> bool:
    """``LayerCell`` by default on CUDA (measured on the CPU: its C kernels are faster, ``docs/what-runs.md``)."""
    if forced and precision == "int8":
        raise ValueError("the layer-at-a-time LSTM has no int8 products: use layer_at_once=False in int8")
    if forced is not None:
        return forced
    return device.type == "cuda" and precision != "int8" and not switches.off("ELMO_NO_LAYER_STEPS")


def _layer_kernels(device: torch.device, precision: str, compiled: bool | None, graphs: bool | None) -> Kernels:
    """``LayerCell``'s kernels: compiled where ``torch.compile`` runs here, CUDA graphs on CUDA (each forced off by
    False; forced on where it cannot run, it is off with the reason printed)."""
    can_compile, compile_note = layer_steps.compile_available(device)
    can_graph, graphs_note = cuda_graphs.available(device)
    if compiled is False:
        can_compile, compile_note = False, "not chosen"
    if graphs is False:
        can_graph, graphs_note = False, "not chosen"
    return Kernels(
        device.type,
        precision,
        cpu_cells=True,
        layer_at_once=True,
        compiled=can_compile,
        graphs=can_graph,
        layer_note=(compile_note, graphs_note),
    )


@dataclass(frozen=True)
class TrainingKernels:
    """What runs a model's calls with gradients on one device: ``lstm.LstmCell`` (the reference products, under
    the run's autocast); with ``one_node`` each step one autograd node, its gate arithmetic in C forward and
    backward (``trained_step``). ``sparse_char_cnn``: each char CNN width's convolution and max is one node whose
    backward reaches only the max's position, in C (``char_cnn``). The notes say why not where one is off."""

    device: str
    one_node: bool
    note: str = ""
    sparse_char_cnn: bool = False
    char_cnn_note: str = ""
    nn_lstm: bool = False  # the LSTM layers run PyTorch's nn.LSTM: a model without clips

    def __str__(self) -> str:
        cnn = (
            "oneDNN's convolution, its backward in C at each max's position only"
            if self.sparse_char_cnn
            else f"oneDNN's convolution and its dense backward {self.char_cnn_note}"
        )
        if self.nn_lstm:
            return f"training on {self.device}: {NN_LSTM}; char CNN: {cnn}"
        how = (
            "each step one autograd node, its gates in C forward and backward"
            if self.one_node
            else f"PyTorch ops {self.note}"
        )
        return (
            f"training on {self.device}: the reference LSTM cell (PyTorch products, autocast), {how}; char CNN: {cnn}"
        )

    def runs_on(self, device: torch.device) -> bool:
        return device.type == self.device


def choose_training(
    device: torch.device,
    lstm: LstmConfig,
    *,
    one_node: bool | None = None,
    sparse_char_cnn: bool | None = None,
    nn_lstm: bool | None = None,
) -> TrainingKernels:
    """For a model without clips PyTorch's ``nn.LSTM``. Else on the CPU one node per LSTM step with the C gates,
    where the C loops build (``ELMO_NO_FUSED_GATES=1`` turns them off; ``one_node`` forces it off); on CUDA the
    reference, whose launches run asynchronously ahead of the GPU. On the CPU the char CNN's sparse backward where it
    builds (``sparse_char_cnn`` forces it off)."""
    if device.type != "cpu":
        fused = runs_nn_lstm(lstm, "fp32", nn_lstm)
        return TrainingKernels(device.type, False, "(not a CPU)", False, "(not a CPU)", nn_lstm=fused)
    steps, steps_note = False, "(not chosen)"
    if one_node is not False:
        steps, steps_note = trained_step.available(), f"(the C loops: {trained_step.describe()})"
    cnn, cnn_note = False, "(not chosen)"
    if sparse_char_cnn is not False:
        cnn, cnn_note = char_cnn.available(), f"(the C backward: {char_cnn.describe()})"
    if runs_nn_lstm(lstm, "fp32", nn_lstm):
        return TrainingKernels(device.type, False, "(nn.LSTM)", cnn, cnn_note, nn_lstm=True)
    return TrainingKernels(device.type, steps, steps_note, cnn, cnn_note)


def _describe_packing(lstm: LstmConfig, min_packed: int | None, why_not: str) -> str:
    """Which of the model's per-step weights get packed, or why none: 'yes (hh, cat)', 'no (weights under …)'."""
    if min_packed is None:
        return f"no ({why_not or 'not chosen'})"
    p, h = lstm.projection_dim, lstm.dim
    projects = p < h
    sizes = {"hh": p * 4 * h, "hr": h * p if projects else 0, "cat": 2 * p * 4 * h}
    chosen = [name for name, size in sizes.items() if size and size >= min_packed]
    if not chosen:
        return f"no (weights under {min_packed:,} elements: bmm is as fast)"
    return f"yes ({', '.join(chosen)})"
