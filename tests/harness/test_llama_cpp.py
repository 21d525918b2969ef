"""llama.cpp as a peer: its llama-cpp-python environment, the F16 GGUF writer (every field kept, every tensor the
dequantized source), the Llama GGUF writer of Hugging Face checkpoints (read back as the checkpoint's tensors, with
its config and another GGUF's tokenizer), and the worker against transformers' greedy tokens on the same F16 weights.
The worker's tests skip where `make llama-cpp` has not built that environment."""

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from flashllm_ext.harness.cgroup import MemoryCgroup
from flashllm_ext.harness.llama_cpp import (
    CMAKE_ARGS,
    LLAMA_CPP_VERSION,
    baseline_bytes,
    env_dir,
    env_ready,
    ensure_env,
    run_llama_cpp,
    write_f16_gguf,
    write_llama_gguf,
)
from flashllm_ext.hub.fetch import fetch_default
from flashllm_ext.io.checkpoint import open_checkpoint
from flashllm_ext.io.gguf_layout import gguf_config
from tests.helpers.checkpoints import llama_cpp_permute, write_tiny_gguf
from tests.helpers.models import tiny_model

needs_env = pytest.mark.skipif(
    not env_ready(), reason=f"llama-cpp-python is not built in {env_dir()}: `make llama-cpp` builds it (minutes)"
)


def _fields(reader: gguf.GGUFReader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def assert_f16_copy(src, dst) -> None:
    """dst holds src's fields (file type F16) and src's tensors dequantized: F16, or F32 for 1-D ones."""
    source, copy = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    expected = {**_fields(source), "general.file_type": int(gguf.LlamaFileType.MOSTLY_F16)}
    assert _fields(copy) == expected
    assert [t.name for t in copy.tensors] == [t.name for t in source.tensors]
    for s, c in zip(source.tensors, copy.tensors):
        assert list(c.shape) == list(s.shape), s.name
        one_d = len(s.shape) == 1
        assert c.tensor_type == (gguf.GGMLQuantizationType.F32 if one_d else gguf.GGMLQuantizationType.F16), s.name
        dequantized = gguf.quants.dequantize(s.data, s.tensor_type)
        assert np.array_equal(c.data, dequantized.astype(np.float32 if one_d else np.float16)), s.name


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0])
def test_f16_gguf_holds_every_field_and_the_dequantized_tensors(tmp_path, tiny_llama, qtype):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, qtype=qtype)
    dst = write_f16_gguf(src, tmp_path / "tiny.F16.gguf")
    assert dst == tmp_path / "tiny.F16.gguf"
    assert_f16_copy(src, dst)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging file left


def test_f16_gguf_is_kept_until_the_source_changes(tmp_path, tiny_llama):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama)
    dst = write_f16_gguf(src, tmp_path / "tiny.F16.gguf")
    written = dst.stat().st_mtime_ns
    assert write_f16_gguf(src, dst).stat().st_mtime_ns == written
    os.utime(src, ns=(written + 10**9, written + 10**9))
    assert write_f16_gguf(src, dst).stat().st_mtime_ns > written


# ------------------------------------------------------------------------ Llama GGUFs of Hugging Face checkpoints

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]


def byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character standing for each of the 256 bytes."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(shifted)) for b in range(256)]


def write_tiny_tokenizer(path) -> Path:
    """A GGUF of a byte-level BPE tokenizer only (no tensors): 3 control tokens, the 256 byte symbols, 3 merges and
    their results, 262 tokens in all."""
    tokens = SPECIAL_TOKENS + byte_symbols() + [m.replace(" ", "") for m in MERGES]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS) + [gguf.TokenType.NORMAL] * 259)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


TINY_VOCAB = 262


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tokenizer.gguf")


def save_tiny_llama(path, dtype=torch.float32, **config):
    """A tiny random Llama of the tiny tokenizer's vocabulary, saved by save_pretrained at `path`."""
    model = tiny_model("llama", vocab_size=TINY_VOCAB, **config).to(dtype)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("dtype,tied", [(torch.float32, False), (torch.bfloat16, True)])
def test_llama_gguf_reads_back_as_the_checkpoint_rounded_to_f16(tmp_path, tiny_tokenizer, dtype, tied):
    model = save_tiny_llama(tmp_path / "hf", dtype, tie_word_embeddings=tied)
    dst = write_llama_gguf(tmp_path / "hf", tmp_path / "tiny.gguf", tiny_tokenizer)
    assert dst == tmp_path / "tiny.gguf"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging file left
    hf, ours = open_checkpoint(tmp_path / "hf"), open_checkpoint(dst)  # ours: Q/K rows un-permuted on reading
    assert sorted(ours.names) == sorted(hf.names) and ("lm_head.weight" in hf.names) == (not tied)
    for name in hf.names:
        one_d = len(hf.shape(name)) == 1
        expected = hf[name].float() if one_d else hf[name].half().float()
        assert torch.equal(ours[name], expected), name
    # In the file, Q/K rows are in llama.cpp's order (llama_cpp_permute: its converter's rule, written apart from
    # the library's); 2-D weights F16, norms F32.
    raw = {t.name: t for t in gguf.GGUFReader(dst).tensors}
    q, k = (model.state_dict()[f"model.layers.0.self_attn.{m}_proj.weight"].half().numpy() for m in "qk")
    assert np.array_equal(raw["blk.0.attn_q.weight"].data, llama_cpp_permute(q, model.config.num_attention_heads))
    assert np.array_equal(raw["blk.0.attn_k.weight"].data, llama_cpp_permute(k, model.config.num_key_value_heads))
    assert not np.array_equal(raw["blk.0.attn_q.weight"].data, q)
    for tensor in raw.values():
        one_d = len(tensor.shape) == 1
        assert tensor.tensor_type == (gguf.GGMLQuantizationType.F32 if one_d else gguf.GGMLQuantizationType.F16)


def test_llama_gguf_holds_the_config_and_the_tokenizer(tmp_path, tiny_tokenizer):
    model = save_tiny_llama(tmp_path / "hf", max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=50000.0)
    dst = write_llama_gguf(tmp_path / "hf", tmp_path / "tiny.gguf", tiny_tokenizer)
    config, hf = gguf_config(dst), model.config
    assert {key: config[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")} == {
        "vocab_size": TINY_VOCAB,
        "hidden_size": hf.hidden_size,
        "intermediate_size": hf.intermediate_size,
        "num_hidden_layers": hf.num_hidden_layers,
    }
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert (config["max_position_embeddings"], config["rope_theta"]) == (512, 50000.0)
    assert config["rms_norm_eps"] == pytest.approx(1e-5, rel=1e-7)  # stored as float32
    assert not config["tie_word_embeddings"] and (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    fields = _fields(gguf.GGUFReader(dst))
    assert fields["general.architecture"] == "llama"
    assert fields["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_F16)
    assert fields["llama.rope.dimension_count"] == 16
    tokenizer = {k: v for k, v in _fields(gguf.GGUFReader(tiny_tokenizer)).items() if k.startswith("tokenizer.")}
    assert {k: v for k, v in fields.items() if k.startswith("tokenizer.")} == tokenizer
    assert len(tokenizer["tokenizer.ggml.tokens"]) == TINY_VOCAB and tokenizer["tokenizer.chat_template"]


def test_llama_gguf_refuses_a_vocabulary_other_than_the_tokenizer_s(tmp_path, tiny_tokenizer):
    tiny_model("llama", vocab_size=TINY_VOCAB + 1).save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="vocab_size 263 differs from the 262 tokens") as refused:
        write_llama_gguf(tmp_path / "hf", tmp_path / "tiny.gguf", tiny_tokenizer)
    assert str(tmp_path / "hf") in str(refused.value) and str(tiny_tokenizer) in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_llama_gguf_refuses_tensors_outside_the_llama_layout(tmp_path, tiny_tokenizer):
    tiny_model("qwen2", vocab_size=TINY_VOCAB).save_pretrained(tmp_path / "hf")  # q/k/v biases
    with pytest.raises(ValueError, match=r"tensor model\.layers\.0\.self_attn\.[qkv]_proj\.bias has no place"):
        write_llama_gguf(tmp_path / "hf", tmp_path / "tiny.gguf", tiny_tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_llama_gguf_is_kept_until_the_config_changes(tmp_path, tiny_tokenizer):
    save_tiny_llama(tmp_path / "hf")
    dst = write_llama_gguf(tmp_path / "hf", tmp_path / "tiny.gguf", tiny_tokenizer)
    written = dst.stat().st_mtime_ns
    assert write_llama_gguf(tmp_path / "hf", dst, tiny_tokenizer).stat().st_mtime_ns == written
    os.utime(tmp_path / "hf" / "config.json", ns=(written + 10**9, written + 10**9))
    assert write_llama_gguf(tmp_path / "hf", dst, tiny_tokenizer).stat().st_mtime_ns > written


def test_a_synthesized_checkpoint_with_the_tokenizer_s_vocab_size_is_written(tmp_path, tiny_tokenizer, monkeypatch):
    from bench.synth_checkpoint import shared_checkpoint

    monkeypatch.setenv("FLASHLLM_CACHE", str(tmp_path))
    # Llama-2-7B's smoke shapes with the tokenizer's vocabulary size, as `--vocab-size` writes the real shapes
    hf_dir = shared_checkpoint("llama-2-7b", progress=False, smoke=True, vocab_size=TINY_VOCAB)
    assert hf_dir == tmp_path / "scale" / "llama-2-7b-vocab262-smoke-hf"
    dst = write_llama_gguf(hf_dir, tmp_path / "synth.gguf", tiny_tokenizer)
    hf, ours = open_checkpoint(hf_dir), open_checkpoint(dst)
    assert ours.config["vocab_size"] == hf.config["vocab_size"] == TINY_VOCAB
    assert ours.shape("lm_head.weight") == ours.shape("model.embed_tokens.weight") == (TINY_VOCAB, 128)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.self_attn.k_proj.weight"):
        assert torch.equal(ours[name], hf[name].float()), name  # F16 in both


def test_a_synthesized_checkpoint_of_its_own_vocab_size_takes_the_placeholder_tokenizer(tmp_path, monkeypatch):
    """bench_memory --scale llama-2-7b: the checkpoint keeps its vocabulary (32000 at full shapes); a tokenizer-only
    GGUF of that many placeholder tokens, written once, lets llama.cpp load the same weights."""
    import gguf

    from bench.synth_checkpoint import placeholder_tokenizer_gguf, shared_checkpoint

    monkeypatch.setenv("FLASHLLM_CACHE", str(tmp_path))
    hf_dir = shared_checkpoint("llama-2-7b", progress=False, smoke=True)
    vocab = open_checkpoint(hf_dir).config["vocab_size"]
    tokenizer = placeholder_tokenizer_gguf(vocab)
    assert tokenizer == tmp_path / "scale" / f"placeholder-tokenizer-{vocab}.gguf"
    reader = gguf.GGUFReader(tokenizer)
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == vocab and len(reader.tensors) == 0
    written = tokenizer.stat().st_mtime_ns
    assert placeholder_tokenizer_gguf(vocab).stat().st_mtime_ns == written  # once
    ours, hf = open_checkpoint(write_llama_gguf(hf_dir, tmp_path / "synth.gguf", tokenizer)), open_checkpoint(hf_dir)
    assert ours.config["vocab_size"] == vocab
    assert torch.equal(
        ours["model.layers.0.mlp.down_proj.weight"], hf["model.layers.0.mlp.down_proj.weight"].half().float()
    )


@pytest.mark.slow
@needs_env
def test_llama_cpp_greedy_tokens_on_a_llama_gguf_equal_transformers_on_its_checkpoint(tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    save_tiny_llama(tmp_path / "hf", torch.float16)  # F16 in both: the GGUF holds the checkpoint's weights exactly
    dst = write_llama_gguf(tmp_path / "hf", tmp_path / "tiny.gguf", tiny_tokenizer)
    prompt = [1, 20, 40, 60, 80, 100, 120, 140]
    row = run_llama_cpp(dst, prompt, 8, 1)
    assert "error" not in row, row
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():  # llama.cpp's worker does not stop at the end-of-sequence token: neither does this
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=9, do_sample=False, eos_token_id=None)
    # Exact equality, no tolerance: llama.cpp rounds the activations entering its F16 products to F16, transformers
    # keeps them in fp32; with Linear inputs rounded to fp16, transformers' logits on this sequence move by 0.0002
    # at most, under their smallest top-two gap (0.0011).
    assert row["generated"] == expected[0, len(prompt) :].tolist()


# ----------------------------------------------------------------------------- the llama-cpp-python environment


def test_env_is_ready_only_with_the_stamp_of_this_version_and_cmake_args(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    assert not env_ready(tmp_path)
    stamp = tmp_path / "flashllm-build.json"
    stamp.write_text(json.dumps({"llama_cpp_python": LLAMA_CPP_VERSION, "cmake_args": CMAKE_ARGS}))
    assert env_ready(tmp_path) and not env_ready(tmp_path, cmake_args="-DGGML_NATIVE=OFF")
    stamp.write_text(json.dumps({"llama_cpp_python": "0.3.1", "cmake_args": CMAKE_ARGS}))
    assert not env_ready(tmp_path)


def test_ensure_env_never_empties_a_folder_of_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="no virtual environment"):
        ensure_env(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_failed_build_names_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # offline: pip finds no llama-cpp-python and fails in seconds
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    env = tmp_path / "venv"
    with pytest.raises(RuntimeError, match=f"failed .* see {env / 'build.log'}"):
        ensure_env(env)
    assert (env / "build.log").stat().st_size > 0 and not env_ready(env)


# ------------------------------------------------------------------------------------ the real default model


@pytest.fixture(scope="module")
def default_f16():
    src = fetch_default()
    return write_f16_gguf(src, src.with_name(f"{src.stem}.F16.gguf"))


@pytest.mark.slow
def test_default_f16_gguf_keeps_the_tokenizer_and_chat_template(default_f16):
    assert_f16_copy(fetch_default(), default_f16)


@pytest.mark.slow
@needs_env
def test_llama_cpp_greedy_tokens_equal_transformers_on_the_f16_weights(default_f16):
    from flashllm_ext.hub.hf import load_hf_model

    model, tokenizer = load_hf_model(default_f16)
    prompt = tokenizer("The three most important things to remember when you learn to cook are").input_ids
    row = run_llama_cpp(default_f16, prompt, 8, 2)
    assert "error" not in row, row
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=9, do_sample=False)[0, len(prompt) :]
    # llama.cpp multiplies F16 weights by activations rounded to F16, transformers in fp32: their logits on this
    # sequence differ by 0.027 at most (0.006 on average), under its smallest top-two gap (0.10): same tokens.
    assert row["generated"] == expected.tolist()
    assert row["tokens"] == 8 and len(row["token_ms"]) == 8 and row["ms_per_token"] > 0 and row["prefill_tok_s"] > 0
    assert row["prompt_tokens"] == len(prompt) and row["rss_baseline_mb"] > 0
    # no repacking: the weights are llama.cpp's memory-mapped file, not a copy
    assert "CPU_REPACK model" not in row["buffers_mib"] and row["buffers_mib"]["CPU_Mapped model"] > 250


@pytest.mark.slow
@needs_env
def test_llama_cpp_killed_by_its_memory_limit_is_a_row():
    probe = MemoryCgroup(f"flashllm-probe-{os.getpid()}", None)
    probe.close()
    if probe.unavailable:
        pytest.skip(f"no memory limit to test: {probe.unavailable}")
    # Without mmap the 98 MB of weights are anonymous memory, which a 30 MB budget cannot hold.
    row = run_llama_cpp(
        fetch_default(), [1, 2, 3], 2, 1, use_mmap=False, memory_limit_bytes=baseline_bytes() + 30 * 10**6
    )
    assert row["oom_killed"] and "error" in row and row["cgroup_peak_mb"] <= row["cgroup_limit_mb"]
