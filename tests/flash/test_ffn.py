"""FlashFFN: exact mode reproduces transformers' LlamaMLP and OPT fc1-fc2 (and whole-model logits) on random
weights; fixed active sets, predictors and thresholds match masked dense math; budgets and bad input."""

import copy
import os

import pytest
import torch

from flashllm_ext.flash import store
from flashllm_ext.flash.cache import NeuronCache
from flashllm_ext.flash.convert import convert
from flashllm_ext.flash.ffn import FlashFFN, active_ids_of
from flashllm_ext.flash.install import install_flash_ffn
from flashllm_ext.flash.reader import shared_reader
from tests.helpers.models import tiny_model


def _llama():
    return tiny_model("llama")


def _opt():
    return tiny_model("opt", seed=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (model, fp32 store, fp16 store)."""
    root = tmp_path_factory.mktemp("ffn")
    out = {}
    for name, model in (("llama", _llama()), ("opt", _opt())):
        model.save_pretrained(root / name)
        out[name] = (
            model,
            *(
                store.FlashStore(convert(root / name, root / f"{name}-{dt}", dtype=dt, progress=False))
                for dt in ("fp32", "fp16")
            ),
        )
    return out


def dense_mlp(model, layer: int, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The model's own FFN of `layer` on x [T, d]; with `mask` [n], only those neurons (masked dense math)."""
    if hasattr(model.model, "layers"):
        mlp = model.model.layers[layer].mlp
        h = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
        return mlp.down_proj(h if mask is None else h * mask)
    dec = model.model.decoder.layers[layer]
    h = dec.activation_fn(dec.fc1(x))
    return dec.fc2(h if mask is None else h * mask)


@pytest.mark.parametrize("name", ["llama", "opt"])
@torch.no_grad()
def test_exact_mode_reproduces_the_dense_mlp(models, name):
    model, fp32, fp16 = models[name]
    x = torch.randn(5, fp32.hidden_size)
    for layer in range(fp32.n_layers):
        want = dense_mlp(model, layer, x)
        if name == "llama":  # transformers' module itself, called the way the model calls it
            assert torch.allclose(model.model.layers[layer].mlp(x), want, atol=1e-6)
        torch.testing.assert_close(FlashFFN(fp32, layer)(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(FlashFFN(fp16, layer)(x), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["llama", "opt"])
@torch.no_grad()
def test_exact_mode_whole_model_logits(models, name):
    model, fp32, _ = models[name]
    ids = torch.randint(0, 100, (1, 10))
    want = model(ids).logits
    patched = copy.deepcopy(model)
    ffns = install_flash_ffn(patched, fp32)
    torch.testing.assert_close(patched(ids).logits, want, rtol=1e-4, atol=1e-4)
    assert all(len(f.last_stats) == 1 for f in ffns)  # the 10-token prompt is one cache step, not 10


def _threads_of_this_process() -> int:
    """Native threads included (a FlashReader's pool is std::threads, invisible to `threading`)."""
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")
@torch.no_grad()
def test_install_on_a_30_layer_model_opens_one_reader(tmp_path):
    model = tiny_model(
        "llama",
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=30,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
    )
    model.save_pretrained(tmp_path / "ckpt")
    ids = torch.randint(0, 32, (1, 4))
    want = model(ids).logits  # also starts torch's own worker threads before the count
    with store.FlashStore(convert(tmp_path / "ckpt", tmp_path / "s", dtype="fp32", progress=False)) as fs:
        before = _threads_of_this_process()
        ffns = install_flash_ffn(model, fs)
        assert len(ffns) == 30 and all(f.cache.reader is shared_reader(fs) for f in ffns)
        assert _threads_of_this_process() - before == shared_reader(fs).threads  # one pool, not one per layer
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-4, atol=1e-4)
        pool = shared_reader(fs).threads
        running = _threads_of_this_process()
    assert running - _threads_of_this_process() == pool  # closing the store ended the pool


@pytest.mark.parametrize("name", ["llama", "opt"])
@torch.no_grad()
def test_fixed_set_predictor_and_threshold(models, name):
    model, fp32, _ = models[name]
    n = fp32.n_neurons
    g = torch.Generator().manual_seed(0)
    subset = torch.randperm(n, generator=g)[: n // 3]
    mask = torch.zeros(n)
    mask[subset] = 1
    x = torch.randn(4, fp32.hidden_size, generator=g)
    want = dense_mlp(model, 1, x, mask)
    torch.testing.assert_close(FlashFFN(fp32, 1, active_ids=subset, capacity=n // 2)(x), want, rtol=1e-5, atol=1e-5)
    bool_mask = mask.bool()
    ffn = FlashFFN(fp32, 1, predictor=lambda chunk: bool_mask.expand(chunk.shape[0], n), window=2)
    torch.testing.assert_close(ffn(x), want, rtol=1e-5, atol=1e-5)
    assert [s.inserted for s in ffn.last_stats] == [n // 3]  # 4 tokens, one union: one step
    torch.testing.assert_close(ffn(x[:1]), want[:1], rtol=1e-5, atol=1e-5)
    assert [s.inserted for s in ffn.last_stats] == [0] and ffn.stats.hit_rate == pytest.approx(0.5)
    # Threshold: only the (token, neuron) terms whose |h| is above t are kept (every kernel's rule; h is the GLU
    # product for Llama).
    t = 0.05
    if name == "llama":
        mlp = model.model.layers[1].mlp
        h = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
        want_t = mlp.down_proj(torch.where(h.abs() > t, h, 0))
    else:
        dec = model.model.decoder.layers[1]
        a = dec.activation_fn(dec.fc1(x))
        want_t = dec.fc2(torch.where(a.abs() > t, a, 0))
    torch.testing.assert_close(FlashFFN(fp32, 1, threshold=t)(x), want_t, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_budget_and_bad_input(models):
    model, fp32, _ = models["llama"]
    n = fp32.n_neurons
    # A token needing more neurons than the cache holds is computed in capacity-sized parts.
    ffn = FlashFFN(fp32, 0, predictor=lambda chunk: torch.arange(n), capacity=n - 1)
    x = torch.randn(1, fp32.hidden_size)
    torch.testing.assert_close(ffn(x), dense_mlp(model, 0, x), rtol=1e-5, atol=1e-5)
    assert [s.inserted for s in ffn.last_stats] == [n - 1, 1]
    with pytest.raises(ValueError, match="hidden size"):
        FlashFFN(fp32, 0)(torch.randn(2, 3))
    with pytest.raises(ValueError, match="not both"):
        FlashFFN(fp32, 0, predictor=lambda c: torch.arange(3), active_ids=torch.arange(3))
    with pytest.raises(ValueError, match="neuron ids must lie"):
        FlashFFN(fp32, 0, active_ids=torch.tensor([n]))
    with pytest.raises(ValueError, match="bool mask"):
        active_ids_of(torch.ones(3, dtype=torch.bool), n)
    with pytest.raises(ValueError, match="1-D integer"):
        active_ids_of(torch.ones(3), n)
    bad_predictor = FlashFFN(fp32, 0, predictor=lambda chunk: torch.tensor([n + 5]))
    with pytest.raises(ValueError, match=rf"neuron ids must lie in \[0, {n}\), got min {n + 5}"):
        bad_predictor(torch.randn(1, fp32.hidden_size))
    shared = NeuronCache(fp32, 0, 8)
    for own in ({"capacity": 8}, {"budget_bytes": 1 << 20}):
        with pytest.raises(ValueError, match="give cache or capacity / budget_bytes, not both"):
            FlashFFN(fp32, 1, cache=shared, **own)
    with pytest.raises(ValueError, match="the shared cache serves"):
        FlashFFN(models["opt"][1], 0, cache=shared)


@pytest.mark.parametrize("name", ["llama", "opt"])
@torch.no_grad()
def test_overlapped_decode_step_matches_the_synchronous_one(models, name):
    """A single token's reads run in the background while its cached neurons are computed: same output."""
    model, fp32, _ = models[name]
    n = fp32.n_neurons
    g = torch.Generator().manual_seed(7)
    masks = torch.rand(6, n, generator=g) < 0.4

    def predictor_at(step):
        return lambda chunk: masks[step[0] : step[0] + chunk.shape[0]]

    step_a, step_b = [0], [0]
    overlapped = FlashFFN(fp32, 1, predictor=predictor_at(step_a), capacity=n // 2, window=2)
    synchronous = FlashFFN(fp32, 1, predictor=predictor_at(step_b), capacity=n // 2, window=2, overlap=False)
    for t in range(6):
        x = torch.randn(1, fp32.hidden_size, generator=g)
        step_a[0] = step_b[0] = t
        got = overlapped(x)
        torch.testing.assert_close(got, synchronous(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, dense_mlp(model, 1, x, masks[t].float()), rtol=1e-5, atol=1e-5)
    assert overlapped.stats.inserted == synchronous.stats.inserted > 0
    assert overlapped.stats.hidden_io_s >= 0 and synchronous.stats.hidden_io_s == 0


@torch.no_grad()
def test_shared_cache_decode_step_reads_inline(models, monkeypatch):
    """A shared cache holds none of a layer's rows when its forward starts: nothing to overlap, so the step reads in
    the calling thread (no hand-off to a reader thread) and computes the same sum."""
    model, fp32, _ = models["llama"]
    n = fp32.n_neurons
    mask = torch.rand(1, n, generator=torch.Generator().manual_seed(3)) < 0.4
    cache = NeuronCache(fp32, 0, n)
    layers = [FlashFFN(fp32, layer, predictor=lambda chunk: mask, cache=cache) for layer in (0, 1)]

    def no_background(*args, **kwargs):
        raise AssertionError("a shared cache's decode step went to a reader thread")

    monkeypatch.setattr(cache.reader, "read_async", no_background)
    x = torch.randn(1, fp32.hidden_size)
    for _ in range(2):  # each layer in turn, twice: every forward finds the other layer's rows
        for layer, ffn in zip((0, 1), layers):
            torch.testing.assert_close(ffn(x), dense_mlp(model, layer, x, mask[0].float()), rtol=1e-5, atol=1e-5)
    assert all(ffn.stats.inserted == 2 * int(mask.sum()) for ffn in layers)


@torch.no_grad()
def test_failed_background_read_leaves_a_consistent_cache(models):
    model, fp32, _ = models["llama"]
    n = fp32.n_neurons
    mask = torch.zeros(1, n, dtype=torch.bool)
    mask[0, : n // 4] = True
    ffn = FlashFFN(fp32, 0, predictor=lambda chunk: mask, capacity=n // 2, reader=shared_reader(fp32))
    x = torch.randn(1, fp32.hidden_size)
    real = ffn.cache.reader.read_async

    def failing(*args, **kwargs):
        raise OSError(5, "Input/output error (injected)")

    ffn.cache.reader.read_async = failing
    with pytest.raises(OSError, match="injected"):
        ffn(x)
    ffn.cache.reader.read_async = real
    cache = ffn.cache
    assert all(cache.slot_of[int(i)] == r for r, i in enumerate(cache.cached_ids()))
    torch.testing.assert_close(ffn(x), dense_mlp(model, 0, x, mask[0].float()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "opt"])
@torch.no_grad()
def test_prefill_paths_agree_and_auto_follows_the_disk(models, name, tmp_path, monkeypatch):
    """A prompt with per-token sets: the union path and the sequential (whole layer, long reads) path give the
    masked dense result; sequential reads every bundle in a few reads; auto picks by the calibrated disk."""
    model, fp32, _ = models[name]
    n = fp32.n_neurons
    g = torch.Generator().manual_seed(3)
    masks = torch.rand(7, n, generator=g) < 0.1
    x = torch.randn(7, fp32.hidden_size, generator=g)
    want = torch.stack([dense_mlp(model, 1, x[t : t + 1], masks[t].float())[0] for t in range(7)])
    results = {}
    for path in ("union", "sequential"):
        ffn = FlashFFN(fp32, 1, predictor=lambda chunk: masks, capacity=n // 3, window=2, prefill=path)
        torch.testing.assert_close(ffn(x), want, rtol=1e-5, atol=1e-5)
        results[path] = ffn.stats
    assert results["sequential"].inserted == n and results["sequential"].n_reads <= 3 + results["union"].n_reads
    assert int(masks.any(0).sum()) <= results["union"].inserted < n  # groups of tokens: their unions only
    ffn = FlashFFN(fp32, 1, predictor=lambda chunk: masks, capacity=n // 3)
    monkeypatch.setenv("FLASHLLM_DISK_PROFILE", str(tmp_path / "none.json"))
    assert ffn.prefill_path(masks) == "union"  # not calibrated: fewer bytes
    assert ffn.prefill_path(torch.ones(7, n, dtype=torch.bool)) == "sequential"  # every token reads every neuron
    for latency, path in ((1.0, "sequential"), (1e-9, "union")):  # per-read cost dominates / bandwidth dominates
        (tmp_path / "disk.json").write_text(f'{{"latency_s": {latency}, "bandwidth_bps": 1e9, "path": "x"}}')
        monkeypatch.setenv("FLASHLLM_DISK_PROFILE", str(tmp_path / "disk.json"))
        assert ffn.prefill_path(masks) == path
    with pytest.raises(ValueError, match="prefill must be one of"):
        FlashFFN(fp32, 1, prefill="both")
