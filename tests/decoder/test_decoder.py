"""The lean decoder (flashllm_ext.decoder) against transformers' own outputs: every family it runs (tiny random
configs, and the real default model), every engine mode, prompts longer than one chunk, the KV cache charged to the
budget, and clear refusals (an unknown family, a full cache, ids outside the vocabulary)."""

import pytest
import torch

import flashllm_ext
from flashllm_ext.decoder import DecoderConfig, StaticKVCache, load_decoder
from flashllm_ext.decoder.model import model_table_bytes
from flashllm_ext.flash.convert import convert
from flashllm_ext.predictor import LowRankPredictor, PredictorSet, calibrate_thresholds
from tests.helpers.models import tiny_model

N_NEW = 32
# family -> the tiny model's config changes: sliding windows short enough that 7 + 32 tokens pass them, OPT-350m's
# post-norm layers and narrower word embedding.
CASES = {
    "llama": dict(num_hidden_layers=3),
    "qwen2": dict(seed=1),
    "qwen3": dict(seed=2),
    "mistral": dict(sliding_window=8, seed=3),
    "qwen2-window": dict(family="qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1, seed=4),
    # Gemma: windows of 6, Gemma 2's soft caps low enough to bend the scores and logits, Gemma 3's global layer
    # with linearly scaled RoPE and its local layers with their own base
    "gemma2": dict(
        num_hidden_layers=3,
        sliding_window=6,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
        query_pre_attn_scalar=24,
        seed=6,
    ),
    "gemma3": dict(
        num_hidden_layers=3,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        },
        seed=7,
    ),
    "opt": dict(seed=1, max_position_embeddings=256, dropout=0.0),
    "opt-post-norm": dict(
        family="opt", seed=5, max_position_embeddings=256, do_layer_norm_before=False, word_embed_proj_dim=32
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """case -> (transformers model, fp32 store path)."""
    root = tmp_path_factory.mktemp("decoder")
    out = {}
    for name, config in CASES.items():
        config = dict(config)
        family = config.pop("family", name)
        model = tiny_model(family, **config)
        model.save_pretrained(root / name)
        out[name] = (model, convert(root / name, root / f"{name}-fp32", dtype="fp32", progress=False))
    return out


def _prompt(n: int = 7, vocab: int = 90) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(2))


@torch.no_grad()
def _transformers_greedy(model, prompt: torch.Tensor, n: int = N_NEW) -> list[int]:
    out = model.generate(prompt[None], max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, prompt.numel() :].tolist()


def _greedy(decoder, prompt: torch.Tensor, n: int = N_NEW, chunk: int = 256) -> list[int]:
    logits, tokens = decoder.prefill(prompt, chunk=chunk), []
    for _ in range(n):
        tokens.append(int(logits.argmax()))
        logits = decoder.forward([tokens[-1]])
    return tokens


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["dense", "exact"])
def test_greedy_tokens_and_logits_equal_transformers(models, case, mode):
    model, path = models[case]
    prompt = _prompt()
    decoder = load_decoder(path, None, mode=mode, max_len=64, kv_dtype=torch.float32)
    with torch.no_grad():
        want_logits = model(prompt[None]).logits[0]
    torch.testing.assert_close(decoder.forward(prompt, all_logits=True), want_logits, rtol=1e-4, atol=1e-4)
    decoder.reset()
    assert _greedy(decoder, prompt) == _transformers_greedy(model, prompt)
    assert decoder.length == prompt.numel() + N_NEW
    decoder.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.parametrize("case", ["llama", "qwen3", "opt"])
@pytest.mark.parametrize("mode", ["dense", "hybrid"])
def test_the_decoder_on_cuda_decodes_what_it_decodes_on_the_cpu(models, case, mode):
    """The same store on the GPU (weights resident, or streamed to it layer by layer): the CPU's logits and tokens.
    Hybrid's budget leaves room for the pinned read staging a GPU adds (at 100% of the weights it does not fit)."""
    _, path = models[case]
    prompt = _prompt()
    budget = None if mode == "dense" else "150%"
    cpu = load_decoder(path, budget, mode=mode, max_len=64, kv_dtype=torch.float32)
    gpu = load_decoder(path, budget, mode=mode, max_len=64, kv_dtype=torch.float32, device="cuda")
    want = cpu.forward(prompt, all_logits=True)
    torch.testing.assert_close(gpu.forward(prompt, all_logits=True).cpu(), want, rtol=1e-3, atol=1e-3)
    cpu.reset()
    gpu.reset()
    assert _greedy(gpu, prompt) == _greedy(cpu, prompt)
    cpu.close()
    gpu.close()


@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
@pytest.mark.parametrize("mode", ["dense", "exact"])
def test_every_decode_step_equals_transformers(models, case, mode):
    """Token by token past the sliding window (decode's soft-capped attention and local RoPE): each step's logits are
    transformers' logits at that position of the whole sequence."""
    model, path = models[case]
    ids = _prompt(20)
    decoder = load_decoder(path, None, mode=mode, max_len=64, kv_dtype=torch.float32)
    got = torch.stack([decoder.forward([int(token)]) for token in ids])
    with torch.no_grad():
        torch.testing.assert_close(got, model(ids[None]).logits[0], rtol=1e-4, atol=1e-4)
    decoder.close()


@pytest.mark.parametrize("case", ["llama", "mistral", "gemma2", "opt"])
def test_a_prompt_longer_than_one_chunk(models, case):
    model, path = models[case]
    prompt = _prompt(19)
    decoder = load_decoder(path, None, mode="dense", max_len=64, kv_dtype=torch.float32)
    assert _greedy(decoder, prompt, chunk=4) == _transformers_greedy(model, prompt)


@pytest.mark.parametrize("case", ["llama", "gemma3", "opt"])
@pytest.mark.parametrize("mode", ["naive", "hybrid"])
def test_streaming_modes_equal_transformers(models, case, mode):
    model, path = models[case]
    prompt = _prompt()
    decoder = load_decoder(path, "100%", mode=mode, max_len=40, kv_dtype=torch.float32)
    assert _greedy(decoder, prompt) == _transformers_greedy(model, prompt)
    stats = decoder.stats()
    assert stats["mode"] == mode and stats["tokens"] == prompt.numel() + N_NEW
    assert stats["bytes_read"] > 0 and stats["accounted_bytes"] <= stats["budget_bytes"]
    assert stats["ms_per_token"] > 0 and stats["other_ms"] > 0


@pytest.mark.parametrize("case", ["llama", "gemma2"])
def test_flash_mode_computes_what_load_flash_computes(models, case):
    """The same store, predictors and budget: the lean decoder's FFNs are the engine's, so its tokens are those of
    the transformers model load_flash builds."""
    model, path = models[case]
    ids = torch.randint(0, 90, (64,), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    thresholds = calibrate_thresholds(model, ids, 0.5, window=32, progress=False)
    c = model.config
    predictors = PredictorSet(
        [LowRankPredictor(c.hidden_size, c.intermediate_size, 8) for _ in range(c.num_hidden_layers)], thresholds
    )
    prompt = _prompt()
    hf = flashllm_ext.load_flash(path, "90%", mode="flash", predictors=predictors)
    with torch.no_grad():
        want = hf.generate(prompt[None], max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False)
    decoder = load_decoder(path, "90%", mode="flash", predictors=predictors, max_len=64, kv_dtype=torch.float32)
    assert _greedy(decoder, prompt) == want[0, prompt.numel() :].tolist()
    assert decoder.stats()["hit_rate"] > 0


def test_lookahead_prefetch_keeps_the_results(models):
    model, path = models["llama"]
    prompt = _prompt()
    decoder = load_decoder(path, None, mode="exact", lookahead="prefetch", max_len=64, kv_dtype=torch.float32)
    assert _greedy(decoder, prompt) == _transformers_greedy(model, prompt)


def test_the_kv_cache_is_charged_to_the_budget(models):
    _, path = models["llama"]
    small = load_decoder(path, "85%", mode="naive", max_len=16)
    large = load_decoder(path, "85%", mode="naive", max_len=64)
    kv = StaticKVCache.bytes_for(3, 64 - 16, 2, 16, torch.float16)
    assert large.stats()["kv_bytes"] - small.stats()["kv_bytes"] == kv
    tables = model_table_bytes(large.model) - model_table_bytes(small.model)  # RoPE tables sized by max_len too
    assert large.runtime.resident_bytes - small.runtime.resident_bytes == kv + tables
    assert large.stats()["accounted_bytes"] <= large.stats()["budget_bytes"]
    with pytest.raises(ValueError, match="minimum"):  # a cache that leaves no room for one bundle per layer
        load_decoder(path, "85%", mode="naive", max_len=100_000)


def test_gemma3_charges_its_local_and_global_rope_tables(models):
    """Two RoPE bases, two tables, both held and both charged: weight bytes leave them out, accounted bytes not."""
    _, path = models["gemma3"]
    decoder = load_decoder(path, None, mode="dense", max_len=32)
    model = decoder.model
    assert model.local_rotary is not None and not torch.equal(model.local_rotary.cos, model.rotary.cos)
    assert model_table_bytes(model) == 2 * model.rotary.nbytes
    assert [layer.local_rotary is not None for layer in model.layers] == [True, False, True]
    decoder.close()


def test_a_family_the_decoder_does_not_run_is_refused_by_name():
    with pytest.raises(ValueError, match="'phi3'"):
        DecoderConfig.from_config({"model_type": "phi3", "hidden_size": 8}, "store")
    llama = {
        "model_type": "llama",
        "hidden_size": 8,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": 10,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
    }
    with pytest.raises(ValueError, match="'yarn'"):
        DecoderConfig.from_config(llama, "store")
    with pytest.raises(ValueError, match="store: activation 'gelu_fast' is not supported"):
        DecoderConfig.from_config({**llama, "rope_scaling": None, "hidden_act": "gelu_fast"}, "store")


def test_gemma_configs_before_layer_types_and_per_type_rope():
    """Configs written before transformers 5: Gemma 2's even layers slide, Gemma 3's every sixth layer is global and
    its local layers rotate with rope_local_base_freq; a local RoPE scaling is refused by name."""
    shape = dict(hidden_size=8, num_attention_heads=2, num_hidden_layers=7, vocab_size=10, head_dim=4)
    shape.update(query_pre_attn_scalar=16, sliding_window=3, hidden_activation="gelu_pytorch_tanh")
    gemma2 = DecoderConfig.from_config(dict(shape, model_type="gemma2", attn_logit_softcapping=50.0), "store")
    assert gemma2.windows == (3, None, 3, None, 3, None, 3) and gemma2.attention_softcap == 50.0
    assert gemma2.local_rope_theta is None and gemma2.hidden_act == "gelu_tanh" and gemma2.attention_scale == 0.25
    old = dict(shape, model_type="gemma3_text", rope_theta=1e6, rope_local_base_freq=1e4)
    gemma3 = DecoderConfig.from_config(dict(old, rope_scaling={"rope_type": "linear", "factor": 8.0}), "store")
    assert gemma3.windows == (3, 3, 3, 3, 3, None, 3) and (gemma3.rope_theta, gemma3.local_rope_theta) == (1e6, 1e4)
    assert gemma3.rope_scaling["factor"] == 8.0 and gemma3.qk_norm and gemma3.tie_embeddings
    local_yarn = {"sliding_attention": {"rope_type": "yarn"}, "full_attention": {"rope_theta": 1e6}}
    with pytest.raises(ValueError, match="'yarn'"):
        DecoderConfig.from_config(dict(old, rope_parameters=local_yarn), "store")


def test_a_full_cache_and_bad_ids_are_refused(models):
    _, path = models["llama"]
    decoder = load_decoder(path, None, mode="dense", max_len=8)
    decoder.forward(list(range(8)))
    with pytest.raises(ValueError, match="no room for 1 more"):
        decoder.forward([1])
    decoder.reset()
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 128\)"):
        decoder.forward([128])
    with pytest.raises(ValueError, match="at least one"):
        decoder.forward([])


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    model = tiny_model("llama", rope_scaling=scaling, seed=6)
    model.save_pretrained(tmp_path / "hf")
    decoder = load_decoder(
        convert(tmp_path / "hf", tmp_path / "store", dtype="fp32", progress=False),
        None,
        mode="dense",
        max_len=64,
        kv_dtype=torch.float32,
    )
    prompt = _prompt(30)
    with torch.no_grad():
        want = model(prompt[None]).logits[0]
    torch.testing.assert_close(decoder.forward(prompt, all_logits=True), want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def default_store(default_model, tmp_path_factory):
    gguf, _, _ = default_model
    return convert(gguf, tmp_path_factory.mktemp("default") / "store", dtype="fp16", progress=False)


def test_the_default_model_decodes_the_tokens_of_transformers(default_store):
    """The real default model from its fp16 store, with the decoder's defaults (an fp16 KV cache): the same 32
    greedy tokens as transformers running the store's weights in float32."""
    reference = flashllm_ext.load_flash(default_store, mode="dense", dtype=torch.float32)
    prompt = torch.tensor([1, 504, 3458, 282, 4649, 314, 1345, 28, 253, 1052, 1156])
    decoder = load_decoder(default_store, mode="dense")
    assert _greedy(decoder, prompt) == _transformers_greedy(reference, prompt)
