"""Predictor methods behind one interface (flashllm_ext.predictor.base): save/load through a store,
determinism, shapes checked, the oracle equal to the true sets, selection by a target loaded density, and
FlashFFN serving every method by the one rule; GPTQ rounding of quant's codes and per-layer density allocation."""

import copy

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import flashllm_ext
from flashllm_ext import FormatError
from flashllm_ext.ops import dequantize_rows, unpack_codes
from flashllm_ext.flash.convert import convert, synthesize
from flashllm_ext.hub import perplexity
from flashllm_ext.predictor import (
    DEFAULT_DENSITY,
    DEFAULT_GROUP_SIZE,
    DEFAULT_RECIPE,
    PREDICTOR_METHODS,
    OraclePredictor,
    QuantPredictor,
    TealPredictor,
    activation_score,
    allocate_densities,
    build_predictors,
    calibrate_thresholds,
    capture_activations,
    coactivation_order,
    default_group_size,
    default_rounding,
    ffn_hooks,
    fisher_costs,
    load_predictors,
    operating_point,
    predictors_recipe,
    predictors_recipe_of,
    quantize_rows,
    save_predictors,
    save_predictors_to_store,
    select_density,
)
from flashllm_ext.predictor.base import keep_cutoff
from flashllm_ext.predictor.quant import pack_codes
from tests.helpers.models import tiny_model

METHODS = ["lowrank", "lowrank-reg", "quant", "oracle", "context"]  # neuron methods: the engine serves them
ALL_METHODS = METHODS + ["teal"]  # teal: input sparsity, evaluation only (no store read by input channel)


def _llama(n_layers: int = 3):
    return tiny_model("llama", intermediate_size=96, num_hidden_layers=n_layers, max_position_embeddings=256)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def llama():
    return _llama()


@pytest.fixture(scope="module")
def built(llama):
    """method -> predictors at loaded density 0.4, from 1024 calibration tokens."""
    return {
        m: build_predictors(
            llama, _ids(1024, 0), m, density=0.4, rank=16, epochs=1, block=8, window=256, progress=False
        )
        for m in ALL_METHODS
    }


def test_every_method_is_registered():
    assert set(ALL_METHODS) <= set(PREDICTOR_METHODS)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_statistics_are_each_neurons_share_of_the_calibration_sets_and_their_coactivation_order(
    tmp_path, built, method, monkeypatch
):
    """NeuronPredictor.frequency (what the hot-cold caches pin by): the share of calibration tokens whose predicted
    set holds each neuron, so each layer's mean is its loaded density; neuron_order (what a store can be placed by):
    the co-activation chain of those sets. Both computed from the calibration inputs alone (set_density scores
    nothing else), kept through save/load, and predictors saved without them load as unknown (zeros)."""
    predictors = copy.deepcopy(built[method])
    assert predictors.frequency.shape == predictors.neuron_order.shape == (3, 96)
    torch.testing.assert_close(predictors.frequency.mean(dim=1), torch.full((3,), 0.4), atol=0.02, rtol=0)
    assert all(torch.equal(o.long().sort().values, torch.arange(96)) for o in predictors.neuron_order)
    path = tmp_path / "predictors.safetensors"
    save_predictors(predictors, path)
    assert torch.equal(load_predictors(path).neuron_order, predictors.neuron_order)
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
        kept = {k: f.get_tensor(k) for k in f.keys() if not k.endswith(("frequency", "neuron_order"))}
    save_file(kept, path, metadata)
    old = load_predictors(path)
    assert not old.frequency.any() and not old.neuron_order.any()
    inputs = [torch.randn(50, 64) for _ in range(3)]
    scored, returned = [], []
    monkeypatch.setattr(
        predictors,
        "scores",
        lambda layer, x: scored.append(x) or returned.append(torch.rand(x.shape[0], 96)) or returned[-1],
    )
    cutoffs = predictors.set_density(inputs, 0.25)
    assert isinstance(cutoffs, torch.Tensor) and torch.equal(cutoffs, predictors.cutoffs)
    assert len(scored) == 3 and all(x is i or torch.equal(x, i) for x, i in zip(scored, inputs))
    torch.testing.assert_close(predictors.frequency.mean(dim=1), torch.full((3,), 0.25), atol=0.02, rtol=0)
    for layer, scores in enumerate(returned):
        assert torch.equal(predictors.neuron_order[layer].long(), coactivation_order(scores > cutoffs[layer]))


@pytest.mark.parametrize("method", ALL_METHODS)
def test_round_trip_through_a_store(tmp_path, llama, built, method):
    predictors = built[method]
    store_dir = synthesize(tmp_path / "store", n_layers=3, hidden_size=64, n_neurons=96, glu=True)
    save_predictors_to_store(predictors, store_dir)
    loaded = load_predictors(store_dir)
    if method == "teal":  # it stores thresholds only and computes h from the model's input projections
        with pytest.raises(ValueError, match=r"call \.attach\(model\) after loading"):
            loaded.scores(0, torch.randn(2, 64))
        loaded.attach(llama)
    assert type(loaded) is type(predictors) and loaded.config() == predictors.config()
    for (k, v), (k2, v2) in zip(predictors.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and v.dtype == v2.dtype and torch.equal(v, v2)
    x = torch.randn(9, 64)
    for layer in range(3):
        assert torch.equal(loaded.scores(layer, x), predictors.scores(layer, x))
        assert torch.equal(loaded.predict(layer, x), predictors.predict(layer, x))
    assert loaded.memory_bytes == predictors.memory_bytes > 0


def test_a_store_keeps_the_recipe_of_its_predictors(tmp_path, built):
    store_dir = synthesize(tmp_path / "store", n_layers=3, hidden_size=64, n_neurons=96, glu=True)
    assert predictors_recipe(store_dir) is None and predictors_recipe(tmp_path / "none") is None
    save_predictors_to_store(built["quant"], store_dir, DEFAULT_RECIPE)
    assert predictors_recipe(store_dir) == DEFAULT_RECIPE  # what make demo / bench_e2e check before reusing them
    assert load_predictors(store_dir).config() == built["quant"].config()
    save_predictors_to_store(built["oracle"], store_dir)  # replaced without a recipe: the old one leaves too
    assert predictors_recipe(store_dir) is None


@pytest.mark.parametrize("method", ALL_METHODS)
def test_building_is_deterministic(llama, built, method):
    again = build_predictors(
        llama, _ids(1024, 0), method, density=0.4, rank=16, epochs=1, block=8, window=256, progress=False
    )
    for (k, v), (_, v2) in zip(built[method].state_dict().items(), again.state_dict().items()):
        assert torch.equal(v, v2), k


def test_mismatched_shapes_are_refused(tmp_path, built, llama):
    predictors = built["quant"]
    other = synthesize(tmp_path / "other", n_layers=3, hidden_size=64, n_neurons=80, glu=True)
    with pytest.raises(ValueError, match=r"\(layers, hidden, neurons\) = \(3, 64, 80\)"):
        save_predictors_to_store(predictors, other)
    llama.save_pretrained(tmp_path / "hf")
    path = convert(tmp_path / "hf", tmp_path / "store", dtype="fp32", progress=False)
    wrong = QuantPredictor(3, 64, 80, "silu", True)
    with pytest.raises(ValueError, match="the quant predictors"):
        flashllm_ext.patch_flash(copy.deepcopy(llama), path, mode="flash", predictors=wrong)
    # Tensors that disagree with the metadata, and files of the previous format version.
    file = tmp_path / "p.safetensors"
    save_predictors(predictors, file)
    with safe_open(file, "pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    bad = tmp_path / "bad.safetensors"
    save_file({**tensors, "predictor.layers.0.up_codes": torch.zeros(96, 8, dtype=torch.uint8)}, bad, metadata=metadata)
    with pytest.raises(FormatError, match=r"predictor\.\*: tensors disagree"):
        load_predictors(bad)
    save_file(tensors, bad, metadata={**metadata, "version": "3", "predictors_version": "3"})  # as v3 wrote them
    with pytest.raises(FormatError, match="v'3'"):
        load_predictors(bad)
    save_file(tensors, bad, metadata={**metadata, "predictors": metadata["predictors"].replace("quant", "nope")})
    with pytest.raises(FormatError, match="unknown predictor method 'nope'"):
        load_predictors(bad)


@pytest.mark.parametrize("family", ["llama", "opt"])
@torch.no_grad()
def test_oracle_reproduces_the_true_masks_exactly(family):
    model = (
        _llama() if family == "llama" else tiny_model("opt", vocab_size=128, max_position_embeddings=256, dropout=0.0)
    )
    ids = _ids(96, 3)
    thresholds = calibrate_thresholds(model, ids, 0.6, window=48, progress=False)
    oracle = OraclePredictor.from_model(model, thresholds)
    compared = []

    def check(i, x, h):
        true = activation_score(h) > thresholds[i]
        assert torch.equal(oracle.predict(i, x), true)
        compared.append(true.float().mean().item())

    with ffn_hooks(model, check):
        model(ids.view(2, 48))
    assert len(compared) == len(thresholds) and all(0.2 < c < 0.6 for c in compared)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_quantize_rows(bits):
    w = torch.randn(37, 64)
    codes, scale = quantize_rows(w, bits)
    assert codes.shape == (37, 64 * bits // 8) and scale.dtype == torch.float16
    raw = torch.randint(0, 1 << bits, (5, 13), dtype=torch.uint8)
    packed = pack_codes(raw, bits)
    assert packed.shape == (5, -(-13 * bits // 8)) and torch.equal(unpack_codes(packed, bits, 13), raw)
    # A little-endian bit stream: code k at bits [k * bits, (k + 1) * bits) of the row.
    stream = [(int(packed[0, i // 8]) >> (i % 8)) & 1 for i in range(13 * bits)]
    assert [sum(stream[k * bits + j] << j for j in range(bits)) for k in range(13)] == raw[0].tolist()
    center = ((1 << bits) - 1) / 2
    deq = (unpack_codes(codes, bits, 64).float() - center) * scale.float()[:, None]
    if bits == 1:  # sign and scale
        assert torch.equal(torch.sign(deq), torch.sign(w))
    error = (deq - w).pow(2).mean() / w.pow(2).mean()
    assert error < {1: 0.4, 2: 0.15, 3: 0.04, 4: 0.01}[bits]
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize_rows(w, 5)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_target_density_holds_on_held_out_text(llama, built, method):
    point = operating_point(
        llama, built[method], _ids(512, 9), built[method].true_thresholds, window=128, n_windows=4, progress=False
    )
    assert all(abs(layer["density"] - 0.4) <= 0.02 for layer in point["layers"]), point["layers"]
    if method == "teal":  # the same fraction of input entries and of neurons (TEAL's uniform allocation)
        assert all(
            abs(layer[k] - 0.4) <= 0.02 for layer in point["layers"] for k in ("neuron_density", "input_density")
        )
    else:  # whole neurons: every weight byte of a loaded neuron is read
        assert point["input_density"] == pytest.approx(point["neuron_density"]) == pytest.approx(point["density"])
    if method == "oracle":
        assert point["recall"] > 0.95


@pytest.mark.parametrize("method", METHODS)
@torch.no_grad()
def test_flash_mode_serves_every_method_by_the_rule(tmp_path, llama, built, method):
    """FlashFFN in flash mode scores the perplexity operating_point reports for the same predictors."""
    llama.save_pretrained(tmp_path / "hf")
    path = convert(tmp_path / "hf", tmp_path / "store", dtype="fp32", progress=False)
    ids = _ids(64, 4)
    expected = operating_point(
        llama, built[method], ids, built[method].true_thresholds, window=32, n_windows=2, progress=False
    )["ppl"]
    patched = copy.deepcopy(llama)
    runtime = flashllm_ext.patch_flash(patched, path, mode="flash", predictors=built[method], window=3)
    assert perplexity(patched, ids, 32, 2, progress=False) == pytest.approx(expected, rel=2e-5)
    assert patched.flash.stats()["predictor_bytes"] == built[method].memory_bytes
    runtime.unpatch(patched)


@torch.no_grad()
def test_teal_computes_what_the_model_computes_from_the_kept_inputs(llama, built):
    """h from the kept input entries, through the model's own MLP; loaded rows = |h| above the cut-off; the
    loaded density counts W_gate / W_up columns per kept input channel and W_down rows per kept neuron."""
    teal = built["teal"]
    ids = _ids(64, 5)
    seen = []

    def check(i, x, h):
        used, loaded, inputs = teal.read(i, x, h)
        mlp = llama.model.layers[i].mlp
        sparse_x = x * inputs
        want = mlp.act_fn(mlp.gate_proj(sparse_x)) * mlp.up_proj(sparse_x)
        torch.testing.assert_close(used, want, rtol=1e-5, atol=1e-6)
        assert torch.equal(inputs, x.abs() > teal.input_thresholds[i])
        assert torch.equal(loaded, used.abs() > teal.cutoffs[i])
        assert torch.equal(teal.predict(i, x), loaded)
        seen.append((inputs.float().mean().item(), loaded.float().mean().item()))

    with ffn_hooks(llama, check):
        llama(ids.view(1, 64))
    assert len(seen) == 3 and all(0.2 < a < 0.6 and 0.2 < b < 0.6 for a, b in seen)
    point = operating_point(llama, teal, ids, teal.true_thresholds, window=64, n_windows=1, progress=False)
    for layer in point["layers"]:
        want = 2 / 3 * layer["input_density"] + 1 / 3 * layer["neuron_density"]
        assert layer["density"] == pytest.approx(want)
    # four fp32 thresholds per layer and the neurons' calibration statistics: no predictor weights
    assert teal.memory_bytes == 4 * 4 * 3 + teal.frequency.nbytes + teal.neuron_order.nbytes


def test_teal_is_refused_where_it_cannot_run(tmp_path, llama, built):
    teal = built["teal"]
    llama.save_pretrained(tmp_path / "hf")
    path = convert(tmp_path / "hf", tmp_path / "store", dtype="fp32", progress=False)
    with pytest.raises(ValueError, match="read W_gate / W_up by input channel.*evaluation only"):
        flashllm_ext.patch_flash(copy.deepcopy(llama), path, mode="flash", predictors=teal)
    with pytest.raises(ValueError, match=r"\(layers, hidden, neurons\) = \(2, 64, 96\)"):
        TealPredictor.from_config(teal.config()).attach(_llama(n_layers=2))
    with pytest.raises(ValueError, match="densities must be in"):
        teal.set_density([torch.randn(4, 64)] * 3, 0.0)


def test_context_sets_change_only_every_block(built):
    context = built["context"]
    x = torch.randn(40, 64)
    masks = context.predict(1, x)  # a prompt of 32 tokens (per token), then 8 decoded tokens: one set
    assert masks.shape == (40, 96) and (masks[32:] == masks[32]).all()
    assert int(masks[32].sum()) == round(0.4 * 96)
    decoded = [context.predict(1, torch.randn(1, 64))[0] for _ in range(16)]  # continues the sequence
    assert all(torch.equal(m, decoded[0]) for m in decoded[:8]) and all(torch.equal(m, decoded[8]) for m in decoded[8:])
    # The set of a block comes from the previous block only: teacher forcing sees what decoding sees.
    again = context.predict(1, torch.cat([x, torch.randn(8, 64)]))
    assert torch.equal(again[:40], masks)


@pytest.mark.slow
def test_default_model_target_density_within_002_on_held_out_text(default_model):
    from flashllm_ext.hub import corpus_token_ids, spread_windows

    _, model, tokenizer = default_model
    calibration = spread_windows(corpus_token_ids(tokenizer, "calibration"), 2, 512)
    heldout = spread_windows(corpus_token_ids(tokenizer, "heldout"), 1, 512)
    predictors = build_predictors(model, calibration, progress=False)  # the default method and density
    point = operating_point(
        model, predictors, heldout, predictors.true_thresholds, window=512, n_windows=1, progress=False
    )
    assert abs(point["density"] - DEFAULT_DENSITY) <= 0.02, point["density"]
    # Single layers drift further on 512 tokens (docs/benchmarks/bench_predictor.md: up to 0.03 at density 0.35,
    # 0.012 at 0.7).
    errors = [abs(layer["density"] - DEFAULT_DENSITY) for layer in point["layers"]]
    assert max(errors) <= 0.04, errors


# GPTQ rounding of quant's codes and per-layer density allocation.


def test_gptq_rounding_lowers_the_pre_activation_error_in_the_same_format():
    torch.manual_seed(1)
    # Correlated input channels, as real FFN inputs (uncorrelated ones leave GPTQ nothing to carry the error into).
    x = torch.randn(512, 16) @ torch.randn(16, 64) + 0.1 * torch.randn(512, 64)
    w = torch.randn(48, 64)
    for bits in (2, 3, 4):
        nearest_codes, nearest_scale = quantize_rows(w, bits)
        codes, scale = quantize_rows(w, bits, inputs=x)
        assert codes.shape == nearest_codes.shape and torch.equal(scale, nearest_scale)  # only the codes differ
        assert not torch.equal(codes, nearest_codes)

        def error(c):
            center = ((1 << bits) - 1) / 2
            deq = (unpack_codes(c, bits, 64).float() - center) * scale.float()[:, None]
            return ((x @ (deq - w).T) ** 2).mean().item()

        assert error(codes) < 0.8 * error(nearest_codes), bits
        assert torch.equal(quantize_rows(w, bits, inputs=x)[0], codes)  # deterministic
    with pytest.raises(ValueError, match=r"GPTQ needs calibration inputs \[N, d=64\]"):
        quantize_rows(w, 3, inputs=torch.randn(8, 63))


def assert_round_trip(tmp_path, predictors, recipe: dict) -> None:
    """Saved into a store of the tiny model's shapes with `recipe`, loaded back: the same recipe, config and sets."""
    store_dir = synthesize(tmp_path / "store", n_layers=3, hidden_size=64, n_neurons=96, glu=True)
    save_predictors_to_store(predictors, store_dir, recipe)
    loaded = load_predictors(store_dir)
    assert predictors_recipe(store_dir) == recipe and loaded.config() == predictors.config()
    x = torch.randn(9, 64)
    for layer in range(3):
        assert torch.equal(loaded.predict(layer, x), predictors.predict(layer, x))


def test_gptq_quant_and_fisher_allocation_round_trip_through_a_store(tmp_path, llama):
    ids = _ids(1024, 0)
    predictors = build_predictors(
        llama,
        ids,
        "quant",
        density=0.4,
        gate_bits=3,
        up_bits=4,
        rounding="gptq",
        allocation="fisher",
        window=256,
        progress=False,
    )
    again = build_predictors(
        llama,
        ids,
        "quant",
        density=0.4,
        gate_bits=3,
        up_bits=4,
        rounding="gptq",
        allocation="fisher",
        window=256,
        progress=False,
    )
    for (k, v), (_, v2) in zip(predictors.state_dict().items(), again.state_dict().items()):
        assert torch.equal(v, v2), k  # deterministic
    assert predictors.config()["rounding"] == "gptq"
    recipe = predictors_recipe_of("quant", 0.4, 3, 4, "gptq", "fisher")
    assert recipe == {
        "method": "quant",
        "density": 0.4,
        "statistics": "frequency",
        "gate_bits": 3,
        "up_bits": 4,
        "rounding": "gptq",
        "allocation": "fisher",
    }
    assert_round_trip(tmp_path, predictors, recipe)
    # Predictors saved before the option existed have no "rounding": they were rounded to nearest.
    old = {k: v for k, v in predictors.config().items() if k != "rounding"}
    assert QuantPredictor.from_config(old).rounding == "nearest"
    # The original options leave the recipe as it was, so stores built before the options existed keep theirs (unless
    # they lack the frequencies, "statistics"); the default recipe names its rounding.
    assert predictors_recipe_of("quant", 0.55, 3, 4) == {
        "method": "quant",
        "density": 0.55,
        "statistics": "frequency",
        "gate_bits": 3,
        "up_bits": 4,
    }
    assert (
        predictors_recipe_of(
            DEFAULT_RECIPE["method"],
            DEFAULT_RECIPE["density"],
            DEFAULT_RECIPE["gate_bits"],
            DEFAULT_RECIPE["up_bits"],
            default_rounding(DEFAULT_RECIPE["method"]),
            group_size=DEFAULT_GROUP_SIZE,
        )
        == DEFAULT_RECIPE
    )


def test_group_scales_round_trip_and_fit_better(tmp_path, llama):
    """quant with one scale per 64 columns (d = 64 here is one group; 128 below is two): built deterministically,
    saved and loaded with its recipe, scored by the op; the default group size is the least multiple of 64 >= 192
    dividing d."""
    assert [default_group_size(d) for d in (576, 4096, 960, 768, 2048, 64, 100, 4095)] == [
        192,
        256,
        192,
        192,
        256,
        None,
        None,
        None,
    ]
    torch.manual_seed(2)
    w = torch.randn(32, 128) * torch.linspace(0.1, 3, 128)  # columns of very different ranges: groups pay
    row_codes, row_scale = quantize_rows(w, 3)
    codes, scale = quantize_rows(w, 3, group_size=64)
    assert scale.shape == (32, 2) and codes.shape == row_codes.shape
    assert ((dequantize_rows(codes, scale, 3, 128) - w) ** 2).sum() < (
        (dequantize_rows(row_codes, row_scale, 3, 128) - w) ** 2
    ).sum()
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 64 dividing d=128"):
        quantize_rows(w, 3, group_size=96)
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 64 dividing d=64"):
        QuantPredictor(3, 64, 96, "silu", True, group_size=128)
    with pytest.raises(ValueError, match="group_size is an option of quant"):
        build_predictors(llama, _ids(256, 0), "oracle", density=0.4, group_size=64, window=256, progress=False)

    ids = _ids(1024, 0)
    predictors = build_predictors(
        llama,
        ids,
        "quant",
        density=0.4,
        gate_bits=3,
        up_bits=4,
        rounding="gptq",
        group_size=64,
        window=256,
        progress=False,
    )
    again = build_predictors(
        llama,
        ids,
        "quant",
        density=0.4,
        gate_bits=3,
        up_bits=4,
        rounding="gptq",
        group_size=64,
        window=256,
        progress=False,
    )
    for (k, v), (_, v2) in zip(predictors.state_dict().items(), again.state_dict().items()):
        assert torch.equal(v, v2), k  # deterministic
    assert predictors.config()["group_size"] == 64 and predictors.layers[0].up_scale.shape == (96, 1)
    recipe = predictors_recipe_of("quant", 0.4, 3, 4, "gptq", group_size=64)
    assert recipe == {
        "method": "quant",
        "density": 0.4,
        "statistics": "frequency",
        "gate_bits": 3,
        "up_bits": 4,
        "rounding": "gptq",
        "group_size": 64,
    }
    assert_round_trip(tmp_path, predictors, recipe)
    # Predictors saved before groups existed have no "group_size": one scale per row.
    old = {k: v for k, v in predictors.config().items() if k != "group_size"}
    assert QuantPredictor.from_config(old).group_size is None


def test_gptq_and_allocation_refuse_bad_options(llama):
    with pytest.raises(ValueError, match="rounding must be one of"):
        QuantPredictor(3, 64, 96, "silu", True, rounding="stochastic")
    with pytest.raises(ValueError, match="rounding 'gptq' needs calibration inputs for each of the 3 layers"):
        QuantPredictor.from_model(llama, 3, 4, rounding="gptq", inputs=[torch.randn(8, 64)])
    with pytest.raises(ValueError, match="rounding 'gptq' is an option of quant"):
        build_predictors(llama, _ids(256, 0), "oracle", density=0.4, rounding="gptq", window=256, progress=False)
    with pytest.raises(ValueError, match="allocation must be one of"):
        build_predictors(llama, _ids(256, 0), "quant", density=0.4, allocation="owl", window=256, progress=False)
    with pytest.raises(ValueError, match="spreads one target density"):
        build_predictors(
            llama, _ids(256, 0), "quant", density=[0.4, 0.5, 0.6], allocation="fisher", window=256, progress=False
        )


@pytest.fixture(scope="module")
def calibration(llama):
    ids = _ids(1024, 0)
    thresholds = calibrate_thresholds(llama, ids, 0.6, window=256, progress=False)
    return ids, capture_activations(llama, ids, thresholds, window=256, progress=False).inputs


def test_fisher_allocation_keeps_the_mean_and_holds_on_held_out_text(llama, calibration):
    """A layer whose dropped neurons cost more (its W_down scaled up) gets more density; the mean stays."""
    model = copy.deepcopy(llama)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(8.0)
    ids = calibration[0]
    thresholds = calibrate_thresholds(model, ids, 0.6, window=256, progress=False)
    inputs = capture_activations(model, ids, thresholds, window=256, progress=False).inputs
    oracle = OraclePredictor.from_model(model, thresholds)
    densities = allocate_densities(model, oracle, ids, inputs, 0.4, "fisher", step=0.05, window=256, progress=False)
    assert densities.mean().item() == pytest.approx(0.4, abs=0.05 / 3 / 2)
    assert ((densities >= 0.05) & (densities <= 1.0)).all() and densities[1] > max(densities[0], densities[2])
    assert torch.equal(
        allocate_densities(model, oracle, ids, inputs, 0.4, "fisher", step=0.05, window=256, progress=False), densities
    )
    assert torch.equal(allocate_densities(model, oracle, ids, inputs, 0.4), torch.full((3,), 0.4, dtype=torch.float64))
    predictors = copy.deepcopy(oracle)
    select_density(model, predictors, inputs, ids, densities.tolist(), window=256, progress=False)
    point = operating_point(
        model, predictors, _ids(512, 9), predictors.true_thresholds, window=128, n_windows=4, progress=False
    )
    assert all(abs(layer["density"] - r) <= 0.02 for layer, r in zip(point["layers"], densities.tolist()))
    assert point["recall"] > 0.95  # the oracle at its own per-layer densities: true_thresholds follow them
    with pytest.raises(ValueError, match="min_density <= density"):
        allocate_densities(model, oracle, ids, inputs, 0.4, "fisher", min_density=0.5)


def test_fisher_costs_are_the_squared_first_order_loss_changes(llama, built, calibration):
    """Against a direct computation for one layer: autograd's gradient at the FFN output, dotted with the change
    W_down (h * unloaded) of that output, squared and summed over tokens."""
    ids, inputs = calibration
    quant, layer, density = built["quant"], 1, 0.6
    costs = fisher_costs(llama, quant, ids, inputs, [1.0, density], window=256, progress=False)
    assert (costs[:, 0] == 0).all() and (costs[:, 1] > 0).all()
    cutoff = keep_cutoff(quant.scores(layer, inputs[layer].float()), density)
    down = llama.model.layers[layer].mlp.down_proj
    want = 0.0
    for window in ids.view(4, 256):
        seen = {}
        handle = down.register_forward_hook(lambda m, a, out: seen.__setitem__("out", out))

        def keep(i, x, h):
            if i == layer:
                seen["x"], seen["h"] = x.detach(), h.detach()

        with ffn_hooks(llama, keep), torch.enable_grad():
            logits = llama(window.unsqueeze(0)).logits[0]
            loss = torch.nn.functional.cross_entropy(logits[:-1], window[1:], reduction="sum")
            g = torch.autograd.grad(loss, seen["out"])[0].reshape(-1, 64)
        handle.remove()
        unloaded = quant.scores(layer, seen["x"]) <= cutoff
        delta = (seen["h"] * unloaded) @ down.weight.detach().T
        want += ((g * delta).sum(1).double() ** 2).sum().item()
    assert costs[layer, 1].item() == pytest.approx(want, rel=1e-4)


def test_cli_builds_gptq_quant_with_fisher_allocation_into_a_store(tmp_path, monkeypatch, capsys):
    import flashllm_ext.io.gguf_layout
    import flashllm_ext.hub
    from flashllm_ext import cli

    model = tiny_model("llama", intermediate_size=96, num_hidden_layers=3, max_position_embeddings=512)
    monkeypatch.setattr(flashllm_ext.hub, "load_hf_model", lambda path: (model, None))
    monkeypatch.setattr(flashllm_ext.hub, "corpus_token_ids", lambda tokenizer, split: _ids(2048, 0))
    # Never read: the model comes from the patched loader, and the header check before any work is patched too.
    monkeypatch.setattr(flashllm_ext.io.gguf_layout, "gguf_config", lambda path: {})
    checkpoint = tmp_path / "tiny.gguf"
    checkpoint.write_bytes(b"GGUF")
    store_dir = synthesize(tmp_path / "store", n_layers=3, hidden_size=64, n_neurons=96, glu=True)
    cli.main(
        [
            "train-predictors",
            str(checkpoint),
            "--store",
            str(store_dir),
            "--tokens",
            "512",
            "--method",
            "quant",
            "--gate-bits",
            "3",
            "--up-bits",
            "4",
            "--rounding",
            "gptq",
            "--allocation",
            "fisher",
            "--density",
            "0.5",
            "--group-size",
            "64",
        ]
    )
    assert "wrote 3 quant predictors" in capsys.readouterr().out
    assert predictors_recipe(store_dir) == predictors_recipe_of("quant", 0.5, 3, 4, "gptq", "fisher", 64)
    assert load_predictors(store_dir).rounding == "gptq" and load_predictors(store_dir).group_size == 64
    for bad in (["--rounding", "stochastic"], ["--group-size", "100"]):
        with pytest.raises(SystemExit):
            cli.main(["train-predictors", str(checkpoint), *bad])
