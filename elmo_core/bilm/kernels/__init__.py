"""The speed kernels, in a room of their own: the model (``model.py``) is the network and its reference arithmetic;
this package holds what makes its inference and its training fast on a CPU and its inference on CUDA, and
``Kernels`` (inference, ``elmo -v embed`` prints it) and ``TrainingKernels`` (the training log prints it) say which
of it runs.

    choice       ``Kernels``/``choose`` and ``TrainingKernels``/``choose_training``: made once by
                 ``BiLM.prepare(precision)`` and ``BiLM.prepare_training()``, printable
    cells        ``CpuCell``: an LSTM layer's step, both directions, fp32 or bf16, on weights prepared once
    cache        ``WeightCache``: derived weights (stacked, cast, packed) kept until a parameter changes
    packed       weights packed once into oneDNN's layout for the small per-step products
    fused_gates  the gate arithmetic of a step as one C loop (``lstm_gates.c``), built on first use
    step_loop    fp32: a layer's steps in one C call (``lstm_steps.c``, the same library), every step or the last few
    trained_step  a training step of an LSTM layer as one autograd node: PyTorch's products, the gates in C
    char_cnn     the char CNN's convolution and max in training, its backward in C at each max's position only
                 (``char_cnn.c``, built into the same library)
    cuda_graphs  fixed-shape work captured once as a CUDA graph and replayed (harmless to import without CUDA)
    layer_steps  ``LayerCell``: the clipped LSTM a layer at a time on padded rows, its step compiled by
                 ``torch.compile``, its chunks of steps replayed as CUDA graphs: CUDA's inference cell

Every kernel computes the reference's numbers: fp32 to float rounding (tests hold 1e-5), bf16 to a cosine of
0.999 on real text (``tests/test_precision.py``).
"""

from elmo_core.bilm.kernels.choice import Kernels, TrainingKernels, choose, choose_training

__all__ = ["Kernels", "TrainingKernels", "choose", "choose_training"]
