"""The biLM itself: its weights on disk, the network, the kernels that run it, and running it over sentences.

    weights     bilm-tf / AllenNLP ``weights.hdf5`` ⇄ state dict (given a config; never builds a model)
    manylangs   ELMoForManyLangs' released folders (``*.pkl`` state dicts, char.dic, word.dic) ⇄ a model folder
    inference   running a biLM over many sentences: batches, the token cache, the stateful carry, the one loop
    lstm_math   TensorFlow's LSTMCell arithmetic, once: the reference the model runs and the kernels match
    kernels/    the CPU's speed kernels, of inference and of training, and the one place that chooses them
    packing     where each token of a batch sits in packed, time-major LSTM data, and back to a layout
    model       char CNN → highway → projection → clipped LSTMs with residual → biLM; what runs each call
    scalar_mix  ELMo's task mix of the layers (AllenNLP's ScalarMix), learned or fixed
    initialization  a fresh biLM's weights as bilm-tf initializes them for training
    softmax     TF's sampled softmax (log-uniform sampler) and the full softmax
    fine_tune   a model made ready for a corpus's vocabulary: a fresh softmax, a ManyLangs model's dictionaries grown

Nothing here reads DuckDB, pyarrow, Prefect or MLflow: ``from elmo_core import BiLM`` loads torch and this package.
"""
