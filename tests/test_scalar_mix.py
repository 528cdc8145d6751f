"""ScalarMix against a NumPy transcription of AllenNLP's formula (docs/elmo-format.md §4.6)."""

import numpy as np
import pytest
import torch

from elmo_core import ScalarMix
from elmo_core.bilm.scalar_mix import fixed_mix
from elmo_core.errors import ConfigurationError, InputError


def _reference(
    layers: list[np.ndarray], mask: np.ndarray, w: list[float], gamma: float, layer_norm: bool
) -> np.ndarray:
    s = np.exp(w) / np.exp(w).sum()
    out = np.zeros_like(layers[0], dtype=np.float64)
    for weight, x in zip(s, layers):
        x = x.astype(np.float64)
        if layer_norm:
            values = x[mask.astype(bool)]  # (n_unmasked, dim): one mean/variance over all of them
            x = (x - values.mean()) / np.sqrt(values.var() + 1e-13)
        out += weight * x
    return gamma * out


@pytest.mark.parametrize("layer_norm", [False, True])
def test_matches_reference(layer_norm):
    rng = np.random.default_rng(0)
    layers = [rng.normal(size=(3, 7, 10)).astype(np.float32) * (i + 1) for i in range(3)]
    mask = np.ones((3, 7), dtype=bool)
    mask[1, 4:] = False
    mask[2, 1:] = False
    w, gamma = [0.3, -1.2, 0.5], 1.7
    mix = ScalarMix(3, do_layer_norm=layer_norm, initial_scalar_parameters=w, trainable=False, gamma=gamma)
    got = mix([torch.from_numpy(x) for x in layers], torch.from_numpy(mask)).numpy()
    want = _reference(layers, mask, w, gamma, layer_norm)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_defaults_are_the_plain_average_and_trainable():
    layers = [torch.full((1, 2, 4), float(v)) for v in (1.0, 2.0, 6.0)]
    mix = ScalarMix(3)
    assert torch.allclose(mix(layers), torch.full((1, 2, 4), 3.0))
    assert all(p.requires_grad for p in mix.parameters())


def test_wrong_number_of_layers_names_the_parameter_and_is_a_value_error():
    with pytest.raises(ConfigurationError, match="2 tensors passed to a ScalarMix of size 3") as raised:
        ScalarMix(3)([torch.zeros(1), torch.zeros(1)])
    assert isinstance(raised.value, ValueError)
    with pytest.raises(ValueError, match=r"^ScalarMix: initial_scalar_parameters has 2 values; mixture_size is 3$"):
        ScalarMix(3, initial_scalar_parameters=[0.0, 1.0])
    # a job's option names the option (and its flag)
    with pytest.raises(InputError, match=r"^mix_weights \(--mix-weights\) has 2 values; the model has 3 layers$"):
        fixed_mix(3, [0.0, 1.0])
