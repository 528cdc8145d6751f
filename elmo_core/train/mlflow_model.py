"""The MLflow model of a trained biLM ("models from code": MLflow loads this file, nothing is unpickled).

``predict`` takes sentences (a ``sentence`` column of whitespace-tokenized strings; called directly, token lists
too) and returns, per sentence, the scalar mix with equal weights (the average of the biLM's layers) as a nested
list (n_tokens x 2P), or with ``params={"pooled": True}`` that mix averaged over the tokens (2P), the vector
``elmo serve`` gives as ``mean``. The signature it is logged with (``tracking.pyfunc_signature``) says so to
``mlflow models serve`` and its clients.
The bilm-tf files are the model's artifact ``elmo`` (options.json, weights.hdf5, vocab.txt).
"""

from __future__ import annotations

import mlflow.pyfunc
from mlflow.models import set_model


class ElmoPyfunc(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        from elmo_core.runtime import Runtime

        self.runtime = Runtime.open(context.artifacts["elmo"])  # as every command runs a model (fp32, exact)

    def predict(self, context, model_input, params=None):
        from elmo_core.runtime import Output

        rows = model_input["sentence"].tolist() if hasattr(model_input, "columns") else list(model_input)
        sentences = [r.split() if isinstance(r, str) else list(r) for r in rows]
        pooled = bool((params or {}).get("pooled", False))
        output = Output.of("mix", "mean" if pooled else "none")  # the plain average of the layers
        return [v.tolist() for v in self.runtime.embed(sentences, output)]


set_model(ElmoPyfunc())
