"""bench/synth_checkpoint.py: synthesized Hugging Face checkpoints with real 7B shapes (tiny configs here)."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from bench.synth_checkpoint import CONFIGS, SMOKE_OVERRIDES, checkpoint_specs, synthesize_checkpoint
from flashllm_ext.flash.convert import bundle_layer, convert
from flashllm_ext.flash.store import FlashStore


@pytest.fixture(scope="module", params=sorted(SMOKE_OVERRIDES))
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


def test_bad_arguments_raise(tmp_path):
    with pytest.raises(ValueError, match="name must be one of"):
        synthesize_checkpoint("gpt-2", tmp_path / "x")
    with pytest.raises(ValueError, match="prune"):
        synthesize_checkpoint("opt-6.7b", tmp_path / "x", prune=1.5)
