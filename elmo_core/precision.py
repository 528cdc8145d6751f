"""Where and in what precision a run computes: its device, and exact float32 (bilm-tf's numbers) or bfloat16
matmuls with float32 state.

``bf16`` runs the char CNN, highway, projection, the LSTM input and recurrent matmuls (and the softmax where
used) in bfloat16 under ``torch.autocast``; accumulation happens in float32 inside the kernels, and the LSTM
cell state, the gate arithmetic and the loss stay float32 (``lstm.LstmCell`` casts the gates up).

On a CPU without bfloat16 instructions (AVX2-only x86, AVX-512 before Cooper Lake, Arm without bf16) oneDNN emulates
bf16, and a run is not slower but unusable: the small shape embedded at 25 tokens/s against 1,600 in fp32 on an
AVX2-only EPYC (``bench/embed_throughput.py``). So ``bf16`` is refused there in one line that gives the slowdown
measured on that CPU (one product timed both ways), and ``auto`` takes fp32; ``ELMO_ALLOW_EMULATED_BF16=1`` runs it
anyway (to check a bf16 config on a laptop before a GPU run), with that line as a warning. ``cpu.py``'s
``ELMO_CPU_ISA=avx2`` makes a CPU with bf16 behave as one without (how the tests and CI exercise this path anywhere).

``int8`` (inference on the CPU only, never chosen by ``auto``): the LSTM step's products on int8 weights, about 2x
fp32 on the original shape where bf16 is not native (``kernels/int8.py``); training takes fp32 or bf16.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator
from functools import lru_cache

import torch

from elmo_core import cpu
from elmo_core.errors import ConfigError

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "fp32", "bf16", "int8")  # int8: CPU inference only (``kernels/int8.py``)


def pick_device(name: str) -> torch.device:
    """``auto`` → CUDA when there is a GPU, else the CPU; CUDA asked for without one falls back with a warning."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        log.warning("CUDA is not available; running on the CPU")
        return torch.device("cpu")
    return device


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bfloat16 dot-product instructions (avx512_bf16, AMX, AVX-NE-CONVERT, Arm's bf16) and
    oneDNN uses them (``ONEDNN_MAX_CPU_ISA`` can hold it below them). False under ``ELMO_CPU_ISA=avx2``."""
    if not cpu.facts().bf16_instructions:
        return False
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PrecisionError(ConfigError):
    """A precision this device cannot run usefully (bf16 on a CPU that emulates it)."""


ALLOW_EMULATED_BF16 = "ELMO_ALLOW_EMULATED_BF16"


@lru_cache(maxsize=1)
def emulated_bf16_slowdown() -> float:
    """How many times slower a bf16 product runs than the same fp32 one on this CPU: a (64 x 512) @ (512 x 4096)
    product, the small shape's LSTM step, timed both ways (best of 3)."""
    x, w = torch.randn(64, 512), torch.randn(512, 4096)

    def best(a: torch.Tensor, b: torch.Tensor) -> float:
        torch.mm(a, b)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
        return min(times)

    return best(x.bfloat16(), w.bfloat16()) / max(best(x, w), 1e-9)


def _emulated_bf16_line() -> str:
    return (
        f"precision bf16: this CPU has no bfloat16 instructions ({cpu.facts().line()}; torch CPU kernels "
        f"{cpu.torch_capability()}), so bf16 is emulated: a bf16 product measured "
        f"{emulated_bf16_slowdown():.1f}x the time of the same fp32 one here; use precision fp32 (what auto "
        f"chooses here), or "
        f"set {ALLOW_EMULATED_BF16}=1 to run bf16 anyway"
    )


_warned: set[str] = set()


def native_bf16(device: torch.device | str) -> tuple[bool, str]:
    """Whether ``device`` computes bfloat16 products natively, and what says so (for the run's log)."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{torch.cuda.get_device_name(device)} computes bfloat16 natively"
        return False, "this GPU has no native bfloat16"
    if device.type == "cpu":
        if cpu_has_native_bf16():
            return (
                True,
                f"the CPU has bfloat16 instructions (avx512_bf16 or AMX; torch capability {cpu.torch_capability()})",
            )
        return False, f"the CPU has no bfloat16 instructions (torch capability {cpu.torch_capability()})"
    return False, f"{device.type} is not known to compute bfloat16 natively"


class Precision(str):
    """A precision resolved for one device: its name ("fp32", "bf16", "int8"; it compares as that name), the device
    type it was resolved for, and why (for the run's log and MLflow). ``resolve_precision`` returns one as it is, so
    a stage resolves its precision once, in its plan, and everything below it keeps that decision."""

    why: str
    device: str

    def __new__(cls, name: str, device: str, why: str) -> Precision:
        value = super().__new__(cls, name)
        value.device, value.why = device, why
        return value

    def __reduce__(self) -> tuple:  # pickled whole (a Dask worker gets the decision, not a bare name)
        return (Precision, (str(self), self.device, self.why))


def resolve_precision(precision: str, device: torch.device | str) -> Precision:
    """The one place a precision is decided. ``auto`` is bf16 wherever the hardware computes it natively (CUDA with
    bf16, CPUs with avx512_bf16 or AMX) and fp32 elsewhere, never int8 (not exact: it is asked for). Refused in one
    line (``PrecisionError``): int8 off the CPU or where this torch has no dynamic int8 products; bf16 on a CPU that
    would emulate it (with the measured slowdown), which ``ELMO_ALLOW_EMULATED_BF16=1`` runs with that line as a
    warning, once. A ``Precision`` already resolved for this device type is returned unchanged."""
    device_type = torch.device(device).type
    if isinstance(precision, Precision) and precision.device == device_type:
        return precision
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        native, why = native_bf16(device)
        return Precision("bf16" if native else "fp32", device_type, f"auto: {why}")
    if precision == "int8":
        if device_type != "cpu":
            raise PrecisionError(
                f"precision int8: CPU inference only (dynamic int8 products); on {device_type} use fp32 or bf16"
            )
        works, why = int8_products()
        if not works:
            raise PrecisionError(f"precision int8: {why}; use precision fp32")
        return Precision("int8", device_type, f"asked for int8 ({why})")
    if precision == "bf16" and device_type == "cpu" and not cpu_has_native_bf16():
        if os.environ.get(ALLOW_EMULATED_BF16) != "1":
            raise PrecisionError(_emulated_bf16_line())
        if "cpu" not in _warned:
            _warned.add("cpu")
            log.warning("%s (running it: %s=1)", _emulated_bf16_line(), ALLOW_EMULATED_BF16)
    return Precision(str(precision), device_type, f"asked for {precision}")


# ``ONEDNN_MAX_CPU_ISA`` values that leave oneDNN every instruction set the CPU has (any other may hold it below VNNI,
# as ``ELMO_CPU_ISA=avx2`` does; then fbgemm's 7 bits are the safe choice)
_ONEDNN_UNHELD = frozenset({"", "ALL", "DEFAULT"})
_PACKING = threading.Lock()  # the quantized engine is process-wide: one packing swaps it at a time
INT8_DEPRECATED = ".*quantiz.*deprecated"  # PyTorch 2.13's warning on the quantized tensors the int8 ops rest on


def int8_engine() -> tuple[str, int]:
    """(the quantized engine int8 weights are packed for, the bits each call's activations are quantized to).

    Where the CPU sums int8 products in int32 (VNNI: AVX-512 VNNI, AVX-VNNI, AMX) the weights go to oneDNN with 8-bit
    activations: on the 2-vCPU AMD EPYC with VNNI its products of the LSTM's 16,384-wide gates ran 1.17-1.24x
    fbgemm's 7-bit ones, its projection 0.90-1.05x (``bench/int8_engines.py``), and the 8th bit raised the TF-trained
    fixture's worst layer-1 cosine to fp32 from 0.99907 to 0.99977. Elsewhere on x86 torch's default engine with
    7-bit activations: AVX2's ``vpmaddubsw`` sums pairs of int8 x uint8 in int16, which 8-bit activations can
    saturate. Decided once per ``ELMO_CPU_ISA`` (the CPU a process behaves as)."""
    return _int8_engine(cpu.override())


@lru_cache(maxsize=4)
def _int8_engine(isa: str | None) -> tuple[str, int]:
    facts, engine = cpu.facts(), torch.backends.quantized.engine
    unheld = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper() in _ONEDNN_UNHELD
    if facts.vnni and unheld and "onednn" in torch.backends.quantized.supported_engines:
        return "onednn", 8
    return engine, 7 if facts.x86 else 8


@contextlib.contextmanager
def quantized_engine(name: str) -> Iterator[None]:
    """torch's quantized engine set to ``name`` for the block: a packed weight keeps the engine it was packed for,
    so only packing reads it. The setting is process-wide: it is put back at once, and one block holds it at a time
    (two threads packing at once would otherwise put back each other's)."""
    with _PACKING:
        before = torch.backends.quantized.engine
        torch.backends.quantized.engine = name
        try:
            yield
        finally:
            torch.backends.quantized.engine = before


def int8_packed(w: torch.Tensor, engine: str) -> torch.ScriptObject:
    """w (N, K) as int8 per output channel (symmetric: each row's scale its largest magnitude / 127), packed for
    ``engine``'s dynamic products: what ``kernels/int8.py`` runs and ``int8_products`` probes. PyTorch's deprecation
    warning is silenced here."""
    with warnings.catch_warnings(), quantized_engine(engine):
        warnings.filterwarnings("ignore", message=INT8_DEPRECATED)
        w = w.detach().float().contiguous()
        scale = (w.abs().amax(1).clamp_min(1e-8) / 127).double()
        q = torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(q, None)


def int8_products() -> tuple[bool, str]:
    """Whether this torch runs dynamic int8 products on this CPU (what ``precision: int8`` runs, ``kernels/int8.py``),
    and why not: one tiny product on ``int8_engine``, checked once per ``ELMO_CPU_ISA`` against float32 (a wrong
    result, a missing op or an engine that refuses the CPU each say so). PyTorch 2.13 marks these ops deprecated;
    the warning is silenced here."""
    return _int8_products(cpu.override())


@lru_cache(maxsize=4)
def _int8_products(isa: str | None) -> tuple[bool, str]:
    try:
        engine, bits = int8_engine()
        w = torch.linspace(-1, 1, 64).view(8, 8)
        x = torch.linspace(1, -1, 24).view(3, 8)
        packed = int8_packed(w, engine)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=INT8_DEPRECATED)
            got = torch.ops.quantized.linear_dynamic(x, packed, bits == 7)
    except (AttributeError, RuntimeError) as exc:  # the ops removed, or no quantized engine for this CPU
        log.debug("dynamic int8 products unavailable: %s", exc)
        return False, f"no dynamic int8 products in this torch here: {str(exc).splitlines()[0][:120]}"
    error = float((got - x @ w.T).abs().max())
    if error > 0.05:
        return False, f"the int8 product gave wrong numbers here (error {error:.3g})"
    return True, f"dynamic int8 products ({engine} engine, {bits}-bit activations)"


def autocast(device: torch.device | str, precision: str) -> contextlib.AbstractContextManager:
    """The autocast context of ``precision`` on ``device`` (a no-op for fp32)."""
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


@contextlib.contextmanager
def onednn_verbose(enabled: bool) -> Iterator[None]:
    """Print oneDNN's kernel log (which primitives ran, in which precision) while the block runs."""
    if not enabled or not torch.backends.mkldnn.is_available():
        yield
        return
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        yield
