"""The MLX engine (flashllm_ext.mlx: MLXTransfer, MLXFlashFFN, MLXStreamingFFN, the Llama decoder and load_flash)
against the torch engine and transformers: the cache over mx.arrays step by step against the torch NeuronCache (rows
read back through mlx), MLXFlashFFN's outputs and cache states against FlashFFN's, the naive / hybrid stacks against
the torch engine's (outputs, reads, stats, budget), greedy tokens against transformers, bad input."""

import numpy as np
import pytest
import torch

import flashllm_ext
from flashllm_ext.flash import store
from flashllm_ext.flash.cache import NeuronCache
from flashllm_ext.flash.convert import convert
from flashllm_ext.flash.stack import ffn_stack, store_ffn_bytes
from flashllm_ext.flash.ffn import FlashFFN
from flashllm_ext.flash.transfer import HostTransfer

mx = pytest.importorskip("mlx.core", reason="mlx is not importable (install the [mlx] extra: mlx[cpu] on Linux)")
fmlx = pytest.importorskip("flashllm_ext.mlx")
from flashllm_ext.mlx.quantized import QuantizedArray  # noqa: E402  (after the skip: imports mlx)
from flashllm_ext.mlx.transfer import to_mx, torch_view  # noqa: E402
from tests.helpers.faults import read_failure_at  # noqa: E402
from tests.helpers.models import assert_tokens_agree, tiny_model  # noqa: E402

N_NEURONS = 136


def _llama(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    return tiny_model(
        "llama", seed=seed, intermediate_size=N_NEURONS, num_hidden_layers=layers, max_position_embeddings=256
    )


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """OPT (ReLU, fc1 bias: the cache moves bias rows) and Llama (GLU) stores in fp16 and fp32, and the Llama model."""
    root = tmp_path_factory.mktemp("mlx_engine")
    opt = tiny_model("opt", seed=1, ffn_dim=N_NEURONS, dropout=0.0)
    out = {"llama_model": _llama(layers=3)}
    for name, model in (("opt", opt), ("llama", out["llama_model"])):
        model.save_pretrained(root / f"{name}-ckpt")
        for dtype in ("fp16", "fp32"):
            out[f"{name}-{dtype}"] = store.FlashStore(
                convert(root / f"{name}-ckpt", root / f"{name}-{dtype}", dtype=dtype, progress=False)
            )
    return out


def rows_through_mlx(a: "mx.array", n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows [0, n) of an mx.array as mlx computes them (a slice evaluated by mlx, then copied out), bit for bit."""
    part = mx.array(a[:n])
    return torch_view(part).clone().view(dtype)


def assert_same_cache(host: NeuronCache, other: NeuronCache) -> None:
    """The decisions (pointer, slot_of, last_active) equal, and the MLX cache's mx.arrays hold the host's rows."""
    assert other.num_used == host.num_used and other.steps == host.steps
    for name in ("pointer", "slot_of", "last_active"):
        assert torch.equal(getattr(other, name), getattr(host, name)), name
    n, transfer = host.num_used, other.transfer
    bits = {torch.float16: torch.int16, torch.float32: torch.int32}[host.matrix.dtype]
    got = rows_through_mlx(transfer.array(other.matrix), n, host.matrix.dtype)
    assert torch.equal(got.view(bits), host.matrix[:n].view(bits))
    if host.bias is not None:
        assert torch.equal(rows_through_mlx(transfer.array(other.bias), n, host.bias.dtype), host.bias[:n])


@pytest.mark.parametrize("name", ["opt-fp16", "llama-fp16"])
@pytest.mark.parametrize("capacity,window", [(N_NEURONS, 3), (40, 2), (17, 5)])
def test_cache_state_matches_the_torch_cache_step_by_step(stores, name, capacity, window):
    """Random active sets (some larger than the cache: refused by both, nothing changed), some steps overlapped
    (begin_step in the background, finish later): after every step the MLX cache is the torch cache."""
    s = stores[name]
    layer = s.n_layers - 1
    host = NeuronCache(s, layer, capacity, window)
    other = NeuronCache(s, layer, capacity, window, transfer=fmlx.MLXTransfer())
    assert isinstance(other.transfer.array(other.matrix), mx.array)
    gen = torch.Generator().manual_seed(capacity + window)
    evicted_budget = 0
    for step in range(40):
        k = int(torch.randint(0, min(capacity + 8, 60), (1,), generator=gen))
        ids = torch.randint(0, N_NEURONS, (k,), generator=gen)
        if ids.unique().numel() > capacity:
            for cache in (host, other):
                with pytest.raises(ValueError, match="distinct active neurons"):
                    cache.step(ids)
        else:
            want = host.step(ids)
            got = other.begin_step(ids, background=True).finish() if step % 3 == 0 else other.step(ids)
            assert (got.evicted, got.evicted_budget, got.inserted, got.num_used) == (
                want.evicted,
                want.evicted_budget,
                want.inserted,
                want.num_used,
            )
            evicted_budget += want.evicted_budget
        assert_same_cache(host, other)
    assert capacity == N_NEURONS or evicted_budget > 0  # the small caches ran the budget rule


def _predictor(d: int, seed: int):
    """A deterministic per-token predictor: bool [T, n] from a fixed random projection of x."""
    proj = torch.randn(d, N_NEURONS, generator=torch.Generator().manual_seed(seed))
    return lambda x: (x.float() @ proj) > 0.3


def _configs(d: int) -> dict[str, dict]:
    fixed = torch.randint(0, N_NEURONS, (50,), generator=torch.Generator().manual_seed(7))
    return {
        "exact": {},
        "exact-parts": {"capacity": 30},
        "fixed": {"active_ids": fixed, "capacity": 60},
        "predictor": {"predictor": _predictor(d, 3), "threshold": 0.01, "capacity": 90, "window": 2},
        "predictor-small": {"predictor": _predictor(d, 4), "capacity": 64, "window": 3},
    }


@pytest.mark.parametrize("name", ["opt-fp32", "llama-fp32", "llama-fp16"])
@torch.no_grad()
def test_flash_ffn_matches_the_torch_flash_ffn(stores, name):
    """A prompt of 6 tokens then 5 decode steps through each configuration: same outputs (within rounding of the two
    sparse_ffn implementations) and the same cache after every forward."""
    s = stores[name]
    d = s.hidden_size
    tol = {"rtol": 1e-5, "atol": 1e-5} if s.dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    xs = torch.randn(11, d, generator=torch.Generator().manual_seed(5))
    for config, kwargs in _configs(d).items():
        transfer = fmlx.MLXTransfer()
        for layer in range(s.n_layers):
            torch_ffn = FlashFFN(s, layer, **kwargs)
            mlx_ffn = fmlx.MLXFlashFFN(s, layer, transfer=transfer, **kwargs)
            for first, last in [(0, 6)] + [(t, t + 1) for t in range(6, 11)]:
                want = torch_ffn(xs[first:last])
                got = mlx_ffn(to_mx(xs[first:last]))
                assert isinstance(got, mx.array) and got.dtype == mx.float32 and tuple(got.shape) == (last - first, d)
                torch.testing.assert_close(torch_view(got), want, **tol, msg=f"{config} layer {layer} [{first}:{last}]")
                assert_same_cache(torch_ffn.cache, mlx_ffn.cache)
            assert mlx_ffn.stats.tokens == torch_ffn.stats.tokens == 11
            assert mlx_ffn.stats.inserted == torch_ffn.stats.inserted


def _greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)[0].tolist()


@pytest.mark.parametrize("mode,budget", [("dense", None), ("exact", "85%"), ("exact", "60%")])
def test_decoder_generates_the_tokens_of_transformers(stores, mode, budget):
    model, path = stores["llama_model"], stores["llama-fp32"].path
    prompt = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = _greedy(model, prompt, 32)
    flash = fmlx.load_flash(path, dram_budget=budget, mode=mode)
    assert flash.generate(prompt, 32) == want
    assert flash.generate(prompt[0].tolist(), 0) == prompt[0].tolist()
    stats = flash.stats()
    assert stats["mode"] == mode and stats["tokens"] == 7 + 31 and stats["decode_ms_per_token"] > 0
    new, seconds = flash.greedy_decode(prompt, 5)  # the stats then cover the 4 decode steps only
    assert new == want[7:12] and flash.stats()["tokens"] == 4 and seconds > 0
    if mode != "dense":
        assert stats["accounted_bytes"] <= stats["budget_bytes"] and stats["bytes_read"] > 0
        if budget == "60%":  # the caches cannot hold a layer: the reads repeat
            assert stats["hit_rate"] < 1 and stats["bytes_per_token"] > 0
    flash.close()


@pytest.mark.parametrize("layout", ["per-layer", "shared"])
def test_read_failure_mid_generation_leaves_the_caches_consistent(stores, layout):
    """An I/O error in a read (the 5th: some inline, some in the reader thread) raises out of generate; every
    per-layer cache's mx.array then holds exactly the bundles its pointer names (a shared cache starts each layer's
    forward empty), and the model generates transformers' tokens again."""
    model, s = stores["llama_model"], stores["llama-fp32"]
    prompt = torch.tensor([[9, 10, 11]])
    flash = fmlx.load_flash(s.path, dram_budget="60%", mode="exact", cache_layout=layout)
    assert flash.runtime.cache_layout == layout
    with read_failure_at(flash.runtime.reader), pytest.raises(OSError, match="injected"):
        flash.generate(prompt, 8)
    for ffn in flash.ffns if layout == "per-layer" else []:
        cache = ffn.cache
        ids = cache.pointer[: cache.num_used]
        assert torch.equal(rows_through_mlx(ffn.matrix, cache.num_used, s.dtype), s.bundle(cache.layer, ids))
        assert torch.equal(cache.slot_of[ids], torch.arange(cache.num_used))
    with torch.no_grad():
        assert flash.generate(prompt, 8) == _greedy(model, prompt, 8)
    flash.close()


def test_flash_mode_follows_the_torch_engine(stores):
    """Flash mode with the same (untrained) predictors: the MLX engine generates the torch engine's tokens and
    reads what it reads."""
    from flashllm_ext.predictor import LowRankPredictor, PredictorSet

    s = stores["llama-fp32"]
    torch.manual_seed(3)
    predictors = PredictorSet(
        [LowRankPredictor(s.hidden_size, N_NEURONS, 8) for _ in range(s.n_layers)], torch.zeros(s.n_layers)
    )
    prompt = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(4))
    reference = flashllm_ext.load_flash(s.path, dram_budget="70%", mode="flash", predictors=predictors)
    with torch.no_grad():
        want = _greedy(reference, prompt, 16)
    flash = fmlx.load_flash(s.path, dram_budget="70%", mode="flash", predictors=predictors)
    assert flash.generate(prompt, 16) == want
    got, ref = flash.stats(), reference.flash.stats()
    assert got["predictor_ms"] > 0 and got["hit_rate"] < 1
    for key in ("tokens", "bytes_read", "steps"):  # (the budgets differ by the torch model's rotary buffer)
        assert got[key] == ref[key], key
    assert got["accounted_bytes"] <= got["budget_bytes"]
    flash.close()
    reference.flash.close()


def _streaming_stacks(s: store.FlashStore, mode: str, budget: int | None):
    """The torch engine's FFN stack and the MLX one for `mode` over `s` at `budget` (bytes or None)."""
    return (
        ffn_stack(s, mode, budget),
        ffn_stack(s, mode, budget, transfer=fmlx.MLXTransfer(), streaming_class=fmlx.MLXStreamingFFN),
    )


@pytest.mark.parametrize("name", ["opt-fp32", "llama-fp32", "llama-fp16"])
@pytest.mark.parametrize("mode,share", [("naive", 0.6), ("hybrid", 0.8), ("hybrid", None)])
@torch.no_grad()
def test_streaming_stack_matches_the_torch_stack(stores, name, mode, share):
    """naive / hybrid FFN stacks (ffn_stack, the builder of both engines) at the same budget: the same split (resident
    rows, accounted bytes), the same outputs of a 6-token prompt then 5 decode steps (within rounding of the two
    sparse_ffn implementations) and the same reads and stats; each forward re-reads exactly the streamed bundles."""
    s = stores[name]
    budget = None if share is None else int(store_ffn_bytes(s) * share)
    reference, stack = _streaming_stacks(s, mode, budget)
    streamed = reference.modules[0].streamed_ids.numel()
    assert [m.streamed_ids.numel() for m in stack.modules] == [streamed] * s.n_layers
    if mode == "naive":
        assert streamed == s.n_neurons
    else:  # part resident (half without a budget), part streamed
        assert 0 < streamed < s.n_neurons and (share is not None or streamed == s.n_neurons - s.n_neurons // 2)
    assert stack.ffn_bytes == reference.ffn_bytes and (budget is None or stack.accounted_bytes <= budget)
    tol = {"rtol": 1e-5, "atol": 1e-5} if s.dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    xs = torch.randn(11, s.hidden_size, generator=torch.Generator().manual_seed(6))
    for first, last in [(0, 6)] + [(t, t + 1) for t in range(6, 11)]:
        requested = stack.counters.bytes_requested
        for layer in range(s.n_layers):
            want = reference.modules[layer](xs[first:last])
            got = stack.modules[layer](to_mx(xs[first:last]))
            assert (
                isinstance(got, mx.array)
                and got.dtype == mx.float32
                and tuple(got.shape) == (last - first, s.hidden_size)
            )
            torch.testing.assert_close(torch_view(got), want, **tol, msg=f"layer {layer} [{first}:{last}]")
        assert stack.counters.bytes_requested - requested == s.n_layers * streamed * s.row_bytes
    for key in ("tokens", "steps", "needed", "inserted", "bytes_read", "bytes_requested", "n_reads"):
        assert getattr(stack.counters, key) == getattr(reference.counters, key), key
    assert stack.counters.tokens == 11 * s.n_layers and stack.counters.compute_s > 0
    reference.close()
    stack.close()


@pytest.mark.parametrize("mode,budget", [("naive", "75%"), ("hybrid", "85%"), ("hybrid", None)])
def test_streaming_modes_generate_the_tokens_of_transformers(stores, mode, budget):
    """naive / hybrid decoders: transformers' (and the torch engine's) greedy tokens; per decode token the stats count
    every layer's streamed bundles once (naive: the whole FFN; hybrid: the part not resident), one read step a layer,
    within the budget."""
    model, s = stores["llama_model"], stores["llama-fp32"]
    prompt = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = _greedy(model, prompt, 24)
        torch_engine = flashllm_ext.load_flash(s.path, dram_budget=budget, mode=mode)
        assert _greedy(torch_engine, prompt, 24) == want
        torch_engine.flash.close()
    flash = fmlx.load_flash(s.path, dram_budget=budget, mode=mode)
    assert all(isinstance(ffn, fmlx.MLXStreamingFFN) for ffn in flash.ffns)
    assert flash.generate(prompt, 24) == want
    streamed = flash.ffns[0].streamed_ids.numel()
    assert streamed == s.n_neurons if mode == "naive" else 0 < streamed < s.n_neurons
    if budget is None:
        assert streamed == s.n_neurons - s.n_neurons // 2
    new, seconds = flash.greedy_decode(prompt, 5)  # the stats then cover the 4 decode steps only
    assert new == want[7:12] and seconds > 0
    stats = flash.stats()
    per_token = s.n_layers * streamed * s.row_bytes
    assert stats["mode"] == mode and stats["tokens"] == 4 and stats["steps"] == 4 * s.n_layers
    assert stats["requested_bytes_per_token"] == per_token <= stats["bytes_per_token"]
    assert stats["io_ms"] > 0 and stats["compute_ms"] > 0 and stats["hit_rate"] == 1 - streamed / s.n_neurons
    if budget is not None:
        assert stats["accounted_bytes"] <= stats["budget_bytes"]
    flash.close()


@pytest.mark.parametrize("mode", ["naive", "hybrid"])
def test_streaming_budget_below_the_minimum_is_refused(stores, mode):
    """A budget that cannot hold the staging of one layer's bundles: the torch engine's error, word for word for
    the same stack, naming the minimum through load_flash."""
    s = stores["llama-fp32"]
    messages = []
    for kwargs in ({}, {"transfer": fmlx.MLXTransfer(), "streaming_class": fmlx.MLXStreamingFFN}):
        with pytest.raises(ValueError, match="below the minimum") as error:
            ffn_stack(s, mode, store_ffn_bytes(s) // 10, **kwargs)
        messages.append(str(error.value))
    assert messages[0] == messages[1] and f"for {mode} mode" in messages[0]
    with pytest.raises(ValueError, match=rf"below the minimum of \d+ for {mode} mode"):
        fmlx.load_flash(s.path, dram_budget="1%", mode=mode)


def test_mlx_transfer_rows_are_the_arrays(stores):
    """Writes through a cache's torch view are the mx.array's contents, and only tensors it allocated map back."""
    transfer = fmlx.MLXTransfer()
    view = transfer.empty((3, 4), torch.float16)
    view[1] = 2.5
    assert np.array(transfer.array(view))[1].tolist() == [2.5] * 4
    assert transfer.array(None) is None and transfer.staged is False and transfer.nbytes == 0
    with pytest.raises(ValueError, match="not allocated by this MLXTransfer"):
        transfer.array(torch.zeros(3, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="not allocated by this MLXTransfer"):
        fmlx.MLXTransfer().array(view)


@pytest.fixture(scope="module")
def quantized_stores(stores, tmp_path_factory):
    """The Llama checkpoint of `stores` converted to q8 and q4 stores."""
    root = tmp_path_factory.mktemp("mlx_quantized")
    stores["llama_model"].save_pretrained(root / "ckpt")
    return {dtype: convert(root / "ckpt", root / dtype, dtype=dtype, progress=False) for dtype in ("q8", "q4")}


@pytest.mark.parametrize("dtype", ["q8", "q4"])
@pytest.mark.parametrize("mode,budget", [("naive", None), ("hybrid", "90%"), ("exact", "85%"), ("flash", "97%")])
def test_quantized_store_follows_the_torch_engine(quantized_stores, dtype, mode, budget):
    """Every FFN mode computes a quantized store's blocks (quantized_sparse_ffn on mx.arrays) and its resident
    weights held as blocks stay quantized (QuantizedArray): the torch engine's tokens (up to a near tie: its resident
    linears round x to int8), its caches holding uint8 rows. (A budget's FFN share differs between the two: the MLX engine holds its
    resident tensors dequantized, the torch engine in blocks; with none, naive mode reads what the torch one does.)"""
    from flashllm_ext.predictor import LowRankPredictor, PredictorSet

    path = quantized_stores[dtype]
    s = store.FlashStore(path)
    torch.manual_seed(3)
    predictors = (
        PredictorSet([LowRankPredictor(s.hidden_size, N_NEURONS, 8) for _ in range(s.n_layers)], torch.zeros(3))
        if mode == "flash"
        else None
    )
    prompt = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(4))
    options = dict(dram_budget=budget, mode=mode, predictors=predictors)
    reference = flashllm_ext.load_flash(path, dtype=torch.float32, **options)
    with torch.no_grad():
        want = _greedy(reference, prompt, 16)
    flash = fmlx.load_flash(path, dtype=torch.float32, **options)
    tokens = flash.generate(prompt, 16)
    got, ref = flash.stats(), reference.flash.stats()
    with torch.no_grad():  # the torch engine's resident linears round x to int8 per block, mlx's do not
        assert_tokens_agree(tokens, want, lambda ids: reference(torch.tensor([ids])).logits[0, -1], 2e-2)
    assert got["tokens"] == ref["tokens"] and got["bytes_read"] > 0
    if budget is None:
        assert got["bytes_read"] == ref["bytes_read"] and got["steps"] == ref["steps"]
    else:
        assert got["accounted_bytes"] <= got["budget_bytes"]
    if mode in ("exact", "flash"):
        assert all(f.matrix.dtype == mx.uint8 and f.matrix.shape[1] == s.row_bytes for f in flash.ffns)
    held = {name.removeprefix("model.") for name in s.resident_formats}  # the attention, embedding, LM head
    assert held and all(isinstance(flash.w[name], QuantizedArray) for name in held)
    flash.close()
    reference.flash.close()


def test_bad_input(stores, tmp_path):
    s, path = stores["llama-fp32"], stores["llama-fp32"].path
    with pytest.raises(ValueError, match="Llama family"):
        fmlx.load_flash(stores["opt-fp32"].path, mode="exact")
    with pytest.raises(ValueError, match="mode must be one of"):
        fmlx.load_flash(path, mode="fast")
    with pytest.raises(ValueError, match="below the minimum"):
        fmlx.load_flash(path, dram_budget="1%", mode="exact")
    with pytest.raises(ValueError, match="flash mode needs predictors"):
        fmlx.load_flash(path, mode="flash")
    with pytest.raises(ValueError, match="dtype must be"):
        fmlx.load_flash(path, mode="dense", dtype=torch.int8)
    model = fmlx.load_flash(path, mode="dense")
    for prompt, match in (
        ([], "non-empty"),
        ([1.5, 2.0], "integer"),
        ([[1, 2], [3, 4]], r"\[1, T\]"),
        ([3, 128], "vocab_size=128"),
        ([-1], "vocab_size"),
    ):
        with pytest.raises(ValueError, match=match):
            model.generate(prompt, 2)
    with pytest.raises(ValueError, match="non-negative int"):
        model.generate([1, 2], -1)
    ffn = fmlx.MLXFlashFFN(s, 0)
    with pytest.raises(ValueError, match="takes an mx.array"):
        ffn(torch.zeros(1, s.hidden_size))
    with pytest.raises(ValueError, match="hidden size"):
        ffn(mx.zeros((1, s.hidden_size + 1)))
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        ffn(mx.zeros((1, s.hidden_size), dtype=mx.int32))
    with pytest.raises(ValueError, match="must be an MLXTransfer"):
        fmlx.MLXFlashFFN(s, 0, transfer=HostTransfer())
    streaming = fmlx.load_flash(path, dram_budget=None, mode="naive")
    ffn, staging = streaming.ffns[0], streaming.ffns[0].staging
    with pytest.raises(ValueError, match="MLXStreamingFFN takes an mx.array"):
        ffn(torch.zeros(1, s.hidden_size))
    with pytest.raises(ValueError, match="hidden size"):
        ffn(mx.zeros((2, s.hidden_size - 1)))
    with pytest.raises(ValueError, match="must be an MLXTransfer"):
        fmlx.MLXStreamingFFN(s, 0, 0, staging, streaming.runtime.reader, transfer=HostTransfer())
    with pytest.raises(ValueError, match="not allocated by this MLXTransfer"):  # the staging is the engine's
        fmlx.MLXStreamingFFN(s, 0, 0, staging, streaming.runtime.reader, transfer=fmlx.MLXTransfer())
    streaming.close()


@pytest.mark.slow
def test_default_model_exact_mode_generates_the_tokens_of_transformers(default_model, tmp_path):
    """The real model (fp32 store): exact mode under a 75% budget gives transformers' 16 greedy tokens."""
    gguf, model, tokenizer = default_model
    path = convert(gguf, tmp_path / "store", dtype="fp32", progress=False)
    prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        want = _greedy(model, prompt, 16)
    flash = fmlx.load_flash(path, dram_budget="75%", mode="exact")
    assert flash.generate(prompt, 16) == want
    assert flash.stats()["accounted_bytes"] <= flash.stats()["budget_bytes"]
    flash.close()
