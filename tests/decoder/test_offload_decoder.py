"""The lean decoder over offload layer stores (flashllm_ext.decoder.offload): greedy tokens and logits equal to
transformers' in every offload mode and placement, a quantized store equal to load_offload's model on it, SSD layers
computed from views of the slot they were read into, the KV cache charged to the budget, clear refusals."""

import pytest
import torch

from flashllm_ext import endor
from flashllm_ext.decoder.model import model_table_bytes
from flashllm_ext.decoder.offload import load_offload_decoder
from flashllm_ext.io.checkpoint import TensorsCheckpoint
from flashllm_ext.offload import load_offload
from flashllm_ext.offload.convert import convert_offload
from flashllm_ext.offload.store import LayerStore
from tests.helpers.models import tiny_model

N_LAYERS = 4
N_NEW = 16


@pytest.fixture(scope="module", params=["llama", "opt"])
def case(request, tmp_path_factory):
    """A tiny model with 50%-pruned decoder-layer matrices (as Endor stores expect), its fp32 dense and Endor
    stores and its q8 store."""
    sizes = dict(hidden_size=128, num_hidden_layers=N_LAYERS, vocab_size=96, max_position_embeddings=64)
    ffn = {"intermediate_size": 352} if request.param == "llama" else {"ffn_dim": 352, "dropout": 0.0}
    model = tiny_model(request.param, **ffn, **sizes).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." in name and name.endswith(".weight") and p.dim() == 2:
                p.copy_(endor.prune(p, 0.5))
    ckpt = TensorsCheckpoint(model.config.to_dict(), {n: p.detach() for n, p in model.named_parameters()})
    root = tmp_path_factory.mktemp(request.param)
    stores = {
        "dense": convert_offload(ckpt, root / "dense", dtype="fp32", progress=False),
        "endor": convert_offload(ckpt, root / "endor", dtype="fp32", endor_compress=True, progress=False),
        "q8": convert_offload(ckpt, root / "q8", dtype="q8", progress=False),
    }
    return {"family": request.param, "model": model, **stores}


def _prompt(n: int = 11) -> torch.Tensor:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(3))


def _greedy(decoder, prompt: torch.Tensor, chunk: int = 4) -> list[int]:
    """N_NEW greedy tokens after the prompt (in chunks of `chunk`); the decoder's stats cover the decode tokens."""
    logits, tokens = decoder.prefill(prompt, chunk=chunk), []
    decoder.reset_stats()
    for _ in range(N_NEW):
        tokens.append(int(logits.argmax()))
        logits = decoder.forward([tokens[-1]])
    return tokens


@torch.no_grad()
def _transformers(model, prompt: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    out = model.generate(prompt[None], max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False)
    return out[0, prompt.numel() :].tolist(), model(prompt[None]).logits[0].float()


@pytest.mark.parametrize("mode", ["dense", "endor", "endor+more-resident"])
@pytest.mark.parametrize("in_memory", [0, 2, N_LAYERS])
def test_greedy_tokens_and_logits_equal_transformers(case, mode, in_memory):
    """32-bit stores hold the model's own values: in every mode and placement the prompt's logits (in chunks of 4
    tokens) match transformers' and 16 greedy tokens equal its own; every SSD layer's stored bytes are read once a
    token."""
    store = case["dense" if mode == "dense" else "endor"]
    prompt = _prompt()
    want_tokens, want_logits = _transformers(case["model"], prompt)
    decoder = load_offload_decoder(
        store, None, mode=mode, layers_in_memory=in_memory, max_len=64, kv_dtype=torch.float32, progress=False
    )
    try:
        logits = torch.cat([decoder.forward(part, all_logits=True) for part in prompt.split(4)])
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        decoder.reset()
        assert _greedy(decoder, prompt) == want_tokens
        stats = decoder.stats()
        layers = LayerStore(store)
        assert stats["layers_in_memory"] == in_memory and stats["family"] == case["model"].config.model_type
        ssd_bytes = sum(layers.stored_bytes(i) for i in range(in_memory, N_LAYERS))
        assert stats["bytes_read_per_token"] == ssd_bytes and stats["tokens"] == N_NEW
    finally:
        decoder.close()


@pytest.mark.parametrize("in_memory", [0, 2])
def test_quantized_store_computes_what_load_offload_computes(case, in_memory):
    """A q8 store's layers multiplied as stored (quantized_linear): the logits of transformers' model over the same
    store (load_offload) within the float16 activations' rounding, the same greedy tokens."""
    prompt = _prompt()
    model = load_offload(case["q8"], None, layers_in_memory=in_memory, progress=False)
    decoder = load_offload_decoder(case["q8"], None, layers_in_memory=in_memory, max_len=64, progress=False)
    try:
        tokens, logits = _transformers(model, prompt)
        got = decoder.forward(prompt, all_logits=True)
        torch.testing.assert_close(got, logits, rtol=2e-2, atol=2e-2 * logits.abs().max().item())
        decoder.reset()
        assert _greedy(decoder, prompt) == tokens
    finally:
        decoder.close()
        model.offload.close()


def test_ssd_layers_compute_from_views_of_their_slot(case):
    """A dense store's q, k and v (and the GLU's gate and up) lie back to back, so an SSD layer's fused matrices are
    views over the slot its bytes were read into: nothing is copied a token."""
    decoder = load_offload_decoder(case["dense"], None, layers_in_memory=1, max_len=64, progress=False)
    try:
        decoder.forward(_prompt(3))
        runtime, last = decoder.runtime, decoder.model.layers[-1]
        slot = runtime._slots[runtime.slot_of(N_LAYERS - 1)]
        first, end = slot.data_ptr(), slot.data_ptr() + slot.nbytes
        weights = [getattr(obj, name) for obj, name, _ in last.attributes]
        assert len(weights) == 4  # qkv, o, the FFN's in and out
        assert all(isinstance(w, torch.Tensor) and first <= w.data_ptr() < end for w in weights)
        ffn = decoder.ffns[-1]
        assert ffn.w_in.shape[0] == (2 if case["family"] == "llama" else 1) * 352
    finally:
        decoder.close()


def test_budget_charges_the_kv_cache(case):
    """The KV cache of max_len tokens (and the RoPE tables) is charged beside the weights: a budget that keeps one
    layer with a short cache keeps none with a long one; the accounted bytes stay within the budget."""
    short = load_offload_decoder(case["dense"], None, layers_in_memory=1, max_len=16, progress=False)
    budget = short.accounted_bytes
    short.close()
    decoder = load_offload_decoder(case["dense"], budget, max_len=16, progress=False)
    longer = load_offload_decoder(case["dense"], budget, max_len=64, progress=False)
    try:
        assert decoder.runtime.layers_in_memory == 1 and decoder.accounted_bytes <= budget
        assert longer.runtime.layers_in_memory == 0 and longer.accounted_bytes <= budget
        held = [d.cache.nbytes + model_table_bytes(d.model) for d in (decoder, longer)]
        assert longer.runtime.resident_bytes - decoder.runtime.resident_bytes == held[1] - held[0] > 0
    finally:
        decoder.close()
        longer.close()


def test_refusals_name_the_problem(case, tmp_path):
    """A budget below the minimum, an unknown mode and a directory that is no layer store are refused, naming it."""
    with pytest.raises(ValueError, match="below the minimum"):
        load_offload_decoder(case["dense"], 1000, max_len=64, progress=False)
    with pytest.raises(ValueError, match="mode"):
        load_offload_decoder(case["dense"], None, mode="flash", max_len=64, progress=False)
    with pytest.raises(FileNotFoundError, match="not a layer store"):
        load_offload_decoder(tmp_path, None, progress=False)
