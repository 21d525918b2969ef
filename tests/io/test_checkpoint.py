"""Checkpoint readers: GGUF files under Hugging Face names (equal to what transformers loads), dequantized one
tensor at a time; Hugging Face safetensors directories; bad files raise FormatError naming file and field."""

import os

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from flashllm_ext import FormatError
from flashllm_ext.ops.blocks import dequantize_rows
from flashllm_ext.io.checkpoint import GGUFCheckpoint, load_gguf, open_checkpoint
from flashllm_ext.io.gguf_layout import expected_shapes, gguf_config, gguf_name, hf_name
from tests.helpers.checkpoints import write_tiny_gguf
from tests.helpers.faults import refuses_without_blocking
from tests.helpers.models import TINY_LLAMA

# ------------------------------------------------------------------------------------------ GGUF on a tiny Llama


def test_gguf_name_is_the_inverse_of_hf_name(tmp_path, tiny_llama):
    config = {**gguf_config(write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama)), "tie_word_embeddings": False}
    names = list(expected_shapes(config))
    assert [hf_name(gguf_name(name)) for name in names] == names
    assert gguf_name("model.layers.0.mlp.up_proj.weight") == "blk.0.ffn_up.weight"
    assert gguf_name("lm_head.weight") == "output.weight" and gguf_name("model.norm.weight") == "output_norm.weight"
    assert gguf_name("model.layers.0.self_attn.q_proj.bias") == "blk.0.attn_q.bias"  # as hf_name, any suffix
    for outside in ("model.layers.0.self_attn.q_norm.weight", "model.layers.x.mlp.up_proj.weight", "lm_head"):
        assert gguf_name(outside) is None, outside


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
    assert config["hidden_size"] == TINY_LLAMA["hidden_size"] and config["num_key_value_heads"] == 2


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


@pytest.mark.slow
@pytest.mark.parametrize(
    "field,value,match",
    [
        ("block_count", 10**9, "llama.block_count: 1000000000 blocks need"),
        ("head_count_kv", 0, "llama.attention.head_count_kv: must be positive, got 0"),
        ("head_count", 0, "llama.attention.head_count: must be positive, got 0"),
        ("embedding_length", 0, "llama.embedding_length: must be positive, got 0"),
    ],
)
def test_size_fields_that_lie_raise_format_error(tmp_path, tiny_llama, field, value, match):
    # block_count is checked against the file's tensors before expected_shapes builds a name for each of them.
    path = write_tiny_gguf(tmp_path / "t.gguf", tiny_llama, **{field: value})
    for load in (gguf_config, GGUFCheckpoint):
        with pytest.raises(FormatError, match=match):
            load(path)


def test_default_load_gguf_equals_transformers(default_model):
    path, model, _ = default_model
    loaded = load_gguf(path, progress=False)
    reference = model.state_dict()
    assert set(reference) - set(loaded) == {"lm_head.weight"} and len(loaded) == 272
    for name, tensor in loaded.items():
        assert torch.equal(tensor, reference[name]), name
    _assert_config_matches(gguf_config(path), model.config)


def test_gguf_checkpoint_dequantizes_one_tensor_at_a_time(tmp_path, tiny_llama, monkeypatch):
    """Opening reads the header only; each tensor is dequantized when asked for, and nothing keeps it."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, qtype=gguf.GGMLQuantizationType.Q8_0)
    calls = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda data, qtype: calls.append(qtype) or real(data, qtype))
    ckpt = open_checkpoint(path)
    assert isinstance(ckpt, GGUFCheckpoint) and calls == []
    name = "model.layers.1.mlp.up_proj.weight"
    assert ckpt.shape(name) == (TINY_LLAMA["intermediate_size"], TINY_LLAMA["hidden_size"]) and calls == []
    first, second = ckpt[name], ckpt[name]
    assert len(calls) == 2 and torch.equal(first, second) and first.data_ptr() != second.data_ptr()
    assert set(ckpt.names) == set(load_gguf(path, progress=False))


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q4_1])
def test_gguf_row_chunks_are_the_tensor_in_blocks_of_whole_heads(tmp_path, tiny_llama, qtype):
    """row_chunks reads a block of rows at a time, q/k blocks of whole heads (each un-permuted on its own): their
    concatenation is ckpt[name]; __getitem__ itself fills a tensor from such blocks."""
    ckpt = open_checkpoint(write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, qtype=qtype))
    kv_rows = TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]  # one key head's rows
    for name, rows in (
        ("model.layers.1.self_attn.k_proj.weight", [kv_rows] * TINY_LLAMA["num_key_value_heads"]),
        ("model.layers.1.mlp.up_proj.weight", [1] * TINY_LLAMA["intermediate_size"]),
        ("model.embed_tokens.weight", [1] * TINY_LLAMA["vocab_size"]),
    ):
        chunks = list(ckpt.row_chunks(name, 1))  # smaller than a row: a row, or a head's rows, each
        assert [len(c) for c in chunks] == rows, name
        assert torch.equal(torch.cat(chunks), ckpt[name]), name
        big = list(ckpt.row_chunks(name, 1 << 30))
        assert len(big) == 1 and torch.equal(big[0], ckpt[name]), name
    if qtype == gguf.GGMLQuantizationType.F32:
        state = tiny_llama.state_dict()
        assert torch.equal(
            ckpt["model.layers.1.self_attn.k_proj.weight"], state["model.layers.1.self_attn.k_proj.weight"]
        )
    norm = "model.layers.0.input_layernorm.weight"
    assert [c.shape for c in ckpt.row_chunks(norm, 1)] == [(TINY_LLAMA["hidden_size"],)]


def test_gguf_raw_blocks_are_the_file_bytes(tmp_path, tiny_llama):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, qtype=gguf.GGMLQuantizationType.Q4_0)
    ckpt = GGUFCheckpoint(path)
    data = {t.name: t.data for t in gguf.GGUFReader(path).tensors}
    blocks, kind = ckpt.raw_blocks("model.layers.1.mlp.down_proj.weight")
    assert kind == "Q4_0" and blocks.dtype == torch.uint8
    assert torch.equal(blocks, torch.from_numpy(data["blk.1.ffn_down.weight"].copy()))
    assert ckpt.source_type("model.layers.1.mlp.down_proj.weight") == "Q4_0"
    assert ckpt.source_type("model.norm.weight") == "F32"
    # q_proj's rows come back in the Hugging Face order: they dequantize to exactly what ckpt[name] gives
    q = "model.layers.0.self_attn.q_proj.weight"
    q_blocks, _ = ckpt.raw_blocks(q)
    assert torch.equal(dequantize_rows(q_blocks, "q4_0", TINY_LLAMA["hidden_size"]), ckpt[q])


def test_gguf_tensor_data_is_not_read_through_the_map(tmp_path, tiny_llama):
    """Tensors are read from the file, not through the reader's map of it (pages read through a map stay in the
    process until it is unmapped: an 8B GGUF's 4.5 GB): with the map's arrays swapped for zeros, nothing changes."""
    ckpt = GGUFCheckpoint(write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, qtype=gguf.GGMLQuantizationType.Q8_0))
    want = {name: ckpt[name] for name in ckpt.names}
    up = "model.layers.1.mlp.up_proj.weight"
    blocks = ckpt.raw_blocks(up)[0]
    ckpt._tensors = {n: t._replace(data=np.zeros(t.data.shape, t.data.dtype)) for n, t in ckpt._tensors.items()}
    assert all(torch.equal(ckpt[name], want[name]) for name in ckpt.names)
    assert torch.equal(ckpt.raw_blocks(up)[0], blocks) and blocks.any()


def test_safetensors_checkpoint_shapes_come_from_the_header(tmp_path, tiny_llama):
    tiny_llama.save_pretrained(tmp_path / "ckpt")
    ckpt = open_checkpoint(tmp_path / "ckpt")
    state = tiny_llama.state_dict()
    assert ckpt.config["hidden_size"] == TINY_LLAMA["hidden_size"]
    for name in ckpt.names:
        assert ckpt.shape(name) == tuple(state[name].shape) and torch.equal(ckpt[name], state[name]), name


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_fifo_in_a_checkpoint_directory_is_refused(tmp_path, tiny_llama, name):
    tiny_llama.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / name).unlink()
    os.mkfifo(tmp_path / "ckpt" / name)
    refuses_without_blocking(lambda: open_checkpoint(tmp_path / "ckpt"), tmp_path / "ckpt" / name)


@pytest.mark.parametrize("load", [GGUFCheckpoint, gguf_config])
def test_a_fifo_named_as_a_gguf_is_refused(tmp_path, load):
    os.mkfifo(tmp_path / "model.gguf")
    refuses_without_blocking(lambda: load(tmp_path / "model.gguf"), tmp_path / "model.gguf")
