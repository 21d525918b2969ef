"""Hugging Face models decoding with the KV cache on storage: batched greedy generate() gives the tokens of dense
transformers (tiny random Llama with GQA and OPT; the real default model, slow)."""

import pytest
import torch

from flashllm_ext.kv import hf

pytest.importorskip("transformers")
from tests.helpers.models import tiny_model  # noqa: E402  (after the skip: imports transformers)


def tiny(kind):
    if kind == "llama":
        return tiny_model("llama", vocab_size=97, intermediate_size=128, max_position_embeddings=128)
    return tiny_model("opt", vocab_size=97, hidden_size=64, ffn_dim=128, max_position_embeddings=128)


@pytest.mark.parametrize("model_kind", ["llama", "opt"])
@pytest.mark.parametrize("backend_kind", ["near_storage", "baseline"])
@pytest.mark.parametrize("prompt", [1, 7])
def test_tiny_generate_equals_transformers(tmp_path, model_kind, backend_kind, prompt):
    model = tiny(model_kind)
    ids = torch.randint(3, 97, (3, prompt), generator=torch.Generator().manual_seed(1))
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9, do_sample=False)
    kwargs = {"processes": False} if backend_kind == "near_storage" else {}
    with hf.storage_attention(
        model, [tmp_path / "a", tmp_path / "b"], batch=3, max_tokens=32, kind=backend_kind, writeback=4, **kwargs
    ) as backend:
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
    with hf.storage_attention(
        model, [tmp_path / "a", tmp_path / "b"], batch=2, max_tokens=16, processes=True, timeout_s=300
    ) as backend:
        assert torch.equal(hf.generate(model, ids, backend, max_new_tokens=6, do_sample=False), ref)


def left_padded(prompts, pad=0):
    """What a tokenizer with padding_side="left" returns: (input_ids, attention_mask)."""
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad)
    mask = torch.zeros(len(prompts), n, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, n - len(p) :] = p
        mask[b, n - len(p) :] = 1
    return ids, mask


@pytest.mark.parametrize("model_kind", ["llama", "opt"])
@pytest.mark.parametrize("backend_kind, x_cache", [("near_storage", 0), ("baseline", 0), ("near_storage", 2)])
def test_padded_batch_equals_per_prompt_transformers(tmp_path, model_kind, backend_kind, x_cache):
    """Prompts of 9, 2, 5 and 1 tokens, left-padded in one batch: each sequence's greedy tokens are those of the
    prompt alone through transformers (the pad tokens are stored but never attended, positions skip them)."""
    model = tiny(model_kind)
    model.generation_config.eos_token_id = None  # every sequence runs the full length, so rows compare whole
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 97, (n,), generator=g) for n in (9, 2, 5, 1)]
    ids, mask = left_padded(prompts)
    refs = [
        model.generate(
            p[None], attention_mask=torch.ones(1, len(p), dtype=torch.int64), max_new_tokens=8, do_sample=False
        )[0, len(p) :]
        for p in prompts
    ]
    kwargs = {"processes": False} if backend_kind == "near_storage" else {}
    # writeback 3 with block_tokens 4: the padding spans disk blocks, a block boundary and the buffer
    if backend_kind == "near_storage":
        kwargs["block_tokens"] = 4
    with hf.storage_attention(
        model,
        [tmp_path / "a", tmp_path / "b"],
        batch=4,
        max_tokens=32,
        kind=backend_kind,
        writeback=3,
        x_cache=x_cache,
        **kwargs,
    ) as backend:
        out = hf.generate(model, ids, backend, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        for b, ref in enumerate(refs):
            assert torch.equal(out[b, ids.shape[1] :], ref), b
        # the next batch is unpadded again (reset forgets the padding)
        same = torch.stack([prompts[0], prompts[0].flip(0)])
        if backend.batch == 2:
            assert torch.equal(
                hf.generate(model, same, backend, max_new_tokens=4, do_sample=False),
                model.generate(same, max_new_tokens=4, do_sample=False),
            )


def test_padded_batch_with_worker_processes(tmp_path):
    model = tiny("llama")
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 97, (n,), generator=g) for n in (3, 7)]
    ids, mask = left_padded(prompts)
    with hf.storage_attention(
        model, [tmp_path / "a", tmp_path / "b"], batch=2, max_tokens=16, processes=True, timeout_s=300
    ) as backend:
        out = hf.generate(model, ids, backend, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    for b, p in enumerate(prompts):
        ref = model.generate(p[None], max_new_tokens=6, do_sample=False)[0, len(p) :]
        assert torch.equal(out[b, ids.shape[1] :], ref)


def test_bad_masks_and_batch_mismatch_are_refused(tmp_path):
    model = tiny("llama")
    ids = torch.randint(3, 97, (2, 5))
    with hf.storage_attention(model, [tmp_path / "a"], batch=2, max_tokens=16, processes=False) as backend:
        for row, message in (
            ([1, 1, 1, 1, 0], "on the left"),
            ([0, 1, 0, 1, 1], "on the left"),
            ([0, 0, 0, 0, 0], "all padding"),
            ([2, 1, 1, 1, 1], "0 .padding. and 1"),
        ):
            mask = torch.ones_like(ids)
            mask[1] = torch.tensor(row)
            with pytest.raises(ValueError, match=message):
                hf.generate(model, ids, backend, attention_mask=mask, max_new_tokens=2)
        with pytest.raises(ValueError, match="like input_ids"):
            hf.generate(model, ids, backend, attention_mask=torch.ones(2, 4), max_new_tokens=2)
        with pytest.raises(ValueError, match="batch of 3"):
            hf.generate(model, torch.randint(3, 97, (3, 5)), backend, max_new_tokens=2)
        with pytest.raises(ValueError, match="starts must be 2"):
            backend.set_starts([1, 2, 3])
    with pytest.raises(ValueError, match="kind must be"):
        hf.storage_attention(model, [tmp_path / "a"], batch=2, max_tokens=16, kind="nope")


@pytest.mark.slow
def test_default_model_batched_greedy_equals_transformers(tmp_path, default_model):
    """Prompts of different lengths, left-padded by the tokenizer, in one batch: each sequence's greedy tokens are
    those of dense transformers on the prompt alone."""
    _, model, tokenizer = default_model
    prompts = ["The capital of France is", "Water boils at a temperature of", "Hi"]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert not bool(batch.attention_mask.all())  # the lengths differ: the batch is padded
    with hf.storage_attention(
        model, [tmp_path / "dev0", tmp_path / "dev1"], batch=3, max_tokens=batch.input_ids.shape[1] + 8, processes=False
    ) as backend:
        out = hf.generate(
            model,
            batch.input_ids,
            backend,
            attention_mask=batch.attention_mask,
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    for b, prompt in enumerate(prompts):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        got = out[b, batch.input_ids.shape[1] : batch.input_ids.shape[1] + ref.shape[1] - ids.shape[1]]
        assert torch.equal(got, ref[0, ids.shape[1] :]), (tokenizer.decode(got), tokenizer.decode(ref[0]))


@pytest.mark.parametrize("model_kind", ["llama", "opt"])
def test_tiny_generate_with_xcache_equals_transformers(tmp_path, model_kind):
    """Two of three sequences keep X: their K/V are regenerated (k_proj, v_proj, biases, RoPE) every step."""
    model = tiny(model_kind)
    ids = torch.randint(3, 97, (3, 6), generator=torch.Generator().manual_seed(3))
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9, do_sample=False)
    with hf.storage_attention(
        model, [tmp_path / "a"], batch=3, max_tokens=32, x_cache=2, processes=False, writeback=2
    ) as backend:
        assert torch.equal(hf.generate(model, ids, backend, max_new_tokens=9, do_sample=False), ref)
        assert backend.traffic.total().x_bytes > 0
