"""Baseline runner: AllenNLP 2.10.1's ``_ElmoBiLm`` on given weights and sentences (run in its own venv).

Usage (called by embed_throughput.py): python allennlp_embed.py MODEL_DIR SENTENCES.json OUT.npz REPEATS

AllenNLP's top-level package imports transformers, spaCy, cached_path and more at import time; its ELMo
code calls none of them. Instead of installing ~1 GB for imports that are never used, this runner gives
those names empty stand-in modules. Everything ELMo computes runs in AllenNLP's own code.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import sys
import time
import types

BATCH = 64  # ElmoEmbedder's default batch size


class _Unused(types.ModuleType):
    """Stand-in for a package imported at module level by AllenNLP but never called by its ELMo code."""

    __path__: list[str] = []

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(
            name, (), {"__init__": lambda self, *a, **k: None, "__class_getitem__": classmethod(lambda c, i: c)}
        )
        setattr(self, name, value)
        return value


class _UnusedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    NAMES = {
        "transformers",
        "spacy",
        "cached_path",
        "nltk",
        "sentencepiece",
        "tensorboardX",
        "wandb",
        "fairscale",
        "termcolor",
        "jsonnet",
        "_jsonnet",
        "requests",
        "filelock",
        "sklearn",
        "scipy",
        "huggingface_hub",
        "torchvision",
        "boto3",
        "botocore",
        "google",
        "more_itertools",
        "datasets",
        "traitlets",
        "checklist",
    }

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.NAMES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Unused(spec.name)
        if spec.name == "cached_path":  # ELMo resolves its (local) files through it: identity for local paths
            module.cached_path = lambda path, *args, **kwargs: str(path)
        return module

    def exec_module(self, module):
        pass


def main() -> None:
    model_dir, sentences_file, out_file, repeats = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    sys.meta_path.insert(0, _UnusedFinder())
    import numpy as np
    import torch
    from allennlp.modules.elmo import _ElmoBiLm, batch_to_ids
    from allennlp.nn.util import remove_sentence_boundaries

    torch.set_grad_enabled(False)
    sentences = json.loads(open(sentences_file, encoding="utf-8").read())
    bilm = _ElmoBiLm(f"{model_dir}/options.json", f"{model_dir}/weights.hdf5", requires_grad=False)
    bilm.eval()

    def run() -> list[np.ndarray]:
        """As AllenNLP's ElmoEmbedder: batches of 64 in the given order, each from zero state here."""
        vectors = []
        for start in range(0, len(sentences), BATCH):
            batch = sentences[start : start + BATCH]
            bilm._elmo_lstm.reset_states()
            out = bilm(batch_to_ids(batch))  # the char-id mapping is part of the job, as it is for ours
            layers = [remove_sentence_boundaries(layer, out["mask"])[0].numpy() for layer in out["activations"]]
            vectors += [np.stack([layer[i, : len(s)] for layer in layers]) for i, s in enumerate(batch)]
        return vectors

    vectors = run()
    np.savez(out_file, **{f"s{i}": v for i, v in enumerate(vectors)})
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    print(json.dumps({"seconds": sorted(times)[len(times) // 2], "torch": torch.__version__}))


if __name__ == "__main__":
    main()
