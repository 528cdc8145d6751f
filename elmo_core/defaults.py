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

# layer-0 vectors a process keeps (the runtime's ``WordCache``, the torch-free server's ``OnnxWords``): 524k words of
# the small shape, 131k of the original. 64 MiB (32k words of the original) thrashed on a corpus of 45k distinct
# words: bench/manylangs.py's 16,384 sentences in int8 ran at 2,736 tok/s with it, 2,876 with this. Memory is taken
# only as words are seen.
WORD_CACHE_BYTES = 256 << 20
