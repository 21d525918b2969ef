"""Quantized layer stores (convert_offload dtype "q8" / "q4"): every decoder-layer matrix as GGUF blocks, a GGUF's
kept bit for bit (W_down's too: every Linear's blocks run along its input dimension), others rounded to nearest;
the offloaded model multiplies by the blocks as stored, in memory and from SSD, and is charged their bytes."""

import copy
import json

import gguf
import pytest
import torch

from flashllm_ext import FormatError, cli
from flashllm_ext.hub.hf import QuantizedEmbedding, QuantizedLinear
from flashllm_ext.io.checkpoint import GGUFCheckpoint, TensorsCheckpoint
from flashllm_ext.offload import load_offload
from flashllm_ext.offload.convert import convert_offload
from flashllm_ext.offload.store import LAYERS_FILE, LayerStore
from flashllm_ext.ops.blocks import QuantizedWeight, quantize_rows
from tests.helpers.checkpoints import rewrite_header, write_tiny_gguf
from tests.helpers.models import tiny_model

Q = gguf.GGMLQuantizationType
N_LAYERS = 4


def _model(family: str) -> torch.nn.Module:
    sizes = dict(hidden_size=128, num_hidden_layers=N_LAYERS, vocab_size=96, max_position_embeddings=64)
    ffn = {"intermediate_size": 352} if family == "llama" else {"ffn_dim": 352}
    return tiny_model(family, **ffn, **sizes).eval()


def _checkpoint(model: torch.nn.Module) -> TensorsCheckpoint:
    return TensorsCheckpoint(model.config.to_dict(), {n: p.detach() for n, p in model.named_parameters()})


def _matrices(store: LayerStore):
    return [(layer, e) for layer in range(store.n_layers) for e in store.layers[layer]]


@pytest.mark.parametrize(
    "qtype,dtype,kept_format",
    [
        (Q.Q8_0, "q8", "q8_0"),
        (Q.Q4_0, "q4", "q4_0"),
        (Q.Q4_1, "q4", "q4_1"),
        (Q.Q4_0, "q8", None),
        (Q.Q8_0, "q4", None),
    ],
)
def test_gguf_blocks_of_the_dtype_are_kept_bit_for_bit(tmp_path, tiny_llama, qtype, dtype, kept_format):
    """Every matrix in a format of the dtype keeps the file's blocks (W_down included, q/k rows in the Hugging Face
    order) and dequantizes to exactly the checkpoint's values; in another format it is those values quantized to
    the dtype's first format. tensor_sources says which; the resident tensors are float16."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, qtype=qtype)
    ckpt = GGUFCheckpoint(path)
    store = LayerStore(convert_offload(path, tmp_path / "s", dtype=dtype, progress=False))
    assert store.quantized == dtype and store.dtype == torch.float16
    fmt = kept_format or {"q8": "q8_0", "q4": "q4_0"}[dtype]
    assert {e.form for _, e in _matrices(store)} == {fmt}
    for layer, e in _matrices(store):
        w = store.matrix(layer, e.name)
        assert isinstance(w, QuantizedWeight) and w.shape == e.shape
        if kept_format:
            assert torch.equal(w.blocks, ckpt.raw_blocks(e.name)[0]), e.name
            assert torch.equal(w.dequantize(), ckpt[e.name]), e.name
            assert store.tensor_sources[e.name] == f"kept {qtype.name} blocks"
        else:
            assert torch.equal(w.blocks, quantize_rows(ckpt[e.name], fmt)), e.name
            assert store.tensor_sources[e.name] == f"requantized {qtype.name} -> {fmt}"
    # The embedding (and an untied LM head) as blocks too: the file's if kept, else quantized to q8_0.
    assert set(store.resident_formats) == {
        n for n in store.resident_names() if n.endswith(("embed_tokens.weight", "lm_head.weight"))
    }
    for name, (block_fmt, cols) in store.resident_formats.items():
        w = store.resident_weight(name)
        assert isinstance(w, QuantizedWeight) and (w.fmt, w.shape) == (block_fmt, ckpt.shape(name))
        want = ckpt.raw_blocks(name)[0] if w.fmt == qtype.name.lower() else quantize_rows(ckpt[name], "q8_0")
        assert torch.equal(w.blocks, want), name
        assert store.resident_tensor(name).dtype == torch.float16
    floats = [n for n in store.resident_names() if n not in store.resident_formats]
    assert floats and {store.resident_tensor(n).dtype for n in floats} == {torch.float16}


def test_matrices_in_other_types_take_the_commonest_format(tmp_path, tiny_llama):
    """A q4 store of a mostly-Q4_1 file with Q8_0 down matrices: the Q4_1 blocks kept, the Q8_0 ones quantized
    again to q4_1."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, qtype=Q.Q4_1, qtypes={"ffn_down": Q.Q8_0})
    store = LayerStore(convert_offload(path, tmp_path / "s", dtype="q4", progress=False))
    assert {e.form for _, e in _matrices(store)} == {"q4_1"}
    ckpt = GGUFCheckpoint(path)
    for layer, e in _matrices(store):
        if "down_proj" in e.name:
            assert store.tensor_sources[e.name] == "requantized Q8_0 -> q4_1"
            assert torch.equal(store.matrix(layer, e.name).blocks, quantize_rows(ckpt[e.name], "q4_1"))
        else:
            assert store.tensor_sources[e.name] == "kept Q4_1 blocks"


@pytest.fixture(scope="module", params=["llama", "opt"])
def case(request, tmp_path_factory):
    """A tiny model, its q8 and q4 layer stores, and per dtype a float32 twin holding exactly the stores' weights
    (the matrices, embedding and LM head dequantized, the other resident tensors rounded to float16)."""
    model = _model(request.param)
    root = tmp_path_factory.mktemp(request.param)
    out = {"model": model}
    for dtype in ("q8", "q4"):
        store = LayerStore(convert_offload(_checkpoint(model), root / dtype, dtype=dtype, progress=False))
        twin = copy.deepcopy(model).half().float()
        with torch.no_grad():
            for layer, e in _matrices(store):
                twin.get_parameter(e.name).copy_(store.matrix(layer, e.name).dequantize())
            for name in store.resident_formats:  # the embedding and LM head, held as blocks
                twin.get_parameter(name).copy_(store.resident_weight(name).dequantize())
        out[dtype] = (store, twin)
    return out


@pytest.mark.parametrize("dtype", ["q8", "q4"])
@pytest.mark.parametrize("in_memory", [0, 2, N_LAYERS])
@torch.no_grad()
def test_offloaded_model_computes_the_stores_blocks(case, dtype, in_memory):
    """Logits within the rounding of x to int8 per block (and of float16 activations) of transformers' on the
    dequantized weights, the same greedy tokens; in-memory layers, the embedding and the LM head stay blocks; every
    SSD layer's stored bytes read once a token; the budget charges the blocks."""
    store, twin = case[dtype]
    resident = load_offload(store.path, None, mode="dense").offload.resident_bytes
    budget = resident + sum(store.stored_bytes(i) for i in range(in_memory)) + 2 * store.stored_bytes(0)
    model = load_offload(store.path, budget, mode="dense", layers_in_memory=in_memory)
    runtime = model.offload
    try:
        assert runtime.layers_in_memory == in_memory
        assert all(isinstance(w, QuantizedWeight) for layer in runtime.memory for w in layer.values())
        assert isinstance(model.get_input_embeddings(), QuantizedEmbedding)
        assert isinstance(model.get_output_embeddings(), QuantizedLinear)
        floats = [n for n in store.resident_names() if n not in store.resident_formats]
        blocks = [store.resident_weight(n).nbytes for n in store.resident_formats]
        other_buffers = [b.nbytes for n, b in model.named_buffers() if not n.endswith(".blocks")]  # RoPE's
        stored = sum(store.resident_tensor(n).nbytes for n in floats) + sum(blocks)
        assert runtime.resident_bytes == stored + sum(other_buffers)
        prompt = torch.randint(3, 90, (1, 9), generator=torch.Generator().manual_seed(4))
        want = twin(prompt).logits
        got = model(prompt).logits.float()
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2 * want.abs().max().item())
        runtime.counters.reset()
        out = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert torch.equal(out, twin.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False))
        stats = runtime.stats()
        assert stats["bytes_read_per_token"] == sum(store.stored_bytes(i) for i in range(in_memory, N_LAYERS))
        assert stats["accounted_bytes"] <= stats["budget_bytes"]
        assert store.dense_bytes(0) == sum(store.matrix(0, e.name).nbytes for e in store.layers[0])
    finally:
        runtime.close()


def test_quantized_arguments_are_checked(case, tmp_path):
    ckpt = _checkpoint(case["model"])
    with pytest.raises(ValueError, match="Endor compression takes float matrices"):
        convert_offload(ckpt, tmp_path / "e", dtype="q8", endor_compress=True)
    with pytest.raises(ValueError, match=r"dtype must be one of \['fp16', 'bf16', 'fp32', 'q8', 'q4'\], got 'q3'"):
        convert_offload(ckpt, tmp_path / "e", dtype="q3")
    store, _ = case["q8"]
    with pytest.raises(ValueError, match="needs an Endor layer store"):
        load_offload(store.path, None, mode="endor")
    model = load_offload(store.path, None)  # the mode a quantized store runs in
    assert model.offload.mode == "dense"
    model.offload.close()


def _copy_store(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _narrower_first_matrix(layers: str) -> str:
    """The layers field with its first matrix 40 columns narrower (a block fewer) than the blocks stored for it."""
    parsed = json.loads(layers)
    parsed[0][0][1][1] -= 40
    return json.dumps(parsed)


@pytest.mark.parametrize(
    "mutate,field,says",
    [
        (lambda m: m.update(format_version="4"), "format_version", "unsupported version '4'"),
        (lambda m: m.update(dtype="q5"), "dtype", "must be one of"),
        (lambda m: m.update(layers=m["layers"].replace('"q8_0"', '"q5_0"', 1)), "layers", "form must be one of"),
        (lambda m: m.update(dtype="fp16"), "layers", r"form must be one of \['dense', 'endor'\], got 'q8_0'"),
        (lambda m: m.update(layers=_narrower_first_matrix(m["layers"])), "layers.0.", "missing or not U8"),
        (lambda m: m.update(tensor_sources="{"), "tensor_sources", "not JSON"),
    ],
)
def test_a_broken_quantized_store_names_the_file_and_field(case, tmp_path, mutate, field, says):
    store, _ = case["q8"]
    broken = _copy_store(store.path, tmp_path / "broken")
    rewrite_header(broken / LAYERS_FILE, lambda h: mutate(h["__metadata__"]))
    with pytest.raises(FormatError, match=says) as e:
        LayerStore(broken)
    assert field in str(e.value) and str(broken / LAYERS_FILE) in str(e.value)


def test_broken_resident_formats_name_the_file_and_field(case, tmp_path):
    store, _ = case["q4"]
    broken = _copy_store(store.path, tmp_path / "broken")
    rewrite_header(broken / "resident.safetensors", lambda h: h["__metadata__"].update(resident_formats='{"x": 1}'))
    with pytest.raises(FormatError, match=r"resident_formats\['x'\]") as e:
        LayerStore(broken)
    assert str(broken / "resident.safetensors") in str(e.value)


@pytest.mark.parametrize("version", ["1", "2"])
def test_an_older_store_still_opens(case, tmp_path, version):
    """Stores written before block formats (version 1: a matrix's form 0 / 1 for dense / Endor) and before blocked
    embeddings (version 2)."""
    model = case["model"]
    path = convert_offload(_checkpoint(model), tmp_path / "fp32", dtype="fp32", progress=False)
    old = _copy_store(path, tmp_path / f"v{version}")

    def to_version(header):
        meta = header["__metadata__"]
        meta["format_version"] = version
        if version == "1":
            meta["layers"] = meta["layers"].replace('"dense"', "0")

    rewrite_header(old / LAYERS_FILE, to_version)
    rewrite_header(old / "resident.safetensors", lambda h: h["__metadata__"].update(format_version=version))
    store = LayerStore(old)
    assert {e.form for _, e in _matrices(store)} == {"dense"}
    prompt = torch.tensor([[5, 7, 11, 13]])
    offloaded = load_offload(old, "60%", mode="dense")
    assert torch.equal(
        offloaded.generate(prompt, max_new_tokens=4, do_sample=False),
        model.generate(prompt, max_new_tokens=4, do_sample=False),
    )
    offloaded.offload.close()


def test_cli_converts_a_gguf_to_q4(tmp_path, tiny_llama, capsys):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, qtype=Q.Q4_1)
    assert cli.main(["offload", str(tmp_path / "store"), "--convert", str(path), "--dtype", "q4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "dtype=q4" in lines[0]
    blocked = 7 * tiny_llama.config.num_hidden_layers + len(LayerStore(tmp_path / "store").resident_formats)
    assert lines[1] == f"tensors in blocks: {blocked} kept Q4_1 blocks"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.parametrize("dtype", ["q8", "q4"])
@torch.no_grad()
def test_gpu_offload_of_a_quantized_store_computes_the_same_tokens(case, dtype):
    """On a GPU, one layer in GPU memory, one staged in pinned host memory, the rest read from SSD: the CUDA
    quantized_linear on the blocks as stored gives the CPU run's greedy tokens."""
    store, twin = case[dtype]
    prompt = torch.randint(3, 90, (1, 9), generator=torch.Generator().manual_seed(4))
    want = twin.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    model = load_offload(store.path, None, device="cuda", layers_on_device=1, layers_in_memory=2)
    try:
        got = model.generate(prompt.cuda(), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert torch.equal(got.cpu(), want)
        assert model.offload.stats()["bytes_read_per_token"] == sum(store.stored_bytes(i) for i in range(2, N_LAYERS))
    finally:
        model.offload.close()
