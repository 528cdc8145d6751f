"""One default per runtime decision, which every options model, the runtime, the model's own API and the AllenNLP
drop-in share (``tests/test_runtime.py`` finds a default written anywhere else). Torch-free, so that what only reads
options (the server's HTTP process, the CLI's parser) imports no torch.

Inference is exact unless asked otherwise (bf16 and int8 change the numbers); training takes bf16 where the hardware
computes it natively; every stage runs on a GPU where there is one. A model built in Python (``BiLM``, the drop-in's
``Elmo``) starts on the CPU as every torch module does, and moves with ``.to()``.
"""

DEFAULT_INFERENCE_PRECISION = "fp32"
DEFAULT_TRAINING_PRECISION = "auto"
DEFAULT_DEVICE = "auto"
