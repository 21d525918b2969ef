"""Placed stores (flashllm_ext.flash.convert's neuron_order, flashllm_ext.flash.placement): each neuron's bundle and
input bias in its row, the order validated on write and on open, and a placed store computing what the unplaced one
does in exact, hot-cold and flash mode, the predictors' sets mapped onto rows."""

import json

import pytest
import torch

import flashllm_ext
from flashllm_ext.decoder import load_decoder
from flashllm_ext.errors import FormatError
from flashllm_ext.flash.convert import convert
from flashllm_ext.flash.hot_cold import hot_ids
from flashllm_ext.flash.placement import StoreOrderPredictors
from flashllm_ext.flash.store import BUNDLES_FILE, FlashStore
from flashllm_ext.predictor import LowRankPredictor, PredictorSet, calibrate_thresholds
from tests.helpers.checkpoints import rewrite_header
from tests.helpers.models import tiny_model


def _orders(n_layers: int, n: int, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n, generator=g) for _ in range(n_layers)])


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """name -> (model, unplaced fp32 store, the same placed by a random order, that order)."""
    root = tmp_path_factory.mktemp("placement")
    out = {}
    for name, model in (
        ("llama", tiny_model("llama", num_hidden_layers=3, max_position_embeddings=256)),
        ("opt", tiny_model("opt", seed=1, max_position_embeddings=256, dropout=0.0)),
    ):
        model.save_pretrained(root / name)
        plain = convert(root / name, root / f"{name}-plain", dtype="fp32", progress=False)
        s = FlashStore(plain)
        order = _orders(s.n_layers, s.n_neurons)
        placed = convert(root / name, root / f"{name}-placed", dtype="fp32", progress=False, neuron_order=order)
        out[name] = (model, plain, placed, order)
    return out


@pytest.mark.parametrize("name", ["llama", "opt"])
def test_a_placed_store_holds_each_neuron_and_its_input_bias_in_its_row(stores, name):
    _, plain, placed, order = stores[name]
    a, b = FlashStore(plain), FlashStore(placed)
    assert a.neuron_order is None and torch.equal(b.neuron_order, order) and "placed" in repr(b)
    for layer in range(a.n_layers):
        rows = torch.arange(a.n_neurons)
        assert torch.equal(b.bundle(layer, rows), a.bundle(layer, order[layer]))
        for role in ("up_bias", "down_bias"):
            want = a.layer_bias(layer, role)
            if want is not None:  # OPT: fc1's per neuron (reordered), fc2's per output channel (as it is)
                want = want[order[layer]] if role == "up_bias" else want
                assert torch.equal(b.layer_bias(layer, role), want)
    assert (name == "opt") == (a.layer_bias(0, "up_bias") is not None)


def _predictors(model, s: FlashStore) -> PredictorSet:
    ids = torch.randint(0, 100, (64,), generator=torch.Generator().manual_seed(0))
    thresholds = calibrate_thresholds(model, ids, 0.5, window=32, progress=False)
    torch.manual_seed(0)
    predictors = PredictorSet([LowRankPredictor(s.hidden_size, s.n_neurons, 8) for _ in range(s.n_layers)], thresholds)
    predictors.prob_thresholds.fill_(0.45)
    predictors.frequency.copy_(torch.rand(predictors.frequency.shape, generator=torch.Generator().manual_seed(1)))
    return predictors


@pytest.mark.parametrize("name", ["llama", "opt"])
@pytest.mark.parametrize(
    "mode, layout", [("exact", "per-layer"), ("exact", "hot-cold"), ("flash", "per-layer"), ("flash", "hot-cold")]
)
@torch.no_grad()
def test_a_placed_store_computes_what_the_unplaced_one_does(stores, name, mode, layout):
    """The same logits and greedy tokens from both stores: in flash mode the predictors (trained in the model's
    order) choose the same neurons, which the placed store finds in other rows; and the hot-cold caches pin the
    same neurons."""
    model, plain, placed, order = stores[name]
    s = FlashStore(plain)
    predictors = _predictors(model, s) if mode == "flash" else None
    prompt = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    got = {}
    for path in (plain, placed):
        flash = flashllm_ext.load_flash(path, dram_budget="85%", mode=mode, predictors=predictors, cache_layout=layout)
        logits = flash(prompt).logits
        tokens = flash.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        pinned = [
            m.cache.partition(torch.arange(s.n_neurons))[0] if m.cache.n_pinned else None for m in flash.flash.modules
        ]
        got[path] = (logits, tokens, flash.flash.stats(), pinned)
    (want_logits, want_tokens, want_stats, want_pins), (logits, tokens, stats, pins) = got[plain], got[placed]
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(tokens, want_tokens)
    if mode == "exact":  # (flash mode's budget also holds the placed store's two index maps: fewer rows)
        assert stats["hot_fraction"] == want_stats["hot_fraction"]
    if mode == "flash" and layout == "hot-cold":  # each pins the most frequent neurons its rows allow, in their rows
        for layer, (want, pinned) in enumerate(zip(want_pins, pins)):
            frequency = predictors.frequency[layer]
            assert torch.equal(want, hot_ids(frequency, len(want)))
            assert torch.equal(order[layer][pinned].sort().values, hot_ids(frequency, len(pinned)))


@pytest.mark.parametrize("name", ["llama", "opt"])
@pytest.mark.parametrize("mode", ["dense", "hybrid", "exact", "flash"])
@torch.no_grad()
def test_the_lean_decoder_on_a_placed_store_computes_what_it_does_on_the_unplaced_one(stores, name, mode):
    """`flashllm run`'s path: dense mode loads the placed rows and biases as they lie, the other modes read them,
    flash mode's predictors choose the same neurons (with look-ahead too)."""
    model, plain, placed, _ = stores[name]
    predictors = _predictors(model, FlashStore(plain)) if mode == "flash" else None
    prompt = torch.randint(3, 90, (9,), generator=torch.Generator().manual_seed(4))
    got = []
    for path in (plain, placed):
        budget = {"dense": None, "hybrid": "120%"}.get(mode, "85%")  # (hybrid's minimum on OPT: ~108%)
        lookahead = "ahead" if mode == "flash" else None
        decoder = load_decoder(
            path, budget, mode=mode, max_len=32, kv_dtype=torch.float32, predictors=predictors, lookahead=lookahead
        )
        got.append(torch.cat([decoder.forward(prompt, all_logits=True), decoder.forward([5])[None]]))
        decoder.close()
    torch.testing.assert_close(got[1], got[0], rtol=1e-4, atol=1e-4)


def test_store_order_predictors_map_every_kind_of_answer_onto_rows():
    order = torch.tensor([[2, 0, 3, 1]])
    inner = type("P", (), {"predict": lambda self, layer, x: x > 0, "frequency": torch.tensor([[0.1, 0.2, 0.3, 0.4]])})
    wrapped = StoreOrderPredictors(inner(), order)
    mask = torch.tensor([[True, False, False, True]])  # neurons 0 and 3: rows 1 and 2
    assert torch.equal(wrapped.predict(0, mask.float()), torch.tensor([[False, True, True, False]]))
    assert torch.equal(wrapped.to_rows(0, torch.tensor([0, 3])), torch.tensor([1, 2]))
    assert torch.equal(wrapped.to_rows(0, mask[0]), torch.tensor([False, True, True, False]))
    assert torch.equal(wrapped.frequency, torch.tensor([[0.3, 0.1, 0.4, 0.2]]))
    assert not hasattr(wrapped, "predict_ahead")


def test_convert_refuses_an_order_that_is_no_permutation(stores, tmp_path):
    model, plain, _, order = stores["llama"]
    bad = order.clone()
    bad[1, 0] = bad[1, 1]
    for wrong, match in ((bad, "layer 1 is not a permutation"), (order[:2], "shape")):
        with pytest.raises(ValueError, match=match):
            convert(FlashStore(plain).path.parent / "llama", tmp_path / "out", progress=False, neuron_order=wrong)
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "value, match",
    [("[[0, 1]]", "shape"), ("not json", "not JSON"), ('"x"', "list of per-layer lists"), (None, "not a permutation")],
)
def test_a_store_with_a_bad_neuron_order_is_refused_naming_the_field(stores, tmp_path, value, match):
    import shutil

    _, _, placed, order = stores["llama"]
    copy = tmp_path / "store"
    shutil.copytree(placed, copy)
    if value is None:
        bad = order.clone()
        bad[2, 3] = bad[2, 4]
        value = json.dumps(bad.tolist())

    def mutate(header):
        header["__metadata__"]["neuron_order"] = value

    rewrite_header(copy / BUNDLES_FILE, mutate)
    with pytest.raises(FormatError, match=f"neuron_order.*{match}"):
        FlashStore(copy)
