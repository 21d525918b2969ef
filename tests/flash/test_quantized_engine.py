"""The engines over quantized stores (q8, q4): every mode of load_flash and of the lean decoder computes the FFN from
the store's blocks (quantized_sparse_ffn), against transformers running the same dequantized weights, and charges
the budget the quantized bytes."""

import copy

import pytest
import torch

import flashllm_ext
from flashllm_ext.decoder.llama import fused_projections
from flashllm_ext.flash.convert import convert
from flashllm_ext.flash.store import FlashStore
from flashllm_ext.hub.hf import QuantizedEmbedding, QuantizedLinear, assign_resident, empty_model, replace_weights
from flashllm_ext.ops.blocks import QuantizedWeight, quantize_rows
from tests.helpers.models import assert_tokens_agree, tiny_model

ROLES = {"up": "up_proj", "gate": "gate_proj", "down": "down_proj"}
OPT_ROLES = {"up": "fc1", "down": "fc2"}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(family, dtype) -> (transformers model holding the store's weights as fp32, store path)."""
    root = tmp_path_factory.mktemp("quantized-engine")
    out = {}
    for family in ("llama", "opt"):
        model = tiny_model(family, num_hidden_layers=3, max_position_embeddings=256, hidden_size=64)
        model.save_pretrained(root / family)
        for dtype in ("q8", "q4"):
            path = convert(root / family, root / f"{family}-{dtype}", dtype=dtype, progress=False)
            out[family, dtype] = (_model_of_store(model, path), path)
    return out


def _model_of_store(model: torch.nn.Module, path) -> torch.nn.Module:
    """A copy of `model` holding exactly the store's weights: its resident tensors (fp16) and its FFN bundles
    dequantized, all as fp32."""
    twin = copy.deepcopy(model).float()
    with FlashStore(path) as store:
        weights = {name: t.float() for name, t in store.resident().items()}
        for layer in range(store.n_layers):
            weights.update({name: w.float() for name, w in store.ffn_weights(layer).items()})
    replace_weights(twin, {k: v for k, v in weights.items() if k in dict(twin.named_parameters())})
    return twin.eval()


def _greedy(model, prompt, n: int = 24):
    return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)


@pytest.mark.parametrize("family", ["llama", "opt"])
@pytest.mark.parametrize("dtype", ["q8", "q4"])
@pytest.mark.parametrize("mode", ["dense", "naive", "hybrid", "exact"])
@torch.no_grad()
def test_every_mode_computes_the_stores_weights(stores, family, dtype, mode):
    """The same greedy tokens as transformers on the dequantized weights, and logits within the rounding of x to
    int8 per block (every mode: the resident linears keep the store's blocks, as the FFN's rows do outside dense
    mode)."""
    reference, path = stores[family, dtype]
    prompt = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    flash = flashllm_ext.load_flash(path, dram_budget=None, mode=mode, dtype=torch.float32)
    want = reference(prompt).logits
    got = flash(prompt).logits
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    assert_tokens_agree(
        _greedy(flash, prompt)[0].tolist(),
        _greedy(reference, prompt)[0].tolist(),
        lambda ids: reference(torch.tensor([ids])).logits[0, -1],
        2e-2,
    )
    if mode != "dense":
        flash.flash.close()


@pytest.mark.parametrize("family", ["llama", "opt"])
@torch.no_grad()
def test_flash_caches_hold_the_quantized_rows_and_charge_their_bytes(stores, family):
    """A flash cache's rows are the store's uint8 blocks: the same budget holds ~3x the rows of an fp16 store's."""
    _, path = stores[family, "q4"]
    flash = flashllm_ext.load_flash(path, dram_budget="95%", mode="exact")
    try:
        stats = flash.flash.stats()
        assert stats["accounted_bytes"] <= stats["budget_bytes"]
        with FlashStore(path) as store:
            caches = [m.cache for m in flash.flash.modules]
            assert all(c.matrix.dtype == torch.uint8 and c.matrix.shape[1] == store.row_bytes for c in caches)
            assert store.row_bytes == store.bundle_format.row_bytes(store.hidden_size, store.glu)
            assert store.row_bytes < store.bundle_width * 2 / 1.8  # q4_0 up/gate + q8_0 down vs fp16 (d=48: padded)
    finally:
        flash.flash.close()


@pytest.mark.parametrize("family", ["llama", "opt"])
@torch.no_grad()
def test_load_flash_keeps_the_resident_blocks(stores, family):
    """load_flash's transformers model holds a quantized store's resident weights as the store does: every linear
    layer over blocks a QuantizedLinear (its bias kept), the embedding a QuantizedEmbedding, the budget charged
    their bytes, not their floats'."""
    _, path = stores[family, "q8"]
    flash = flashllm_ext.load_flash(path, dram_budget=None, mode="dense", dtype=torch.float32)
    with FlashStore(path) as store:
        blocks = {name.removeprefix("model.").removesuffix(".weight") for name in store.resident_formats}
    modules = {name.removeprefix("model."): m for name, m in flash.named_modules()}
    quantized = {name for name, m in modules.items() if isinstance(m, QuantizedLinear)}
    assert quantized == {name for name in blocks if not name.endswith("embed_tokens")} | {"lm_head"}  # (tied)
    embedding = flash.get_input_embeddings()
    assert isinstance(embedding, QuantizedEmbedding)
    kept = [modules[name] for name in quantized] + [embedding]
    columns = [m.in_features if isinstance(m, QuantizedLinear) else m.embedding_dim for m in kept]
    as_floats = sum(m.blocks.shape[0] * cols * 4 for m, cols in zip(kept, columns))
    assert sum(m.blocks.nbytes for m in kept) < as_floats / 3
    if family == "opt":  # OPT's projections have biases: kept beside the blocks
        q_proj = flash.get_submodule("model.decoder.layers.0.self_attn.q_proj")
        assert isinstance(q_proj, QuantizedLinear) and q_proj.bias is not None


def test_a_linear_over_blocks_without_its_bias_is_refused(stores):
    """A store missing the bias of a projection it holds as blocks is refused naming it (not a meta tensor later)."""
    _, path = stores["opt", "q8"]
    with FlashStore(path) as store:
        missing = "model.decoder.layers.0.self_attn.q_proj.bias"
        names = [n for n in store.resident_names() if n != missing]
        store.resident_names = lambda: names
        model = empty_model(store.config, torch.float32, store.path)
        with pytest.raises(ValueError, match="no tensor for model.decoder.layers.0.self_attn.q_proj.bias"):
            assign_resident(model, store, torch.float32, keep_blocks=True)


@pytest.mark.parametrize("bits", ["q8_0", "q4_0"])
def test_quantized_linear_adds_its_bias(bits):
    g = torch.Generator().manual_seed(0)
    weight = QuantizedWeight(quantize_rows(torch.randn(24, 64, generator=g), bits), bits, 64)
    bias, x = torch.randn(24, generator=g), torch.randn(2, 3, 64, generator=g)
    without = QuantizedLinear(weight)(x)
    torch.testing.assert_close(QuantizedLinear(weight, bias)(x), without + bias)


@pytest.mark.parametrize("family", ["llama", "opt"])
@pytest.mark.parametrize("mode", ["dense", "hybrid", "exact"])
@torch.no_grad()
def test_the_lean_decoder_runs_a_quantized_store(stores, family, mode):
    """Its attention, embedding and LM head stay in blocks (quantized_linear; the embedding's looked-up rows
    dequantized) and it is charged their bytes; its logits, over the prompt and each decode token, are transformers'
    on the dequantized weights."""
    reference, path = stores[family, "q8"]
    prompt = torch.randint(3, 90, (7,), generator=torch.Generator().manual_seed(3))
    decoder = flashllm_ext.load_decoder(path, dram_budget=None, mode=mode, dtype=torch.float32, max_len=64)
    try:
        layer = decoder.model.layers[0]
        assert isinstance(layer.qkv, QuantizedWeight) and isinstance(decoder.model.embedding, QuantizedWeight)
        with FlashStore(path) as store:
            assert decoder.model_bytes < sum(t.numel() * 4 for t in store.resident().values())  # not as floats
        ids = prompt
        logits = decoder.forward(prompt)
        for _ in range(4):  # the prompt, then decode tokens (Llama: the attention half one decoder_attention call)
            want = reference(ids.unsqueeze(0)).logits[0, -1]
            got = logits.reshape(-1, want.numel())[-1]
            torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
            token = int(want.argmax())
            ids = torch.cat((ids, torch.tensor([token])))
            logits = decoder.forward(torch.tensor([token]))
        if family == "llama":
            assert fused_projections(layer)[0][1] == "q8_0"
    finally:
        decoder.close()
