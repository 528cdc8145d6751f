"""The speed kernels of CPU inference, in a room of their own: the model (``model.py``) is the network and its
reference arithmetic; this package holds what makes its inference fast on a CPU, and ``Kernels`` says which of it
runs (``elmo -v embed`` prints it).

    choice       ``Kernels`` and ``choose``: made once by ``BiLM.prepare(precision)``, printable
    cells        ``CpuCell``: an LSTM layer's step, both directions, fp32 or bf16, on weights prepared once
    cache        ``WeightCache``: derived weights (stacked, cast, packed) kept until a parameter changes
    packed       weights packed once into oneDNN's layout for the small per-step products
    fused_gates  the gate arithmetic of a step as one C loop (``lstm_gates.c``), built on first use

Every kernel computes the reference's numbers: fp32 to float rounding (tests hold 1e-5), bf16 to a cosine of
0.999 on real text (``tests/test_precision.py``).
"""

from elmo_core.kernels.choice import Kernels, choose

__all__ = ["Kernels", "choose"]
