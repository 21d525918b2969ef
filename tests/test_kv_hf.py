"""Hugging Face models decoding with the KV cache on storage: batched greedy generate() gives the tokens of dense
transformers (tiny random Llama with GQA and OPT; the real default model, slow)."""
import pytest
import torch

from flashllm_ext.kv import hf

transformers = pytest.importorskip("transformers")


def tiny(kind):
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        return transformers.LlamaForCausalLM(config).eval()
    config = transformers.OPTConfig(vocab_size=97, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=64)
    return transformers.OPTForCausalLM(config).eval()


@pytest.mark.parametrize("model_kind", ["llama", "opt"])
@pytest.mark.parametrize("backend_kind", ["near_storage", "baseline"])
@pytest.mark.parametrize("prompt", [1, 7])
def test_tiny_generate_equals_transformers(tmp_path, model_kind, backend_kind, prompt):
    model = tiny(model_kind)
    ids = torch.randint(3, 97, (3, prompt), generator=torch.Generator().manual_seed(1))
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9, do_sample=False)
    kwargs = {"processes": False} if backend_kind == "near_storage" else {}
    with hf.storage_attention(model, [tmp_path / "a", tmp_path / "b"], batch=3, max_tokens=32, kind=backend_kind,
                              writeback=4, **kwargs) as backend:
        out = hf.generate(model, ids, backend, max_new_tokens=9, do_sample=False)
        assert torch.equal(out, ref)
        # the prompt went to storage in bulk (a 1-token prompt goes with the first step), then one step per token
        steps = backend.traffic.steps()
        assert len(steps) == (8 if prompt > 1 else 9)
        # a second generate on the same backend starts from an empty store
        again = hf.generate(model, ids, backend, max_new_tokens=9, do_sample=False)
        assert torch.equal(again, ref)
    assert model.config._attn_implementation != hf.ATTN_NAME  # restored


def test_generate_with_worker_processes(tmp_path):
    model = tiny("llama")
    ids = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(2))
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    with hf.storage_attention(model, [tmp_path / "a", tmp_path / "b"], batch=2, max_tokens=16,
                              processes=True, timeout_s=300) as backend:
        assert torch.equal(hf.generate(model, ids, backend, max_new_tokens=6, do_sample=False), ref)


def test_padding_and_batch_mismatch_are_refused(tmp_path):
    model = tiny("llama")
    ids = torch.randint(3, 97, (2, 5))
    with hf.storage_attention(model, [tmp_path / "a"], batch=2, max_tokens=16, processes=False) as backend:
        mask = torch.ones_like(ids)
        mask[0, 0] = 0
        with pytest.raises(ValueError, match="padded batches"):
            hf.generate(model, ids, backend, attention_mask=mask, max_new_tokens=2)
        with pytest.raises(ValueError, match="batch of 3"):
            hf.generate(model, torch.randint(3, 97, (3, 5)), backend, max_new_tokens=2)
    with pytest.raises(ValueError, match="kind must be"):
        hf.storage_attention(model, [tmp_path / "a"], batch=2, max_tokens=16, kind="nope")


@pytest.mark.slow
def test_default_model_batched_greedy_equals_transformers(tmp_path, default_model):
    _, model, tokenizer = default_model
    prompts = ["The capital of France is", "Water boils at a temperature of"]
    rows = [tokenizer(p).input_ids for p in prompts]
    n = min(len(r) for r in rows)
    ids = torch.tensor([r[:n] for r in rows])  # the same length: no padding
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    with hf.storage_attention(model, [tmp_path / "dev0", tmp_path / "dev1"], batch=2, max_tokens=n + 8,
                              processes=False) as backend:
        out = hf.generate(model, ids, backend, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, ref), (tokenizer.batch_decode(out), tokenizer.batch_decode(ref))


@pytest.mark.parametrize("model_kind", ["llama", "opt"])
def test_tiny_generate_with_xcache_equals_transformers(tmp_path, model_kind):
    """Two of three sequences keep X: their K/V are regenerated (k_proj, v_proj, biases, RoPE) every step."""
    model = tiny(model_kind)
    ids = torch.randint(3, 97, (3, 6), generator=torch.Generator().manual_seed(3))
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9, do_sample=False)
    with hf.storage_attention(model, [tmp_path / "a"], batch=3, max_tokens=32, x_cache=2, processes=False,
                              writeback=2) as backend:
        assert torch.equal(hf.generate(model, ids, backend, max_new_tokens=9, do_sample=False), ref)
        assert backend.traffic.total().x_bytes > 0
