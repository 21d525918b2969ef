"""Mixture-of-experts models on the lean decoder (flashllm_ext.decoder.moe routes, flashllm_ext.flash.experts reads):
Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE and OLMoE converted to expert stores, decoded in every mode and
cache policy against transformers' own tokens and logits (the router is exact, so every mode computes the same
model), budgets charged and refused below one expert a layer, and stores that lie refused."""

import json
import re
import shutil
from functools import partial

import pytest
import torch

import flashllm_ext
from flashllm_ext import FormatError
from flashllm_ext.decoder import load_decoder
from flashllm_ext.flash.convert import convert
from flashllm_ext.flash.store import BUNDLES_FILE, FlashStore
from tests.helpers.checkpoints import rewrite_header
from tests.helpers.models import tiny_model

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
N_NEW = 32
# (mode, policy, expert slots a layer the budget is sized for (None: no budget), lookahead)
RUNS = [
    ("dense", "lru", None, None),
    ("naive", "lru", 2, None),
    ("flash", "lru", 3, None),
    ("flash", "lfu", 3, None),
    ("flash", "window", 3, None),
    ("flash", "lru", 1, None),  # fewer slots than a token's experts: each forward reads in rounds
    ("flash", "lru", 3, "ahead"),  # each layer reads the experts the next layer's router guesses
]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """family -> (transformers model, fp32 expert store path)."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for seed, family in enumerate(FAMILIES):
        model = tiny_model(family, seed=seed)
        model.save_pretrained(root / family)
        out[family] = (model, convert(root / family, root / f"{family}-store", dtype="fp32", progress=False))
    return out


def _prompt(n: int = 7) -> torch.Tensor:
    return torch.randint(3, 120, (n,), generator=torch.Generator().manual_seed(2))


def _minimum_budget(path, mode: str, load=None) -> int:
    """The least budget `mode` takes on the store at `path` (in load_decoder, or in `load(path, budget, mode=)`),
    as its refusal of a 1000-byte budget names it."""
    load = load or partial(load_decoder, max_len=64, kv_dtype=torch.float32)
    with pytest.raises(ValueError, match="below the minimum") as info:
        load(path, 1000, mode=mode)
    return int(re.search(r"minimum of (\d+)", str(info.value)).group(1))


def _budget(path, mode: str, slots: int | None, load=None) -> int | None:
    """A budget of `slots` experts a layer (one more expert's bytes would add a slot to every layer)."""
    if slots is None:
        return None
    store = FlashStore(path)
    expert_bytes = store.experts.size * store.row_bytes
    return _minimum_budget(path, mode, load) + (slots - 1) * store.n_layers * expert_bytes + 64


@torch.no_grad()
def _transformers_run(model, prompt: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    out = model.generate(prompt[None], max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False)
    return out[0, prompt.numel() :].tolist(), model(prompt[None]).logits[0]


def _decode(decoder, prompt: torch.Tensor, chunk: int = 256) -> tuple[list[int], torch.Tensor]:
    prompt_logits = torch.cat([decoder.forward(part, all_logits=True) for part in prompt.split(chunk)])
    logits, tokens = prompt_logits[-1], []
    for _ in range(N_NEW):
        tokens.append(int(logits.argmax()))
        logits = decoder.forward([tokens[-1]])
    return tokens, prompt_logits


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode,policy,slots,lookahead", RUNS)
def test_every_mode_and_policy_decodes_the_tokens_of_transformers(moe_models, family, mode, policy, slots, lookahead):
    model, path = moe_models[family]
    prompt = _prompt()
    want_tokens, want_logits = _transformers_run(model, prompt)
    budget = _budget(path, mode, slots)
    decoder = load_decoder(
        path, budget, mode=mode, expert_policy=policy, window=1, max_len=64, kv_dtype=torch.float32, lookahead=lookahead
    )
    try:
        tokens, logits = _decode(decoder, prompt, chunk=3)
        stats = decoder.stats()
        capacity = decoder.runtime.modules[0].cache.capacity
    finally:
        decoder.close()
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    if budget is not None:
        assert stats["accounted_bytes"] <= budget
        assert capacity == (min(slots, 2) if policy == "window" else slots)  # window: its 1 token x top_k 2
    if mode == "dense":
        assert stats["experts_read_per_layer"] == 0 and stats["hit_rate"] == 1.0
    if mode == "naive":  # every forward reads its experts: a decode token's top_k (2) distinct ones
        assert stats["hit_rate"] == 0.0
    if mode == "flash" and slots == 3:
        assert 0 < stats["hit_rate"] < 1 and stats["expert_policy"] == policy
    if lookahead:  # every decode token read ahead; the guess names some of the experts the routers then chose
        assert stats["experts_read_ahead_per_layer"] > 0 and 0 < stats["ahead_recall"] <= 1
        assert stats["hidden_io_ms"] >= 0
    else:
        assert stats["ahead_recall"] is None


def test_naive_mode_reads_each_decode_token_s_experts_once(moe_models):
    _, path = moe_models["qwen3_moe"]
    store = FlashStore(path)
    decoder = load_decoder(path, _budget(path, "naive", 2), mode="naive", max_len=64, kv_dtype=torch.float32)
    try:
        decoder.prefill(_prompt())
        decoder.reset_stats()
        for token in (5, 9, 11):
            decoder.forward([token])
        stats = decoder.stats()
    finally:
        decoder.close()
    expert_bytes = store.experts.size * store.row_bytes
    assert stats["experts_read_per_layer"] == 2.0
    assert stats["requested_bytes_per_token"] == 2 * store.n_layers * expert_bytes


def test_a_budget_below_one_expert_a_layer_is_refused_naming_the_minimum(moe_models):
    _, path = moe_models["mixtral"]
    minimum = _minimum_budget(path, "flash")
    with pytest.raises(ValueError, match=f"minimum of {minimum} for flash mode"):
        load_decoder(path, minimum - 1, mode="flash", max_len=64, kv_dtype=torch.float32)
    load_decoder(path, minimum, mode="flash", max_len=64, kv_dtype=torch.float32).close()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(mode="hybrid"), "modes"),
        (dict(mode="flash", expert_policy="fifo"), "expert policy"),
        (dict(mode="naive", lookahead="ahead"), "flash mode only"),
        (dict(mode="flash", lookahead="prefetch"), "flash mode only"),
    ],
)
def test_what_an_moe_store_does_not_run_is_refused(moe_models, kwargs, match):
    _, path = moe_models["olmoe"]
    with pytest.raises(ValueError, match=match):
        load_decoder(path, None, max_len=64, **kwargs)


# each family in one mode: the experts' modes and policies are the lean decoder's tests' (the same ExpertFFN)
@pytest.mark.parametrize(
    "family,mode,policy,slots",
    [
        ("mixtral", "dense", "lru", None),
        ("qwen2_moe", "naive", "lru", 2),
        ("qwen3_moe", "flash", "lfu", 3),
        ("olmoe", "flash", "lru", 1),
    ],
)
def test_load_flash_serves_an_moe_store_as_transformers_computes_it(moe_models, family, mode, policy, slots):
    """The transformers model load_flash builds keeps each block's router and shared expert; its experts come from
    the store's caches within the budget, so generate() gives transformers' own tokens."""
    model, path = moe_models[family]
    prompt = _prompt()
    want_tokens, want_logits = _transformers_run(model, prompt)
    budget = _budget(path, mode, slots, load=partial(flashllm_ext.load_flash, expert_policy=policy))
    served = flashllm_ext.load_flash(path, budget, mode=mode, expert_policy=policy)
    try:
        tokens, logits = _transformers_run(served, prompt)
        stats = served.flash.stats()
    finally:
        served.flash.close()
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    if budget is not None:
        assert stats["accounted_bytes"] <= budget
    assert stats["hit_rate"] == {"dense": 1.0, "naive": 0.0}.get(mode, stats["hit_rate"])
    assert 0 < stats["experts_needed_per_layer"]


def test_experts_called_one_at_a_time_are_refused():
    """transformers 4 kept an MoE block's experts as a ModuleList, called per expert: not the call StoreExperts
    answers."""
    from torch import nn

    from flashllm_ext.flash.expert_blocks import expert_blocks

    model = tiny_model("olmoe")
    model.model.layers[0].mlp.experts = nn.ModuleList()
    with pytest.raises(ValueError, match="transformers >= 5"):
        expert_blocks(model)


def test_what_load_flash_does_not_run_on_an_moe_store_is_refused(moe_models):
    model, path = moe_models["mixtral"]
    with pytest.raises(ValueError, match="without look-ahead"):
        flashllm_ext.load_flash(path, None, mode="flash", lookahead="ahead")
    with pytest.raises(ValueError, match="expert policy"):
        flashllm_ext.load_flash(path, None, mode="flash", expert_policy="fifo")
    with pytest.raises(ValueError, match="mixture-of-experts store"):  # the neuron engine's FFNs cannot serve it
        flashllm_ext.patch_flash(model, path, mode="naive")


def test_the_store_holds_each_expert_as_one_contiguous_range(moe_models):
    model, path = moe_models["qwen2_moe"]
    store = FlashStore(path)
    assert (store.experts.count, store.experts.size) == (8, 48)
    expert = model.model.layers[1].mlp.experts
    e = 5
    rows = store.bundle(1, list(store.experts.rows(e)))
    gate_up, down = expert.gate_up_proj[e], expert.down_proj[e]  # [2 * size, d] (gate first), [d, size]
    d = store.hidden_size
    torch.testing.assert_close(rows[:, :d], gate_up[48:], rtol=0, atol=0)  # up
    torch.testing.assert_close(rows[:, d : 2 * d], gate_up[:48], rtol=0, atol=0)  # gate
    torch.testing.assert_close(rows[:, 2 * d :], down.t(), rtol=0, atol=0)
    resident = set(store.resident_names())
    assert "model.layers.1.mlp.shared_expert.up_proj.weight" in resident
    assert not any(".experts." in name for name in resident)


@pytest.mark.parametrize(
    "experts,match",
    [
        ('{"count": 8, "size": 47}', "n_neurons"),
        ('{"count": 0, "size": 48}', "count"),
        ('{"count": 8}', "count"),
        ("[8, 48]", "count"),
    ],
)
def test_an_expert_layout_that_lies_raises_format_error(moe_models, tmp_path, experts, match):
    _, path = moe_models["qwen3_moe"]
    copy = shutil.copytree(path, tmp_path / "copy")
    rewrite_header(copy / BUNDLES_FILE, lambda h: h["__metadata__"].__setitem__("experts", experts))
    with pytest.raises(FormatError, match=match):
        FlashStore(copy)


def test_an_moe_layer_s_roles_must_name_experts(moe_models, tmp_path):
    _, path = moe_models["mixtral"]
    copy = shutil.copytree(path, tmp_path / "copy")

    def drop_field(header):
        roles = json.loads(header["__metadata__"]["ffn_roles"])
        roles[1]["up"] = roles[1]["up"].replace("{expert}", "0")
        header["__metadata__"]["ffn_roles"] = json.dumps(roles)

    rewrite_header(copy / BUNDLES_FILE, drop_field)
    with pytest.raises(FormatError, match=r"ffn_roles\[1\]"):
        FlashStore(copy)


def test_an_moe_store_takes_no_neuron_order(moe_models, tmp_path):
    """An expert's rows stay one range: convert refuses a neuron order for an MoE model, and a store header that
    carries one anyway is refused by name."""
    _, path = moe_models["olmoe"]
    store = FlashStore(path)
    order = torch.arange(store.n_neurons).repeat(store.n_layers, 1)
    with pytest.raises(ValueError, match="keeps the rows of each expert together"):
        convert(path.parent / "olmoe", tmp_path / "placed", progress=False, neuron_order=order)
    copy = shutil.copytree(path, tmp_path / "copy")
    # (the header keeps its length: any value of the field, even a short one, is refused on an MoE store)
    rewrite_header(copy / BUNDLES_FILE, lambda h: h["__metadata__"].__setitem__("neuron_order", "[]"))
    with pytest.raises(FormatError, match="neuron_order.*MoE store"):
        FlashStore(copy)


def test_a_model_mixing_dense_and_expert_layers_is_refused(tmp_path):
    model = tiny_model("qwen2_moe", num_hidden_layers=3, mlp_only_layers=[1])
    model.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(FormatError, match="mixing dense and expert layers"):
        convert(tmp_path / "ckpt", tmp_path / "store", progress=False)


def test_flashllm_run_serves_an_moe_store(default_model, tmp_path, capsys):
    from flashllm_ext import cli

    gguf, _, _ = default_model
    tiny_model("qwen3_moe", vocab_size=49152).save_pretrained(tmp_path / "ckpt")  # the default tokenizer's vocabulary
    path = convert(tmp_path / "ckpt", tmp_path / "store", progress=False)
    argv = ["run", str(path), "--tokenizer", str(gguf), "--mode", "flash", "--budget", "99%", "--tokens", "4"]
    assert cli.main([*argv, "--expert-policy", "lfu"]) == 0
    out = capsys.readouterr().out
    assert "4 tokens in" in out and "experts_read_per_layer" in out
    assert cli.main([*argv, "--expert-policy", "window", "--hf"]) == 0  # through transformers (load_flash)
    out = capsys.readouterr().out
    assert "4 tokens in" in out and "expert_policy window" in out


@pytest.mark.parametrize("fmt", [dict(dtype="q4"), dict(dtype="fp32", endor=True)])
def test_quantized_and_endor_expert_stores_serve_every_mode_alike(moe_models, tmp_path, fmt):
    """A q4 store (experts in GGUF blocks) and an Endor store (experts as bitmap + values) read their experts in flash
    and naive mode into what dense mode computes from the same store."""
    model, _ = moe_models["qwen3_moe"]
    model.save_pretrained(tmp_path / "ckpt")
    path = convert(tmp_path / "ckpt", tmp_path / "store", progress=False, **fmt)
    prompt = _prompt()
    logits = {}
    for mode, slots in (("dense", None), ("naive", 2), ("flash", 3)):
        decoder = load_decoder(path, _budget(path, mode, slots), mode=mode, max_len=64, kv_dtype=torch.float32)
        try:
            logits[mode] = torch.stack([decoder.forward(prompt), decoder.forward([5]), decoder.forward([9])])
        finally:
            decoder.close()
    torch.testing.assert_close(logits["naive"], logits["dense"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits["flash"], logits["dense"], rtol=1e-5, atol=1e-5)
    if "endor" in fmt:  # lossless: the fp32 model's own logits
        with torch.no_grad():
            want = model(prompt[None]).logits[0, -1]
        torch.testing.assert_close(logits["dense"][0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("expert_type", [None, "q4_0"])
def test_an_moe_gguf_converts_to_the_experts_it_holds(tmp_path, family, expert_type):
    """A GGUF of llama.cpp's MoE layout (fused ffn_*_exps tensors; F16, or Q4_0 experts; Mixtral's a "llama" file with
    its q/k rows in llama.cpp's rotary order) converts to a store whose expert rows are gguf's dequantization of those
    tensors (Q4_0 blocks kept bit for bit in a q4 store), and decodes what the checkpoint computes."""
    import gguf

    from bench.synth_checkpoint import write_moe_gguf

    size = "moe_intermediate_size" if family.startswith("qwen") else "intermediate_size"
    model = tiny_model(family, seed=6, **{size: 64})  # experts' rows of whole 32-weight blocks
    model.save_pretrained(tmp_path / "ckpt")
    path = write_moe_gguf(tmp_path / "ckpt", tmp_path / "moe.gguf", expert_type=expert_type, progress=False)
    fused = {t.name: t for t in gguf.GGUFReader(path).tensors}
    store = FlashStore(convert(path, tmp_path / "store", dtype="q4" if expert_type else "fp32", progress=False))
    d, e = store.hidden_size, 3
    bundles = store.float_bundle(1, list(store.experts.rows(e))).float()
    for role, columns in (("up", slice(0, d)), ("gate", slice(d, 2 * d))):
        tensor = fused[f"blk.1.ffn_{role}_exps.weight"]
        want = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())[e]
        assert torch.equal(bundles[:, columns], want.to(store.dtype).float()), role  # (a q4 store dequantizes to fp16)
    if expert_type:
        assert store.tensor_sources[1]["up"] == "kept Q4_0 blocks"
    else:  # F16 weights: the checkpoint's, rounded
        down = model.model.layers[1].mlp.experts.down_proj[e]
        assert torch.equal(bundles[:, 2 * d :], down.t().half().float())
    prompt = _prompt()
    logits = {}
    for mode, slots in (("dense", None), ("flash", 3)):
        decoder = load_decoder(path.parent / "store", _budget(store.path, mode, slots), mode=mode, max_len=64)
        try:
            logits[mode] = torch.stack([decoder.forward(prompt), decoder.forward([7])])
        finally:
            decoder.close()
    torch.testing.assert_close(logits["flash"], logits["dense"], rtol=1e-5, atol=1e-5)
    if not expert_type:
        with torch.no_grad():
            want = model(prompt[None]).logits[0, -1]
        torch.testing.assert_close(logits["dense"][0], want, rtol=0, atol=2e-3)  # F16 weights, fp16 KV cache
        _llama_cpp_decodes_as_transformers(path, model.half().float(), prompt.tolist())


@pytest.mark.parametrize("expert_type", [None, "q4_0"])
def test_a_mixtral_gguf_of_one_tensor_per_expert_converts_as_the_fused_one(tmp_path, expert_type):
    """Mixtral GGUFs written before llama.cpp fused the experts hold each expert's weights as tensors of their own
    (blk.{i}.ffn_{gate,up,down}.{e}.weight): the same experts, so a store of the same rows and sources (Q4_0 blocks
    kept). (llama.cpp itself no longer loads this layout: it asks for the fused blk.{i}.ffn_*_exps tensors.)"""
    import gguf

    from bench.synth_checkpoint import write_moe_gguf

    tiny_model("mixtral", seed=6, intermediate_size=64).save_pretrained(tmp_path / "ckpt")
    fused = write_moe_gguf(tmp_path / "ckpt", tmp_path / "fused.gguf", expert_type=expert_type, progress=False)
    split = write_moe_gguf(
        tmp_path / "ckpt", tmp_path / "split.gguf", expert_type=expert_type, progress=False, per_expert=True
    )
    names = {t.name for t in gguf.GGUFReader(split).tensors}
    assert "blk.1.ffn_up.3.weight" in names and not any("_exps" in name for name in names)
    dtype = "q4" if expert_type else "fp32"
    stores = [FlashStore(convert(p, tmp_path / f"{p.stem}-store", dtype=dtype, progress=False)) for p in (fused, split)]
    rows = list(range(stores[0].n_neurons))
    for layer in range(stores[0].n_layers):
        assert torch.equal(stores[1].float_bundle(layer, rows), stores[0].float_bundle(layer, rows)), layer
    assert stores[1].tensor_sources == stores[0].tensor_sources


def _llama_cpp_decodes_as_transformers(path, model, prompt: list[int]) -> None:
    """llama.cpp (where `make llama-cpp` built it) greedy-decodes the GGUF at `path` into transformers' tokens."""
    from flashllm_ext.harness.llama_cpp import env_ready, run_llama_cpp

    if not env_ready():
        return
    row = run_llama_cpp(path, prompt, 4, 1)
    assert "error" not in row, row
    ids = torch.tensor([prompt])
    with torch.no_grad():  # (an explicit mask: a config's pad token would be masked out of the prompt)
        want = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, eos_token_id=None
        )
    assert row["generated"] == want[0, len(prompt) :].tolist()


def test_train_predictors_refuses_an_moe_store(moe_models, default_model):
    from flashllm_ext import cli

    gguf, _, _ = default_model
    _, path = moe_models["olmoe"]
    with pytest.raises(SystemExit, match="needs no predictors"):
        cli.main(["train-predictors", str(gguf), "--store", str(path)])
