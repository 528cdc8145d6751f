"""The MLflow model of a trained biLM ("models from code": MLflow loads this file, nothing is unpickled).

``predict`` takes sentences (strings split on whitespace, or token lists) and returns, per sentence, the
average of the biLM's layers as a nested list (n_tokens x 2P). The bilm-tf files are the model's artifact
``elmo`` (options.json, weights.hdf5, vocab.txt).
"""

from __future__ import annotations

import mlflow.pyfunc
from mlflow.models import set_model


class ElmoPyfunc(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        from elmo_core import BiLM

        self.bilm = BiLM.from_pretrained(context.artifacts["elmo"])

    def predict(self, context, model_input, params=None):
        rows = model_input["sentence"].tolist() if hasattr(model_input, "columns") else list(model_input)
        sentences = [r.split() if isinstance(r, str) else list(r) for r in rows]
        return [v.mean(axis=0).tolist() for v in self.bilm.embed_sentences(sentences)]


set_model(ElmoPyfunc())
