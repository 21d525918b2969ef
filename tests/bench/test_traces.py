"""bench/traces.py: the benchmarks' activation masks (benchmark support, imported from the checkout root)."""

import pytest
import torch

from bench.traces import default_model_masks, predictor_training, tile_layers, tile_masks


def test_tile_masks_concatenates_whole_small_layers():
    small = torch.rand(5, 3, 4) < 0.5
    big = tile_masks(small, n_layers=2, n_neurons=10)
    assert big.shape == (5, 2, 10)
    # large layer 0: small layers 0, 1, 2 (the last cut to 2 neurons); large layer 1: small layers 0, 1, 2 again
    # shifted by 3 blocks -> 0, 1, 2.
    assert torch.equal(big[:, 0, :4], small[:, 0]) and torch.equal(big[:, 0, 4:8], small[:, 1])
    assert torch.equal(big[:, 0, 8:], small[:, 2, :2])
    assert torch.equal(big[:, 1, :4], small[:, (1 * 3) % 3])
    assert abs(big.float().mean() - small.float().mean()) < 0.15


def test_tile_layers_tiles_any_values_as_masks_are_tiled():
    """The predictors' frequencies follow their sets onto the large layers."""
    small = torch.rand(1, 3, 4)
    big = tile_layers(small, 2, 10)
    assert big.dtype == small.dtype and torch.equal(big > 0.5, tile_masks(small > 0.5, 2, 10))


def test_tile_masks_rejects_non_masks():
    with pytest.raises(ValueError, match="bool"):
        tile_masks(torch.zeros(2, 3, 4), 1, 8)


@pytest.mark.slow
def test_default_model_masks_hit_the_target_sparsity():
    masks = default_model_masks(256, target_sparsity=0.9, progress=False)
    assert masks.shape == (256, 30, 1536) and masks.dtype == torch.bool
    # thresholds are calibrated on other text: held-out sparsity lands near, not exactly on, the target
    assert 0.85 < 1 - masks.float().mean() < 0.95


def test_predictor_training_spells_quant_bits():
    assert predictor_training("quant", 0.97) == (
        "--method",
        "quant",
        "--gate-bits",
        "4",
        "--up-bits",
        "4",
        "--density",
        "0.06",
        "--rounding",
        "nearest",
        "--group-size",
        "row",
    )
    assert predictor_training("quant:4/2", 0.9)[2:6] == ("--gate-bits", "4", "--up-bits", "2")
    for bad in ("quant:4", "quant:a/b", "teal"):
        with pytest.raises(ValueError, match="quant:G/U"):
            predictor_training(bad, 0.97)
