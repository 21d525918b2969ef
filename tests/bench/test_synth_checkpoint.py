"""bench/synth_checkpoint.py: synthesized Hugging Face checkpoints with real 7B shapes (tiny configs here)."""

import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from bench.synth_checkpoint import (
    CONFIGS,
    INIT_STD,
    SMOKE_OVERRIDES,
    checkpoint_specs,
    synthesize_checkpoint,
    synthesize_gguf,
)
from flashllm_ext.flash.convert import bundle_layer, convert
from flashllm_ext.flash.quantized_rows import describe_sources
from flashllm_ext.flash.store import FlashStore


DENSE = ("llama-2-7b", "opt-6.7b")
MOE = ("olmoe-1b-7b", "qwen3-30b-a3b")


@pytest.fixture(scope="module", params=DENSE)
def tiny_checkpoint(request, tmp_path_factory):
    name = request.param
    path = synthesize_checkpoint(
        name,
        tmp_path_factory.mktemp(name) / "ckpt",
        prune=0.5,
        overrides=SMOKE_OVERRIDES[name],
        shard_bytes=20_000,
        progress=False,
    )
    return name, path


def test_real_shapes_match_the_published_models():
    # OPT-6.7B: 6.66e9 parameters (lm_head tied); Llama-2-7B: 6.74e9 (lm_head separate).
    opt = checkpoint_specs(CONFIGS["opt-6.7b"], torch.float16)
    llama = checkpoint_specs(CONFIGS["llama-2-7b"], torch.float16)
    assert sum(s.nbytes for s in opt) // 2 == 6_658_473_984
    assert sum(s.nbytes for s in llama) // 2 == 6_738_415_616
    names = {s.name: s.shape for s in opt}
    assert names["model.decoder.layers.31.fc1.weight"] == (16384, 4096) and "lm_head.weight" not in names
    names = {s.name: s.shape for s in llama}
    assert names["model.layers.0.mlp.gate_proj.weight"] == (11008, 4096) and "lm_head.weight" in names


def test_moe_shapes_match_the_published_models():
    # OLMoE-1B-7B: 6.92e9 parameters, 64 experts of 1024; Qwen3-30B-A3B: 30.5e9, 128 experts of 768. Each expert's
    # weights under names of their own, as save_pretrained writes them.
    olmoe = {s.name: s.shape for s in checkpoint_specs(CONFIGS["olmoe-1b-7b"], torch.float16)}
    qwen = {s.name: s.shape for s in checkpoint_specs(CONFIGS["qwen3-30b-a3b"], torch.float16)}
    assert sum(math.prod(shape) for shape in olmoe.values()) == 6_919_161_856
    assert sum(math.prod(shape) for shape in qwen.values()) == 30_532_122_624
    assert olmoe["model.layers.15.mlp.experts.63.down_proj.weight"] == (2048, 1024)
    assert qwen["model.layers.47.mlp.experts.127.gate_proj.weight"] == (768, 2048)
    assert not any(name.endswith("gate_up_proj") for name in olmoe)


@pytest.mark.parametrize("name", MOE)
def test_an_moe_checkpoint_loads_in_transformers_and_converts_to_its_experts(name, tmp_path):
    path = synthesize_checkpoint(name, tmp_path / "ckpt", overrides=SMOKE_OVERRIDES[name], progress=False)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == CONFIGS[name]["architectures"][0]
    with FlashStore(convert(path, tmp_path / "store", progress=False)) as store:
        assert (store.experts.count, store.experts.size) == (8, 64)
        for layer in range(store.n_layers):
            experts = model.model.layers[layer].mlp.experts  # transformers' fused [E, 2m, d] and [E, d, m]
            for e in (0, 7):
                gate, up = experts.gate_up_proj[e].chunk(2)
                want = bundle_layer(up, experts.down_proj[e], gate)
                assert torch.equal(store.bundle(layer, list(store.experts.rows(e))), want)


def test_a_vocab_size_changes_the_embedding_and_the_lm_head_only():
    # Llama-2-7B with the default model's 49152 tokens: 2 * 17152 * 4096 more parameters, the layers unchanged.
    llama = {s.name: s.shape for s in checkpoint_specs(CONFIGS["llama-2-7b"], torch.float16)}
    wide = {s.name: s.shape for s in checkpoint_specs({**CONFIGS["llama-2-7b"], "vocab_size": 49152}, torch.float16)}
    changed = {name for name in llama if wide[name] != llama[name]}
    assert wide.keys() == llama.keys() and changed == {"model.embed_tokens.weight", "lm_head.weight"}
    assert wide["lm_head.weight"] == wide["model.embed_tokens.weight"] == (49152, 4096)


def test_the_command_line_takes_a_vocab_size(monkeypatch, capsys):
    from bench import synth_checkpoint

    calls = []
    monkeypatch.setattr(synth_checkpoint, "shared_checkpoint", lambda name, **kwargs: calls.append((name, kwargs)))
    synth_checkpoint.main(["llama-2-7b", "--vocab-size", "49152"])
    assert calls == [("llama-2-7b", {"vocab_size": 49152})]


def test_transformers_loads_it_sharded_and_pruned(tiny_checkpoint):
    name, path = tiny_checkpoint
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((path / s).is_file() for s in shards)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.float16 and type(model).__name__ == CONFIGS[name]["architectures"][0]
    state = model.state_dict()
    for tensor_name, shard in index["weight_map"].items():  # every tensor written is the one transformers loaded
        with safe_open(path / shard, "pt") as f:
            assert torch.equal(f.get_tensor(tensor_name), state[tensor_name]), tensor_name
    ffn_weight = next(v for k, v in state.items() if k.endswith(("fc1.weight", "up_proj.weight")))
    assert (ffn_weight == 0).sum(dim=1).tolist() == [ffn_weight.shape[1] // 2] * ffn_weight.shape[0]
    embedding = next(v for k, v in state.items() if "embed_tokens" in k)
    assert (embedding == 0).float().mean() < 0.01  # embeddings are not pruned
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 100) and torch.isfinite(logits).all()


def test_the_store_converted_from_it_matches(tiny_checkpoint, tmp_path):
    name, path = tiny_checkpoint
    state = AutoModelForCausalLM.from_pretrained(path).state_dict()
    with FlashStore(convert(path, tmp_path / "store", progress=False)) as store:
        assert store.glu == (name == "llama-2-7b") and store.n_layers == 2
        for layer in range(store.n_layers):
            roles = store.ffn_roles[layer]
            want = bundle_layer(state[roles["up"]], state[roles["down"]], state.get(roles.get("gate")))
            assert torch.equal(store.bundle(layer, torch.arange(store.n_neurons)), want)
        resident = store.resident()
        written = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        bundled = {n for roles in store.ffn_roles for role, n in roles.items() if role in ("up", "gate", "down")}
        assert resident.keys() == written.keys() - bundled
        assert all(torch.equal(resident[n], state[n]) for n in resident)


def test_llama_3_8b_shapes_match_the_published_model():
    # Llama-3-8B: 8,030,261,248 parameters (lm_head separate), grouped-query attention with 8 key/value heads.
    specs = {s.name: s.shape for s in checkpoint_specs(CONFIGS["llama-3-8b"], torch.float16)}
    assert sum(math.prod(shape) for shape in specs.values()) == 8_030_261_248
    assert specs["model.layers.0.self_attn.k_proj.weight"] == (1024, 4096)


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_a_synthesized_gguf_opens_and_converts_keeping_its_blocks(tmp_path, qtype):
    """The GGUF holds what GGUFCheckpoint expects of a Llama of those shapes, its 2-D weights in qtype blocks of
    normal(0, INIT_STD) weights; a quantized store of it keeps every up/gate block."""
    import gguf

    from flashllm_ext.io.checkpoint import GGUFCheckpoint

    tiny = {**SMOKE_OVERRIDES["llama-2-7b"], "num_key_value_heads": 2}
    path = synthesize_gguf("llama-3-8b", tmp_path / "x.gguf", qtype=qtype, overrides=tiny, progress=False)
    ckpt = GGUFCheckpoint(path)
    assert {k: ckpt.config[k] for k in tiny} == tiny and ckpt.config["rope_theta"] == 500000.0
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert {types[n] for n in types if not n.endswith("norm.weight")} == {gguf.GGMLQuantizationType[qtype.upper()]}
    up = ckpt["model.layers.1.mlp.up_proj.weight"]
    assert abs(up.std().item() - INIT_STD) < 0.1 * INIT_STD
    assert torch.equal(ckpt["model.norm.weight"], torch.ones(128))
    dtype = qtype[:2]
    with FlashStore(convert(path, tmp_path / "store", dtype=dtype, progress=False)) as store:
        assert set(describe_sources(store.tensor_sources).split(", ")) == {
            f"4 kept {qtype.upper()} blocks",
            f"2 requantized {qtype.upper()} -> q8_0",
        }


def test_bad_arguments_raise(tmp_path):
    with pytest.raises(ValueError, match="name must be one of"):
        synthesize_checkpoint("gpt-2", tmp_path / "x")
    with pytest.raises(ValueError, match="name must be a Llama model"):
        synthesize_gguf("opt-6.7b", tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="block format"):
        synthesize_gguf("llama-3-8b", tmp_path / "x.gguf", qtype="q6_k")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="prune"):
        synthesize_checkpoint("opt-6.7b", tmp_path / "x", prune=1.5)


def test_llama_cpp_decodes_a_synthesized_gguf(tmp_path):
    """llama.cpp refuses a model without a vocabulary: the synthesized file carries a placeholder one of exactly
    vocab_size tokens, with and without room for the byte tokens."""
    from flashllm_ext.harness.llama_cpp import env_dir, env_ready, run_llama_cpp

    if not env_ready():
        pytest.skip(f"llama-cpp-python is not built in {env_dir()}: `make llama-cpp` builds it (minutes)")
    for vocab in (100, 300):
        tiny = {**SMOKE_OVERRIDES["llama-2-7b"], "num_key_value_heads": 2, "vocab_size": vocab}
        path = synthesize_gguf("llama-3-8b", tmp_path / f"v{vocab}.gguf", qtype="q4_0", overrides=tiny, progress=False)
        row = run_llama_cpp(path, [1, 5, 9, 13], 3, 1)
        assert "error" not in row, row
        assert len(row["generated"]) == 4 and all(0 <= t < vocab for t in row["generated"])


@pytest.mark.parametrize("name", MOE)
def test_an_moe_gguf_holds_the_checkpoint_s_experts_and_llama_cpp_decodes_it(name, tmp_path):
    """write_moe_gguf stacks each layer's experts as llama.cpp's converter does; llama.cpp loads the file and
    decodes what transformers decodes from the checkpoint (greedy, F16 weights in both)."""
    import gguf

    from bench.synth_checkpoint import write_moe_gguf
    from flashllm_ext.harness.llama_cpp import env_dir, env_ready, run_llama_cpp

    hf = synthesize_checkpoint(name, tmp_path / "ckpt", overrides=SMOKE_OVERRIDES[name], progress=False)
    path = write_moe_gguf(hf, tmp_path / "moe.gguf", progress=False)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    experts = model.model.layers[1].mlp.experts  # fused in memory: gate_up [E, 2m, d], down [E, d, m]
    gate, up = experts.gate_up_proj.chunk(2, dim=1)
    for role, want in (("gate", gate), ("up", up), ("down", experts.down_proj)):
        got = torch.from_numpy(tensors[f"blk.1.ffn_{role}_exps.weight"].data.copy()).float()
        assert torch.equal(got, want.half().float()), role
    if not env_ready():
        pytest.skip(f"llama-cpp-python is not built in {env_dir()}: `make llama-cpp` builds it (minutes)")
    prompt = [1, 20, 40, 60, 80]
    row = run_llama_cpp(path, prompt, 4, 1)
    assert "error" not in row, row
    ids = torch.tensor([prompt])
    with torch.no_grad():  # (an explicit mask: OLMoE's pad token is id 1, which generate would mask out)
        expected = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, eos_token_id=None
        )
    assert row["generated"] == expected[0, len(prompt) :].tolist()


def test_the_placeholder_vocabulary_has_the_size_asked():
    from bench.synth_checkpoint import synthetic_vocabulary

    for size in (3, 100, 259, 128256):
        tokens, types = synthetic_vocabulary(size)
        assert len(tokens) == len(types) == len(set(tokens)) == size
    with pytest.raises(ValueError, match="at least 3"):
        synthetic_vocabulary(2)
