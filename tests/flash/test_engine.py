"""The engine (flashllm_ext.flash.engine): load_flash / patch_flash in every mode against transformers' own outputs,
the one active-neuron rule end to end (FlashFFN's perplexity equals predictor.evaluate's), budget accounting,
undo, clear errors, and a read failure mid-generation."""

import copy
import os

import pytest
import torch

import flashllm_ext
from flashllm_ext.flash import store
from flashllm_ext.flash.convert import convert
from flashllm_ext.flash.cache import NeuronCache
from flashllm_ext.flash.ffn import FlashFFN
from flashllm_ext.flash.stack import MODES
from flashllm_ext.runtime import tensor_bytes, parse_budget
from flashllm_ext.hub import perplexity
from flashllm_ext.predictor import LowRankPredictor, PredictorSet, calibrate_thresholds, evaluate
from flashllm_ext.flash.transfer import Transfer
from tests.helpers.faults import read_failure_at
from tests.helpers.memory import mapped_ranges
from tests.helpers.models import tiny_model


def _llama():
    return tiny_model("llama", num_hidden_layers=3, max_position_embeddings=256)


def _opt():
    return tiny_model("opt", seed=1, max_position_embeddings=256, dropout=0.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (transformers model, fp32 store path)."""
    root = tmp_path_factory.mktemp("engine")
    out = {}
    for name, model in (("llama", _llama()), ("opt", _opt())):
        model.save_pretrained(root / name)
        out[name] = (model, convert(root / name, root / f"{name}-fp32", dtype="fp32", progress=False))
    return out


def _random_predictors(model, n_layers: int, d: int, n: int, sparsity: float, seed: int = 0) -> PredictorSet:
    """Untrained predictors with calibrated thresholds: the rule must hold for any predictor, good or bad."""
    torch.manual_seed(seed)
    ids = torch.randint(0, 100, (64,), generator=torch.Generator().manual_seed(seed))
    thresholds = calibrate_thresholds(model, ids, sparsity, window=32, progress=False)
    return PredictorSet([LowRankPredictor(d, n, 8) for _ in range(n_layers)], thresholds)


def _greedy(model, prompt, n: int = 32):
    return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)


@pytest.mark.parametrize("name", ["llama", "opt"])
@pytest.mark.parametrize("mode", ["dense", "naive", "hybrid", "exact"])
@torch.no_grad()
def test_load_flash_generates_the_tokens_of_transformers(models, name, mode):
    model, path = models[name]
    prompt = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    want = _greedy(model, prompt)
    budget = None if mode == "dense" else "85%"
    flash = flashllm_ext.load_flash(path, dram_budget=budget, mode=mode)
    if os.path.exists("/proc/self/maps"):  # loaded (OPT's FFNs read biases from it too), nothing maps the file
        assert not mapped_ranges(store.FlashStore(path).resident_path)
    assert torch.equal(_greedy(flash, prompt), want)
    torch.testing.assert_close(flash(prompt).logits, model(prompt).logits, rtol=1e-4, atol=1e-4)
    if mode != "dense":
        stats = flash.flash.stats()
        assert stats["mode"] == mode and stats["tokens"] == 7 + 31 + 7  # prompt, 31 decode steps, one more forward
        assert stats["accounted_bytes"] <= stats["budget_bytes"]
        assert stats["bytes_read"] > 0 and stats["io_ms"] > 0


@pytest.mark.parametrize("layout", ["per-layer", "shared", "auto", "hot-cold"])
@torch.no_grad()
def test_exact_mode_under_a_small_budget_reads_in_parts(models, layout):
    """A cache smaller than one token's active set still computes every neuron, in capacity-sized parts: of
    per-layer caches, of one cache the layers share ("auto" takes it: a layer's share holds a quarter of the
    layer's neurons, and exact mode's set is all of them), or of the rows per-layer caches leave beside their
    pinned neurons (hot-cold: every neuron equally frequent, so the first ones; here none, since each pinned row
    would add a part, a batch of reads, to save one small bundle)."""
    model, path = models["llama"]
    prompt = torch.randint(3, 90, (1, 5), generator=torch.Generator().manual_seed(3))
    s = store.FlashStore(path)
    resident = sum(p.numel() * 4 for n, p in model.named_parameters() if "mlp" not in n) + sum(
        b.nbytes for b in model.buffers()
    )  # (the rotary frequencies)
    fixed, per_row = FlashFFN.bytes_for(s, every_neuron=True)
    options = {"bounce_limit": 0, "max_read": 4096}  # the reader's buffers, charged too: one read's bounce buffer
    with flashllm_ext.flash.reader.FlashReader(s, **options) as reader:
        buffers = reader.buffer_bound()
    budget = resident + buffers + s.n_layers * (fixed + per_row * (s.n_neurons // 4))
    flash = flashllm_ext.load_flash(path, dram_budget=budget, mode="exact", reader_options=options, cache_layout=layout)
    caches = [m.cache for m in flash.flash.modules]
    if layout in ("per-layer", "hot-cold"):
        assert all(c.capacity == s.n_neurons // 4 for c in caches)
    else:  # one cache: more rows than a layer's share, still less than a layer
        assert all(c is caches[0] for c in caches)
        assert s.n_neurons // 4 < caches[0].capacity < s.n_neurons
    hot = caches[0].n_pinned
    assert hot == 0 or layout == "hot-cold"
    assert torch.equal(_greedy(flash, prompt, 8), _greedy(model, prompt, 8))
    stats = flash.flash.stats()
    # each forward of each layer (8 forwards: prompt + 7 tokens), its unpinned neurons in parts
    parts = -(-(s.n_neurons - hot) // caches[0].step_capacity)
    assert parts > 1 and stats["steps"] == 8 * s.n_layers * parts
    assert stats["accounted_bytes"] <= budget
    assert stats["cache_layout"] == {"per-layer": "per-layer", "hot-cold": "hot-cold"}.get(layout, "shared")
    assert stats["hot_fraction"] == hot / s.n_neurons
    if layout != "per-layer":  # a shared cache starts every forward empty: no reuse across tokens
        assert stats["hit_rate"] == 0


@pytest.mark.parametrize("name", ["llama", "opt"])
@torch.no_grad()
def test_hot_cold_exact_mode_generates_the_tokens_of_transformers(models, name):
    """Hot-cold caches in exact mode at 85%: the first neurons pinned (every one is always active), the rest read
    in parts of the rows left; the tokens and logits of transformers, the pinned neurons hits in every step."""
    model, path = models[name]
    prompt = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    flash = flashllm_ext.load_flash(path, dram_budget="85%", mode="exact", cache_layout="hot-cold")
    s, caches = store.FlashStore(path), [m.cache for m in flash.flash.modules]
    hot = caches[0].n_pinned
    assert hot > 0 and all(torch.equal(c.partition(torch.arange(hot))[0], torch.arange(hot)) for c in caches)
    assert torch.equal(_greedy(flash, prompt), _greedy(model, prompt))
    torch.testing.assert_close(flash(prompt).logits, model(prompt).logits, rtol=1e-4, atol=1e-4)
    stats = flash.flash.stats()
    assert stats["cache_layout"] == "hot-cold" and stats["hot_fraction"] == hot / s.n_neurons
    assert stats["hit_rate"] >= hot / s.n_neurons and stats["accounted_bytes"] <= stats["budget_bytes"]
    assert all(bool(c.pinned[:hot].all()) and bool((c.slot_of[:hot] >= 0).all()) for c in caches)  # still held


@pytest.mark.parametrize("name", ["llama", "opt"])
@torch.no_grad()
def test_a_shared_cache_computes_what_per_layer_caches_compute(models, name):
    """Flash mode with one cache shared by the layers reads and computes each token's predicted set as per-layer
    caches do (the same sums, in other parts); "auto" shares it only when a layer's share is below the predictors'
    loaded density of its neurons, and keeps per-layer caches when that density is unknown or look-ahead is on."""
    model, path = models[name]
    s = store.FlashStore(path)
    predictors = _random_predictors(model, s.n_layers, s.hidden_size, s.n_neurons, 0.5)
    predictors.prob_thresholds.fill_(0.45)
    ids = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(5))
    want = model(ids).logits
    patched = copy.deepcopy(model)
    resident = flashllm_ext.flash.engine.resident_bytes_of(patched)
    fixed, per_row = FlashFFN.bytes_for(s)
    budget = resident + predictors.memory_bytes + (64 << 10) + s.n_layers * (fixed + per_row * (s.n_neurons // 8))
    got = {}
    with pytest.raises(ValueError, match="calibration frequency, which these predictors do not carry"):
        flashllm_ext.patch_flash(
            patched, path, mode="flash", predictors=predictors, dram_budget=budget, cache_layout="hot-cold"
        )
    predictors.frequency.copy_(torch.rand(predictors.frequency.shape, generator=torch.Generator().manual_seed(1)))
    for layout in ("per-layer", "shared", "hot-cold"):
        runtime = flashllm_ext.patch_flash(
            patched, path, mode="flash", predictors=predictors, dram_budget=budget, cache_layout=layout
        )
        got[layout] = patched(ids).logits
        assert runtime.cache_layout == layout
        if layout == "per-layer":
            layer_rows = runtime.modules[0].cache.capacity
        runtime.unpatch(patched)
    assert torch.allclose(got["shared"], got["per-layer"], rtol=1e-4, atol=1e-4)
    assert torch.allclose(got["hot-cold"], got["per-layer"], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got["shared"], want, rtol=1e-3, atol=1e-3)  # the predicted sets matter here
    above, below = 2 * layer_rows / s.n_neurons, layer_rows / 2 / s.n_neurons  # sets larger / smaller than a cache
    for density, lookahead, layout in (
        (None, None, "per-layer"),
        (above, None, "shared"),
        (below, None, "per-layer"),
        (above, "ahead", "per-layer"),
    ):
        predictors.loaded_density = density
        runtime = flashllm_ext.patch_flash(
            patched, path, mode="flash", predictors=predictors, dram_budget=budget, lookahead=lookahead
        )
        assert runtime.cache_layout == layout, (density, lookahead)
        runtime.unpatch(patched)
    with pytest.raises(ValueError, match="cache_layout must be one of"):
        flashllm_ext.patch_flash(patched, path, mode="flash", predictors=predictors, cache_layout="pooled")
    with pytest.raises(ValueError, match="lookahead needs per-layer caches"):
        flashllm_ext.patch_flash(
            patched, path, mode="flash", predictors=predictors, cache_layout="shared", lookahead="ahead"
        )


@pytest.mark.parametrize("name", ["llama", "opt"])
@torch.no_grad()
def test_flash_perplexity_equals_evaluate(models, name):
    """One rule: the model running through FlashFFN in flash mode scores what `evaluate` reports for the same
    predictors and thresholds (evaluate masks a dense FFN; FlashFFN reads and computes only the predicted rows)."""
    model, path = models[name]
    s = store.FlashStore(path)
    predictors = _random_predictors(model, s.n_layers, s.hidden_size, s.n_neurons, 0.5)
    predictors.prob_thresholds.fill_(0.45)  # an untrained predictor: about half the neurons predicted active
    ids = torch.randint(0, 90, (64,), generator=torch.Generator().manual_seed(4))
    result = evaluate(model, predictors, ids, window=32, n_windows=2, progress=False)
    assert abs(result["ppl_predictor"] / result["ppl_dense"] - 1) > 2e-4  # the masks matter here
    patched = copy.deepcopy(model)
    runtime = flashllm_ext.patch_flash(patched, path, mode="flash", predictors=predictors, window=3)
    got = perplexity(patched, ids, 32, 2, progress=False)
    assert got == pytest.approx(result["ppl_predictor"], rel=2e-5)
    stats = patched.flash.stats()
    assert 0 < stats["hit_rate"] < 1 and stats["predictor_ms"] > 0
    runtime.unpatch(patched)


@torch.no_grad()
def test_flash_mode_stays_within_its_budget(models):
    model, path = models["llama"]
    s = store.FlashStore(path)
    predictors = _random_predictors(model, s.n_layers, s.hidden_size, s.n_neurons, 0.7)
    predictors.prob_thresholds.fill_(0.5)
    total = flashllm_ext.flash.engine.model_bytes(model, s)
    for budget in ("50%", "80%", int(total * 0.6)):
        flash = flashllm_ext.load_flash(path, dram_budget=budget, mode="flash", predictors=predictors)
        _greedy(flash, torch.tensor([[5, 6, 7]]), 6)
        stats = flash.flash.stats()
        assert stats["accounted_bytes"] <= stats["budget_bytes"] == parse_budget(budget, total)
        assert stats["predictor_bytes"] > 0 and stats["ffn_bytes"] > 0


def _held_bytes(runtime) -> int:
    """The bytes of every tensor a runtime's FFN modules hold, with their caches' and their transfer's (not the
    store's, the reader's or the predictors', which are charged apart), each storage once."""
    tensors, seen = [], set()

    def visit(obj) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        attributes = dict(vars(obj), **(obj._buffers if isinstance(obj, torch.nn.Module) else {}))
        for value in attributes.values():
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            elif isinstance(value, (NeuronCache, Transfer)):
                visit(value)

    for module in runtime.modules:
        visit(module)
    return tensor_bytes(tensors)


@pytest.mark.parametrize("name", ["llama", "opt"])
@pytest.mark.parametrize(
    "mode, layout",
    [
        ("naive", "auto"),
        ("hybrid", "auto"),
        ("flash", "per-layer"),
        ("flash", "shared"),
        ("flash", "hot-cold"),
        ("exact", "per-layer"),
        ("exact", "shared"),
        ("exact", "hot-cold"),
    ],
)
@torch.no_grad()
def test_ffn_bytes_are_the_bytes_the_modules_hold(models, name, mode, layout):
    """The FFN bytes a runtime charges to its budget (beside the reader's buffer bound) are the bytes its modules
    really hold after a generation: caches, pointer matrices, scratch, biases, exact mode's ids, staging. Charged
    but not held, by design (conservative): naive and hybrid layers' float32 output bias when the model has none
    (StreamingFFN.bytes_for), and the input-bias vector a shared cache is built with, whose place each layer's own
    takes as the cache serves it (OPT has input biases, Llama none)."""
    model, path = models[name]
    s = store.FlashStore(path)
    predictors = _random_predictors(model, s.n_layers, s.hidden_size, s.n_neurons, 0.5) if mode == "flash" else None
    if predictors is not None:
        predictors.frequency.uniform_(generator=torch.Generator().manual_seed(2))
    flash = flashllm_ext.load_flash(path, dram_budget="85%", mode=mode, predictors=predictors, cache_layout=layout)
    _greedy(flash, torch.tensor([[5, 6, 7]]), 4)
    runtime, stats = flash.flash, flash.flash.stats()
    charged = stats["ffn_bytes"] - runtime.reader.buffer_bound()
    unheld_out_bias = 4 * s.hidden_size * s.n_layers if mode in ("naive", "hybrid") and name == "llama" else 0
    unheld_cache_bias = s.n_neurons * s.dtype.itemsize if layout == "shared" and name == "opt" else 0
    assert charged - _held_bytes(runtime) == unheld_out_bias + unheld_cache_bias
    assert stats["accounted_bytes"] <= stats["budget_bytes"]


@torch.no_grad()
def test_patch_generate_unpatch_leaves_the_model_as_it_was(models):
    model, path = models["opt"]
    prompt = torch.tensor([[4, 8, 15, 16]])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules_before = list(model.modules())
    want = _greedy(model, prompt, 8)
    runtime = flashllm_ext.patch_flash(model, path, mode="exact", dram_budget="70%")
    assert torch.equal(_greedy(model, prompt, 8), want)
    runtime.unpatch(model)
    assert list(model.modules()) == modules_before and not hasattr(model, "flash_stats")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(_greedy(model, prompt, 8), want)


def test_unpatch_refuses_a_stale_runtime_and_the_old_names_still_work_with_a_warning(models):
    """patch_model and model.flash_stats() (the names before patch_flash and runtime.stats()) work one release more,
    each call warning; a runtime unpatched once refuses a second unpatch, and one built by load_flash any."""
    model, path = models["opt"]
    with pytest.warns(DeprecationWarning, match="use patch_flash"):
        runtime = flashllm_ext.patch_model(model, path, mode="exact", dram_budget="70%")
    _greedy(model, torch.tensor([[4, 8]]), 2)
    with pytest.warns(DeprecationWarning, match=r"use model.flash.stats\(\)"):
        old = model.flash_stats()
    with pytest.warns(DeprecationWarning, match=r"use FlashRuntime.stats\(\)"):
        assert runtime.flash_stats()["tokens"] == old["tokens"] == runtime.stats()["tokens"] > 0
    runtime.unpatch(model)
    with pytest.raises(RuntimeError, match="no longer serves that model"):
        runtime.unpatch(model)
    built = flashllm_ext.load_flash(path, dram_budget="85%", mode="exact")
    with pytest.raises(RuntimeError, match="built by load_flash"):
        built.flash.unpatch(built)
    built.flash.close()


def test_clear_errors(models, tmp_path):
    llama, llama_path = models["llama"]
    opt, opt_path = models["opt"]
    with pytest.raises(ValueError, match="decoder layers|not the same model"):
        flashllm_ext.patch_flash(copy.deepcopy(llama), opt_path, mode="exact")
    with pytest.raises(ValueError, match="below the minimum"):
        flashllm_ext.load_flash(llama_path, dram_budget="1%", mode="exact")
    with pytest.raises(ValueError, match="below the minimum"):
        flashllm_ext.load_flash(llama_path, dram_budget="1%", mode="naive")
    with pytest.raises(ValueError, match="needs predictors"):
        flashllm_ext.load_flash(llama_path, mode="flash")
    with pytest.raises(ValueError, match="mode must be one of"):
        flashllm_ext.load_flash(llama_path, mode="fast")
    with pytest.raises(ValueError, match="dram_budget must be"):
        flashllm_ext.load_flash(llama_path, dram_budget="lots", mode="exact")
    patched = copy.deepcopy(llama)
    runtime = flashllm_ext.patch_flash(patched, llama_path, mode="exact")
    with pytest.raises(ValueError, match="already patched"):
        flashllm_ext.patch_flash(patched, llama_path, mode="exact")
    runtime.unpatch(patched)
    assert set(MODES) == {"dense", "naive", "hybrid", "flash", "exact"}


@torch.no_grad()
def test_read_failure_mid_generation_raises_and_leaves_the_model_usable(models):
    model, path = models["llama"]
    prompt = torch.tensor([[9, 10, 11]])
    flash = flashllm_ext.load_flash(path, dram_budget="60%", mode="exact")
    with read_failure_at(flash.flash.reader), pytest.raises(OSError, match="injected"):
        _greedy(flash, prompt, 8)
    assert torch.equal(_greedy(flash, prompt, 8), _greedy(model, prompt, 8))


def test_parse_budget():
    assert parse_budget("50%", 1000) == 500
    assert parse_budget("2MiB", 0) == 2 << 20
    assert parse_budget("1.5GB", 0) == 1_500_000_000
    assert parse_budget(1234, 0) == 1234
    for bad in ("", "-5", "0", "ten", "5 parsecs", 0.5, -3, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="dram_budget must be"):
            parse_budget(bad, 1000)


@torch.no_grad()
def test_sampling_matches_transformers_with_the_same_seed(models):
    model, path = models["llama"]
    prompt = torch.tensor([[3, 14, 15, 92]])
    flash = flashllm_ext.load_flash(path, dram_budget="85%", mode="exact")

    def sample(m):
        torch.manual_seed(123)
        return m.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=True, top_k=20, temperature=0.9)

    assert torch.equal(sample(flash), sample(model))


@pytest.mark.slow
@torch.no_grad()
def test_default_model_exact_mode_and_cli_run(default_model, tmp_path, capsys):
    """The real model: exact mode under a budget generates transformers' 32 greedy tokens; `flashllm run` works."""
    from flashllm_ext import cli

    gguf, model, tokenizer = default_model
    path = convert(gguf, tmp_path / "store", dtype="fp32", progress=False)
    prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids
    flash = flashllm_ext.load_flash(path, dram_budget="75%", mode="exact")
    assert flash.flash.stats()["accounted_bytes"] <= flash.flash.stats()["budget_bytes"]
    assert torch.equal(_greedy(flash, prompt), _greedy(model, prompt))
    flash.flash.close()
    assert (
        cli.main(["run", str(path), "--tokenizer", str(gguf), "--mode", "naive", "--budget", "75%", "--tokens", "4"])
        == 0
    )
    out = capsys.readouterr().out
    assert "4 tokens in" in out and "bytes_per_token" in out


@torch.no_grad()
def test_ffn_stack_serves_every_layer_within_its_budget(models):
    """The FFN-only stack of the scale benchmark: the same modules as load_flash, layer i = the model's FFN i."""
    from flashllm_ext.flash.stack import ffn_stack, store_ffn_bytes

    model, path = models["llama"]
    s = store.FlashStore(path)
    budget = store_ffn_bytes(s) // 2
    for mode in ("naive", "hybrid", "exact"):
        runtime = ffn_stack(s, mode, budget)
        assert runtime.accounted_bytes <= budget and len(runtime.modules) == s.n_layers
        x = torch.randn(3, s.hidden_size, generator=torch.Generator().manual_seed(5))
        for i, layer in enumerate(model.model.layers):
            torch.testing.assert_close(runtime.modules[i](x), layer.mlp(x), rtol=1e-5, atol=1e-5)
        assert runtime.counters.bytes_read > 0
        runtime.close()
    with pytest.raises(ValueError, match="needs predictors"):
        ffn_stack(s, "flash", budget)


@pytest.mark.parametrize("name", ["llama", "opt"])
@torch.no_grad()
def test_lookahead_exact_mode_generates_the_tokens_of_transformers(models, name):
    """Look-ahead only moves when the reads start: exact mode still computes every neuron, so dense's tokens."""
    model, path = models[name]
    prompt = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(6))
    flash = flashllm_ext.load_flash(path, dram_budget="85%", mode="exact", lookahead="ahead")
    assert torch.equal(_greedy(flash, prompt, 12), _greedy(model, prompt, 12))
    with pytest.raises(ValueError, match="lookahead needs a neuron cache"):
        flashllm_ext.load_flash(path, dram_budget="85%", mode="naive", lookahead="ahead")
    with pytest.raises(ValueError, match="lookahead must be None or one of"):
        flashllm_ext.load_flash(path, dram_budget="85%", mode="exact", lookahead="soon")
    from flashllm_ext import cli

    with pytest.raises(SystemExit, match="flashllm run: lookahead needs a neuron cache"):
        cli.main(["run", str(path), "--tokenizer", str(path), "--mode", "hybrid", "--lookahead", "ahead"])


@pytest.mark.parametrize("name", ["llama", "opt"])
@torch.no_grad()
def test_lookahead_computes_the_set_chosen_from_the_normed_layer_input(models, name):
    """Flash mode with lookahead: each decode step's FFN computes the set its predictor chose from the FFN's norm
    of the decoder layer's input (the rule's threshold still applied to the real activations); a prompt's tokens
    use their own FFN inputs. The reference masks a dense FFN the same way (the rule's ffn_hooks)."""
    from flashllm_ext.hub.hf import decoder_layers, ffn_norm
    from flashllm_ext.predictor.rule import ffn_hooks

    model, path = models[name]
    s = store.FlashStore(path)
    predictors = _random_predictors(model, s.n_layers, s.hidden_size, s.n_neurons, 0.5)
    predictors.prob_thresholds.fill_(0.45)
    reference = copy.deepcopy(model)
    ahead: dict[int, torch.Tensor] = {}

    def choose_ahead(i, layer, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] == 1:
            ahead[i] = predictors.predict(i, ffn_norm(layer)(hidden).reshape(1, -1))

    def mask(i, x, h):
        chosen = ahead.pop(i) if i in ahead else predictors.predict(i, x)
        return h * (chosen & (h.abs() > predictors.thresholds[i]))

    handles = [
        layer.register_forward_pre_hook(lambda m, a, k, i=i: choose_ahead(i, m, a, k), with_kwargs=True)
        for i, layer in enumerate(decoder_layers(reference))
    ]
    patched = copy.deepcopy(model)
    runtime = flashllm_ext.patch_flash(patched, path, mode="flash", predictors=predictors, window=3, lookahead="ahead")
    prompt = torch.randint(3, 90, (1, 5), generator=torch.Generator().manual_seed(7))
    with ffn_hooks(reference, mask):
        want, got = reference(prompt, use_cache=True), patched(prompt, use_cache=True)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
        for step in range(6):
            token = want.logits[:, -1:].argmax(-1)
            want = reference(token, past_key_values=want.past_key_values, use_cache=True)
            got = patched(token, past_key_values=got.past_key_values, use_cache=True)
            torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    for handle in handles:
        handle.remove()
    stats = patched.flash.stats()
    assert stats["hidden_io_ms"] > 0 and stats["predictor_ms"] > 0
    runtime.unpatch(patched)
    assert all(not layer._forward_pre_hooks for layer in decoder_layers(patched))


@pytest.mark.parametrize("name", ["llama", "opt"])
@torch.no_grad()
def test_lookahead_prefetch_keeps_the_results_of_flash_mode(models, name):
    """lookahead="prefetch": the set chosen ahead is only read early; every forward computes what flash mode
    without look-ahead computes (same logits), reading fewer bundles itself (hit rate up), the rest prefetched."""
    model, path = models[name]
    s = store.FlashStore(path)
    predictors = _random_predictors(model, s.n_layers, s.hidden_size, s.n_neurons, 0.5)
    predictors.prob_thresholds.fill_(0.55)  # sets that fit the cache, windows that do not
    prompt = torch.randint(3, 90, (1, 5), generator=torch.Generator().manual_seed(8))
    runs = {}
    for lookahead in (None, "prefetch"):
        flash = flashllm_ext.load_flash(
            path, dram_budget="85%", mode="flash", predictors=predictors, window=2, lookahead=lookahead
        )
        out, logits = flash(prompt, use_cache=True), []
        for _ in range(8):
            out = flash(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits)
        runs[lookahead] = torch.cat(logits), flash.flash.stats(), flash.flash.counters
        assert flash.flash.stats()["accounted_bytes"] <= flash.flash.stats()["budget_bytes"]
    (plain, plain_stats, plain_raw), (ahead, ahead_stats, ahead_raw) = runs[None], runs["prefetch"]
    torch.testing.assert_close(ahead, plain, rtol=1e-5, atol=1e-5)
    assert ahead_raw.needed == plain_raw.needed and ahead_raw.prefetched > 0 and plain_raw.prefetched == 0
    assert ahead_stats["hit_rate"] > plain_stats["hit_rate"] and ahead_stats["hidden_io_ms"] > 0


@torch.no_grad()
@pytest.mark.parametrize("mode", ["naive", "hybrid"])
def test_streamed_bundles_of_a_real_sized_layer_are_read_in_place(tmp_path, mode):
    """A layer's streamed bundles lie back to back on the file: in host memory ffn_stack reads them in place
    (StreamingFFN landing, charged with its widening and alignment), and each layer computes what the copying path
    (its own staging) computes from the same bytes; on toy stores, where the widening would cost more than 1% of the
    rows, the copying path stays."""
    from flashllm_ext.flash.convert import synthesize
    from flashllm_ext.flash.stack import ffn_stack
    from flashllm_ext.flash.streaming import StreamingFFN

    s = store.FlashStore(synthesize(tmp_path / "store", 2, 64, 4096, glu=True))  # 1.5 MB of bundles a layer
    runtime = ffn_stack(s, mode, None)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    for layer, module in enumerate(runtime.modules):
        assert module.landing is not None and module.staging.data_ptr() >= module.landing.data_ptr()
        rows = module.streamed_ids.numel()
        copying = StreamingFFN(
            s, layer, s.n_neurons - rows, torch.empty(rows, s.row_width, dtype=s.row_dtype), runtime.reader
        )
        torch.testing.assert_close(module(x), copying(x), rtol=0, atol=0)
        assert torch.equal(module.staging, copying.staging)
    landing = runtime.modules[0].landing
    assert all(m.landing is landing for m in runtime.modules)  # one buffer shared by the layers
    assert runtime.ffn_bytes >= landing.untyped_storage().nbytes()
    assert runtime.counters.bytes_requested == 2 * rows * s.row_bytes
    toy = ffn_stack(store.FlashStore(synthesize(tmp_path / "toy", 2, 16, 32, glu=True)), mode, None)
    assert all(m.landing is None for m in toy.modules)
