"""llama.cpp as a peer: its llama-cpp-python environment, the F16 GGUF writer (every field kept, every tensor the
dequantized source), and the worker against transformers' greedy tokens on the same F16 weights. The worker's tests
skip where `make llama-cpp` has not built that environment."""

import json
import os

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
)
from flashllm_ext.hub.fetch import fetch_default
from tests.helpers.checkpoints import write_tiny_gguf

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
