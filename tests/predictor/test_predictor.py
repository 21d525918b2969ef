import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from flashllm_ext import FormatError, cli
from flashllm_ext.predictor import (
    LowRankPredictor,
    PredictorSet,
    activation_score,
    auto_rank,
    calibrate_thresholds,
    capture_activations,
    choose_prob_thresholds,
    evaluate,
    ffn_hooks,
    ffn_modules,
    load_predictors,
    patched_ffn,
    save_predictors,
    save_predictors_to_store,
    train_predictor,
)
from tests.helpers.faults import refuses_without_blocking
from tests.helpers.models import tiny_model

LLAMA = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
OPT = dict(
    hidden_size=64,
    ffn_dim=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=128,
    max_position_embeddings=256,
    word_embed_proj_dim=64,
    dropout=0.0,
)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", **LLAMA)


@pytest.fixture(scope="module")
def opt():
    return tiny_model("opt", **OPT)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed))


def _predictor_set(model, n_layers: int, d: int, n: int, thresholds: torch.Tensor, **kwargs) -> PredictorSet:
    torch.manual_seed(1)
    return PredictorSet([LowRankPredictor(d, n, 16) for _ in range(n_layers)], thresholds, **kwargs)


# --------------------------------------------------------------------------------------------------- capture


def test_capture_matches_manual_forward_llama(llama):
    ids = _ids(40, 1)
    thresholds = torch.tensor([0.01, 0.02, 0.03])
    cap = capture_activations(llama, ids, thresholds, window=16, keep_scores=[1], progress=False)
    with torch.no_grad():
        hidden = llama(ids.unsqueeze(0), output_hidden_states=True).hidden_states
    # Windows of 16 tokens are scored independently: rebuild the hidden states window by window.
    with torch.no_grad():
        hidden = [
            torch.cat([llama(w.unsqueeze(0), output_hidden_states=True).hidden_states[i][0] for w in ids.split(16)])
            for i in range(len(hidden))
        ]
    for i, layer in enumerate(llama.model.layers):
        # The captured input is the FFN's own input: the residual stream after post_attention_layernorm.
        xn = cap.inputs[i].float()
        assert cap.inputs[i].dtype == torch.float16 and xn.shape == (40, 64)
        with torch.no_grad():
            residual = hidden[i + 1] - layer.mlp(xn) if i + 1 < len(llama.model.layers) else None
            if residual is not None:  # the last hidden state has the final norm applied
                assert torch.allclose(layer.post_attention_layernorm(residual), xn, atol=2e-2)
            score = (F.silu(layer.mlp.gate_proj(xn)) * layer.mlp.up_proj(xn)).abs()
        expected = score > thresholds[i]
        # x went through fp16, so a score within rounding of the threshold may flip; nothing else may differ.
        borderline = (score - thresholds[i]).abs() < 2e-3
        assert torch.equal(cap.mask(i)[~borderline], expected[~borderline])
        assert cap.bitmaps[i].dtype == torch.uint8 and cap.bitmaps[i].shape == (40, 12)
    # The score is the rule's: |act(gate) * up|, what the down projection multiplies.
    layer = llama.model.layers[1]
    with torch.no_grad():
        xn = cap.inputs[1].float()
        score = (F.silu(layer.mlp.gate_proj(xn)) * layer.mlp.up_proj(xn)).abs()
    assert torch.allclose(cap.scores[1], score, atol=2e-3)
    assert set(cap.scores) == {1}


def test_capture_lookahead_inputs_are_the_normed_layer_inputs(llama):
    """lookahead=True: the inputs are post_attention_layernorm(the decoder layer's input), the sets the true ones."""
    ids = _ids(24, 2)
    thresholds = torch.tensor([0.01, 0.02, 0.03])
    ffn = capture_activations(llama, ids, thresholds, window=24, progress=False)
    ahead = capture_activations(llama, ids, thresholds, window=24, progress=False, lookahead=True)
    with torch.no_grad():
        hidden = llama(ids.unsqueeze(0), output_hidden_states=True).hidden_states
    for i, layer in enumerate(llama.model.layers):
        with torch.no_grad():
            want = layer.post_attention_layernorm(hidden[i][0]).half()
        torch.testing.assert_close(ahead.inputs[i], want, rtol=2e-3, atol=2e-3)
        assert not torch.allclose(ahead.inputs[i], ffn.inputs[i], atol=1e-2)  # attention moved the FFN input
        assert torch.equal(ahead.bitmaps[i], ffn.bitmaps[i])
    assert not any(layer._forward_pre_hooks for layer in llama.model.layers)


def test_opt_relu_exact_zeros(opt):
    ids = _ids(32, 3)
    thresholds = calibrate_thresholds(opt, ids, 0.2, window=32, progress=False)
    assert torch.equal(thresholds, torch.zeros(2))  # natural ReLU sparsity (~50%) exceeds 20%
    cap = capture_activations(opt, ids, thresholds, window=32, progress=False)
    for i, layer in enumerate(opt.model.decoder.layers):
        with torch.no_grad():
            h = F.relu(layer.fc1(layer.final_layer_norm(cap.inputs[i].float())))
        borderline = h.abs() < 2e-3
        assert torch.equal(cap.mask(i)[~borderline], (h > 0)[~borderline])
        assert 0.2 < cap.density(i) < 0.8
    # Zeroing what is already zero changes nothing: the patched model's logits are the dense ones.
    with torch.no_grad():
        dense = opt(ids.unsqueeze(0)).logits
        with patched_ffn(opt, thresholds) as counter:
            patched = opt(ids.unsqueeze(0)).logits
    assert torch.equal(dense, patched) and 0.2 < counter.sparsity < 0.8


# ------------------------------------------------------------------------------------------------ thresholds


def test_thresholds_hit_target_on_held_out_tokens(llama):
    targets = [0.5, 0.7, 0.9]
    thresholds = calibrate_thresholds(llama, _ids(512, 4), targets, window=128, progress=False)
    for target in targets:
        assert thresholds[target].shape == (3,) and (thresholds[target] > 0).all()
        with torch.no_grad(), patched_ffn(llama, thresholds[target]) as counter:
            llama(_ids(256, 5).unsqueeze(0))
        assert abs(counter.sparsity - target) <= 0.02, (target, counter.sparsity)
    assert (thresholds[0.5] < thresholds[0.7]).all() and (thresholds[0.7] < thresholds[0.9]).all()


def test_patched_ffn_zeroes_inactive_neurons(llama):
    ids = _ids(16, 6)
    seen = {}

    def record(i, x, h):
        seen[i] = h.clone()

    thresholds = calibrate_thresholds(llama, ids, 0.6, window=16, progress=False)
    with patched_ffn(llama, thresholds), ffn_hooks(llama, record):
        with torch.no_grad():
            llama(ids.unsqueeze(0))
    # `record` runs after the patch's hook: it sees what the down projection reads.
    for i in range(3):
        kept = seen[i] != 0
        assert abs(kept.float().mean().item() - 0.4) < 0.02
        assert (seen[i][kept].abs() > thresholds[i]).all()


def test_bad_inputs_raise_clear_errors(llama):
    with pytest.raises(ValueError, match="one per layer"):
        capture_activations(llama, _ids(8, 0), torch.zeros(2), progress=False)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        calibrate_thresholds(llama, _ids(8, 0), 1.5)
    with pytest.raises(ValueError, match="1-D"):
        calibrate_thresholds(llama, _ids(8, 0).view(2, 4), 0.5, progress=False)
    with pytest.raises(ValueError, match="not a Llama-family"):
        ffn_modules(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="same N"):
        train_predictor(torch.zeros(4, 8), torch.zeros(5, 3, dtype=torch.bool), 2)
    two_layers = _predictor_set(llama, 2, 64, 96, torch.zeros(2))
    with pytest.raises(ValueError, match="predictors cover 2"):
        with patched_ffn(llama, torch.zeros(3), predictors=two_layers):
            pass
    with pytest.raises(ValueError, match="one threshold per predictor"):
        _predictor_set(llama, 2, 64, 96, torch.zeros(3))


def test_hooks_removed_on_error(llama):
    def count() -> int:
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in llama.modules())

    with torch.no_grad():
        llama(_ids(4, 0).unsqueeze(0))  # transformers installs its own hooks lazily on the first call
    before = count()

    def boom(i, x, h):
        raise KeyError("boom")

    with pytest.raises(KeyError), ffn_hooks(llama, boom), torch.no_grad():
        llama(_ids(4, 0).unsqueeze(0))
    assert count() == before


# ------------------------------------------------------------------------------------------------ predictors


def _low_rank_rule(n: int, d: int = 48, n_neurons: int = 64, rank: int = 4, density: float = 0.25, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(n_neurons, rank, generator=g), torch.randn(rank, d, generator=g)
    x = torch.randn(n, d, generator=g)
    pre = (x / x.pow(2).mean(-1, keepdim=True).sqrt()) @ (a @ b).T
    return x, pre > torch.quantile(pre[:2000], 1 - density, dim=0)


def test_predictor_learns_a_known_low_rank_rule():
    x, mask = _low_rank_rule(6000)
    predictor = train_predictor(x[:5000], mask[:5000], rank=4, epochs=20, seed=0)
    with torch.no_grad():
        predicted = torch.sigmoid(predictor(x[5000:])) > 0.5
    true = mask[5000:]
    recall = (predicted & true).sum() / true.sum()
    assert recall >= 0.99, recall
    assert predicted.float().mean() <= 1.5 * true.float().mean()  # not recall by predicting everything


def test_choose_prob_thresholds_reaches_recall():
    x, mask = _low_rank_rule(3000, seed=1)
    predictor = train_predictor(x[:2000], mask[:2000], rank=2, epochs=2, seed=0)  # deliberately weak
    probs = choose_prob_thresholds([predictor], [x[2000:]], [mask[2000:]], recall=0.97)
    with torch.no_grad():
        predicted = torch.sigmoid(predictor(x[2000:])) > probs[0]
    true = mask[2000:]
    assert (predicted & true).sum() / true.sum() >= 0.97


def test_top_k_predicts_k_per_token(llama):
    predictors = _predictor_set(llama, 3, 64, 96, torch.zeros(3), top_k=10)
    assert (predictors.predict(0, torch.randn(7, 64)).sum(dim=1) == 10).all()


def test_auto_rank_grows_with_density():
    ranks = [auto_rank(d, 576) for d in (0.05, 0.3, 0.6, 0.9)]
    assert ranks == sorted(ranks) and ranks[1] == 64 and all(r % 16 == 0 and 16 <= r <= 288 for r in ranks)


def test_save_load_round_trip(tmp_path, llama):
    predictors = _predictor_set(
        llama, 3, 64, 96, torch.tensor([0.1, 0.2, 0.3]), prob_thresholds=torch.tensor([0.4, 0.5, 0.6])
    )
    save_predictors(predictors, tmp_path / "p.safetensors")
    loaded = load_predictors(tmp_path / "p.safetensors")
    assert loaded.top_k is None
    for (k, v), (k2, v2) in zip(predictors.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    x = torch.randn(5, 64)
    assert torch.equal(predictors.predict(2, x), loaded.predict(2, x))


def test_save_to_store_keeps_the_store_valid(tmp_path, llama):
    from flashllm_ext.flash.convert import synthesize
    from flashllm_ext.flash.store import FlashStore

    store_dir = synthesize(tmp_path / "store", n_layers=3, hidden_size=64, n_neurons=96, glu=True)
    predictors = _predictor_set(llama, 3, 64, 96, torch.tensor([0.1, 0.2, 0.3]), top_k=5)
    save_predictors_to_store(predictors, store_dir)
    save_predictors_to_store(predictors, store_dir)  # replacing them keeps one copy
    loaded = load_predictors(store_dir)
    assert loaded.top_k == 5 and torch.equal(loaded.thresholds, predictors.thresholds)
    x = torch.randn(4, 64)
    assert torch.equal(loaded.predict(1, x), predictors.predict(1, x))
    store = FlashStore(store_dir)
    assert store.n_layers == 3 and all(k.startswith("predictor.") for k in store.resident())
    with pytest.raises(ValueError, match="predictors"):
        save_predictors_to_store(_predictor_set(llama, 2, 64, 96, torch.zeros(2)), store_dir)
    with pytest.raises(FormatError):
        load_predictors(synthesize(tmp_path / "bare", n_layers=1, hidden_size=64, n_neurons=96))


def test_save_to_store_never_writes_through_a_planted_link(tmp_path, llama):
    """The predictors go to a temporary file beside the resident file: a link planted at its name is refused, not
    followed, and its target keeps its bytes."""
    from flashllm_ext.flash.convert import synthesize

    store_dir = synthesize(tmp_path / "store", n_layers=2, hidden_size=64, n_neurons=96, glu=True)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (store_dir / "resident.safetensors.partial").symlink_to(victim)
    with pytest.raises(OSError):
        save_predictors_to_store(_predictor_set(llama, 2, 64, 96, torch.zeros(2)), store_dir)
    assert victim.read_text() == "precious"


def test_load_rejects_malformed_files(tmp_path, llama):
    path = tmp_path / "p.safetensors"
    save_predictors(_predictor_set(llama, 2, 64, 96, torch.zeros(2)), path)
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = load_file(path)
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, bad, metadata={**metadata, "format": "other", "predictors_version": "0"})
    with pytest.raises(FormatError, match="bad.safetensors: __metadata__.format"):
        load_predictors(bad)
    save_file({k: v for k, v in tensors.items() if k != "predictor.predictors.1.up.weight"}, bad, metadata=metadata)
    with pytest.raises(FormatError, match=r"predictor\.\*"):
        load_predictors(bad)
    save_file({k: v for k, v in tensors.items() if k != "predictor.thresholds"}, bad, metadata=metadata)
    with pytest.raises(FormatError, match=r"predictor\.\*: tensors disagree.*thresholds"):
        load_predictors(bad)
    save_file(tensors, bad, metadata={**metadata, "predictors": "{not json"})
    with pytest.raises(FormatError, match="__metadata__.predictors"):
        load_predictors(bad)
    bad.write_bytes(b"\x00" * 7)
    with pytest.raises(FormatError, match="header"):
        load_predictors(bad)


# ------------------------------------------------------------------------------------------------- evaluation


def test_evaluate_predict_all_equals_threshold_only(llama):
    ids = _ids(64, 7)
    thresholds = calibrate_thresholds(llama, _ids(256, 8), 0.7, window=64, progress=False)
    everything = _predictor_set(llama, 3, 64, 96, thresholds, prob_thresholds=torch.full((3,), -1.0))
    result = evaluate(llama, everything, ids, window=32, n_windows=2, progress=False)
    assert len(result["layers"]) == 3
    for layer in result["layers"]:
        assert layer["recall"] == 1.0 and layer["density"] == 1.0 and layer["fn_mass"] == 0.0
        assert layer["precision"] == pytest.approx(layer["true_density"]) and 0.15 < layer["true_density"] < 0.45
    assert result["ppl_predictor"] == result["ppl_threshold"] and math.isfinite(result["ppl_dense"])
    assert result["sparsity"] == result["sparsity_threshold"]


def test_evaluate_counts_missed_neurons(llama):
    ids = _ids(64, 9)
    thresholds = calibrate_thresholds(llama, _ids(256, 8), 0.7, window=64, progress=False)
    nothing = _predictor_set(llama, 3, 64, 96, thresholds, prob_thresholds=torch.full((3,), 2.0))
    result = evaluate(llama, nothing, ids, window=32, n_windows=2, progress=False)
    for layer in result["layers"]:
        assert layer["recall"] == 0.0 and layer["density"] == 0.0 and layer["fn_mass"] == pytest.approx(1.0)
    assert result["sparsity"] == 1.0 and result["ppl_predictor"] != result["ppl_dense"]


def test_cli_rejects_missing_checkpoint(tmp_path):
    with pytest.raises(SystemExit, match="not a GGUF file"):
        cli.main(["train-predictors", str(tmp_path / "missing.gguf")])
    with pytest.raises(SystemExit):
        cli.main(["train-predictors", "default", "--rank", "0"])


@pytest.mark.slow
def test_default_model_thresholds_hit_target_on_held_out_text(default_model):
    from flashllm_ext.hub import corpus_token_ids, spread_windows

    _, model, tokenizer = default_model
    calibration = spread_windows(corpus_token_ids(tokenizer, "calibration"), 4, 512)
    heldout = spread_windows(corpus_token_ids(tokenizer, "heldout"), 2, 512)
    targets = [0.5, 0.7, 0.9]
    thresholds = calibrate_thresholds(model, calibration, targets, progress=False)
    inactive = dict.fromkeys(targets, 0)
    seen = 0

    def count(i, x, h):
        nonlocal seen
        score = activation_score(h)
        seen += score.numel()
        for target in targets:
            inactive[target] += int((score <= thresholds[target][i]).sum())

    with torch.no_grad(), ffn_hooks(model, count):  # one held-out pass serves every target
        for window in heldout.view(2, 512):
            model(window.unsqueeze(0))
    for target in targets:
        assert abs(inactive[target] / seen - target) <= 0.02, (target, inactive[target] / seen)


@pytest.mark.slow
def test_cli_train_predictors_writes_a_loadable_file(default_model, tmp_path, monkeypatch, capsys):
    import flashllm_ext.hub

    path, model, tokenizer = default_model
    from flashllm_ext.flash.convert import synthesize

    monkeypatch.setattr(flashllm_ext.hub, "load_hf_model", lambda p: (model, tokenizer))  # reuse the loaded one
    # A store with the default model's FFN shapes; converting the real model would only add minutes.
    store_dir = synthesize(tmp_path / "store", n_layers=30, hidden_size=576, n_neurons=1536, glu=True)
    cli.main(
        [
            "train-predictors",
            str(path),
            "--store",
            str(store_dir),
            "--tokens",
            "512",
            "--epochs",
            "1",
            "--method",
            "lowrank",
            "--rank",
            "16",
            "--target-sparsity",
            "0.8",
        ]
    )
    assert "wrote 30 lowrank predictors" in capsys.readouterr().out
    predictors = load_predictors(store_dir)
    assert [p.rank for p in predictors.predictors] == [16] * 30 and (predictors.thresholds > 0).all()
    assert predictors.predict(3, torch.randn(2, 576)).shape == (2, 1536)


def test_load_refuses_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "p.safetensors")
    refuses_without_blocking(lambda: load_predictors(tmp_path / "p.safetensors"), tmp_path / "p.safetensors")
