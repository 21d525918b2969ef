"""Neuron placements from calibration statistics (flashllm_ext.predictor.placement): the co-activation chain puts
neurons that fire together next to each other, the frequency order puts the most frequent first, both are
permutations, and `flashllm convert --placement` writes a store placed by the predictors' statistics."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashllm_ext import cli
from flashllm_ext.flash.convert import convert
from flashllm_ext.flash.store import FlashStore
from flashllm_ext.predictor import (
    LowRankPredictor,
    PredictorSet,
    coactivation_order,
    frequency_order,
    load_predictors,
    neuron_orders,
    save_predictors,
)
from tests.helpers.models import tiny_model


def test_the_coactivation_chain_keeps_neurons_that_fire_together_adjacent():
    """Three groups interleaved by id (0,3,6,9 / 1,4,7,10 / 2,5,8,11), each firing on its own tokens (6, 2, 4 of
    them): the chain starts in the most frequent group, walks each group before the next, and jumps from a group's
    end to the most frequent group left."""
    tokens = torch.zeros(12, 12, dtype=torch.bool)
    for t in range(12):
        group = 0 if t < 6 else (1 if t < 8 else 2)
        tokens[t, group::3] = True
    order = coactivation_order(tokens)
    groups = (order % 3).tolist()
    assert groups == [0] * 4 + [2] * 4 + [1] * 4
    assert torch.equal(frequency_order(tokens.float().mean(0))[:4], torch.tensor([0, 3, 6, 9]))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.integers(1, 30), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
def test_every_order_is_a_permutation(tokens, neurons, density, seed):
    active = torch.rand(tokens, neurons, generator=torch.Generator().manual_seed(seed)) < density
    for order in (coactivation_order(active), frequency_order(active.float().mean(0))):
        assert torch.equal(order.sort().values, torch.arange(neurons))


def test_bad_sets_are_refused():
    with pytest.raises(ValueError, match="bool"):
        coactivation_order(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="placement must be one of"):
        neuron_orders(PredictorSet([LowRankPredictor(8, 6, 2)], torch.zeros(1)), "random")


@pytest.mark.parametrize("placement", ["frequency", "coactivation"])
def test_convert_places_a_store_by_the_predictors_statistics(tmp_path, placement, capsys):
    model = tiny_model("llama", num_hidden_layers=2)
    model.save_pretrained(tmp_path / "model")
    n, d = model.config.intermediate_size, model.config.hidden_size
    predictors = PredictorSet([LowRankPredictor(d, n, 4) for _ in range(2)], torch.zeros(2))
    predictors.set_density([torch.randn(40, d), torch.randn(40, d)], 0.3)
    save_predictors(predictors, tmp_path / "predictors.safetensors")
    out = tmp_path / "store"
    args = ["convert", str(tmp_path / "model"), str(out), "--placement", placement]
    assert cli.main([*args, "--predictors", str(tmp_path / "predictors.safetensors")]) == 0
    assert f"placed by {placement}" in capsys.readouterr().out
    want = neuron_orders(predictors, placement)
    assert torch.equal(FlashStore(out).neuron_order, want)
    assert torch.equal(load_predictors(out).neuron_order, predictors.neuron_order)  # written in, as they were
    plain = FlashStore(convert(tmp_path / "model", tmp_path / "plain", progress=False))
    assert torch.equal(FlashStore(out).bundle(1, torch.arange(n)), plain.bundle(1, want[1]))
    if placement == "frequency":  # most frequent first
        assert (predictors.frequency[0][want[0]].diff() <= 0).all()
