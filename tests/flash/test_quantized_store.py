"""Quantized flash stores (convert dtype "q8" / "q4"): a GGUF's up/gate blocks kept bit for bit, down and other
types quantized again along the hidden dimension, Hugging Face weights rounded to nearest or by GPTQ, each path
recorded."""

import weakref

import gguf
import numpy as np
import pytest
import torch

from flashllm_ext import FormatError, cli
from flashllm_ext.flash import store
from flashllm_ext.flash.convert import convert
from flashllm_ext.flash import quantized_rows
from flashllm_ext.flash.quantized_rows import describe_sources
from flashllm_ext.hub.hf import collect_linear_inputs
from flashllm_ext.hub.text import corpus_token_ids, spread_windows
from flashllm_ext.io.checkpoint import GGUFCheckpoint
from flashllm_ext.ops.blocks import BLOCK, BundleFormat, quantize_columns_gptq, quantize_rows, quantize_rows_gptq
from tests.helpers.checkpoints import write_tiny_gguf
from tests.helpers.models import tiny_model

Q = gguf.GGMLQuantizationType


def _gguf_tensor(path, name: str):
    """(raw data, type) of a GGUF tensor as gguf's own reader gives it."""
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return np.array(tensor.data), tensor.tensor_type


def _dequantized(path, name: str) -> torch.Tensor:
    data, qtype = _gguf_tensor(path, name)
    return torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32))


def _parts(fs: store.FlashStore, layer: int) -> dict[str, torch.Tensor]:
    """A quantized store's rows of every neuron of `layer`, split into their up, gate and down blocks."""
    rows = fs.bundle(layer, torch.arange(fs.n_neurons))
    col, _ = fs.bundle_format.part_bytes(fs.hidden_size)
    return {"up": rows[:, :col], "gate": rows[:, col : 2 * col], "down": rows[:, 2 * col :]}


@pytest.mark.parametrize(
    "qtype,dtype,down_format",
    [
        (Q.Q8_0, "q8", None),
        (Q.Q4_0, "q4", None),
        (Q.Q4_1, "q4", None),
        (Q.Q4_0, "q4", "q4_1"),
        (Q.Q4_0, "q8", None),
        (Q.Q8_0, "q4", "q4_0"),
    ],
)
def test_gguf_blocks_in_the_input_format_are_kept_bit_for_bit(tmp_path, tiny_llama, qtype, dtype, down_format):
    """Up/gate rows already in the store's input format are the file's bytes (dequantizing to exactly what gguf
    gives); in another format they are gguf's values quantized again; down is gguf's values quantized along the
    hidden dimension. tensor_sources says which."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, qtype=qtype)
    fs = store.FlashStore(convert(path, tmp_path / "s", dtype=dtype, down_format=down_format, progress=False))
    in_format = {"q8": "q8_0", "q4": "q4_1" if qtype == Q.Q4_1 else "q4_0"}[dtype]
    down_format = down_format or "q8_0"
    kept = in_format == qtype.name.lower()
    assert fs.bundle_format == BundleFormat(in_format, down_format) and fs.quantized
    assert (fs.dtype_name, fs.row_dtype, fs.row_bytes) == ("fp16", torch.uint8, fs.bundle_format.row_bytes(64, True))
    d = fs.hidden_size
    for layer in range(fs.n_layers):
        parts = _parts(fs, layer)
        read = fs.bundle_format.dequantize(fs.bundle(layer, torch.arange(fs.n_neurons)), d, True)
        for k, role in enumerate(("up", "gate")):
            name = f"blk.{layer}.ffn_{role}.weight"
            values = _dequantized(path, name)
            if kept:
                assert torch.equal(parts[role], torch.from_numpy(_gguf_tensor(path, name)[0])), name
                assert torch.equal(read[:, k * d : (k + 1) * d], values), name
            else:
                assert torch.equal(parts[role], quantize_rows(values, in_format)), name
        down = _dequantized(path, f"blk.{layer}.ffn_down.weight")
        assert torch.equal(parts["down"], quantize_rows(down.t(), down_format))
        assert torch.equal(fs.float_bundle(layer, [5, 0]), read[[5, 0]].half())
        path_of = f"kept {qtype.name} blocks" if kept else f"requantized {qtype.name} -> {in_format}"
        assert fs.tensor_sources[layer] == {
            "up": path_of,
            "gate": path_of,
            "down": f"requantized {qtype.name} -> {down_format}",
        }
    resident = fs.resident()
    assert {t.dtype for t in resident.values()} == {torch.float16}
    embedding = "model.embed_tokens.weight"
    assert torch.equal(resident[embedding], _dequantized(path, "token_embd.weight").half())


@pytest.mark.parametrize("dtype,in_format,error", [("q8", "q8_0", 1 / 254), ("q4", "q4_0", 1 / 8)])
def test_hugging_face_weights_round_to_nearest(tmp_path, dtype, in_format, error):
    """A safetensors checkpoint's FFN weights are quantized as BundleFormat.quantize rounds them (bit for bit), and
    read back within the format's rounding error of each block's largest magnitude; resident tensors are fp16 but
    the attention, embedding and LM head, held as blocks."""
    model = tiny_model("llama", num_hidden_layers=2)
    model.save_pretrained(tmp_path / "ckpt")
    fs = store.FlashStore(convert(tmp_path / "ckpt", tmp_path / "s", dtype=dtype, progress=False))
    assert fs.bundle_format.name == f"{in_format}+q8_0" and fs.dtype == torch.float16
    state = model.state_dict()
    for layer in range(fs.n_layers):
        mlp = f"model.layers.{layer}.mlp."
        up, gate, down = (state[f"{mlp}{r}_proj.weight"] for r in ("up", "gate", "down"))
        ids = torch.arange(fs.n_neurons)
        assert torch.equal(fs.bundle(layer, ids), fs.bundle_format.quantize(up, down, gate))
        want = torch.cat([up, gate, down.t()], dim=1)
        got = fs.float_bundle(layer, ids).float()
        # Rounding to a code, plus the float16 rounding of each block's scale and of the values read back.
        blocks = want.abs().reshape(fs.n_neurons, -1, BLOCK)
        bound = ((error + 2**-10) * blocks.amax(-1, keepdim=True) + 2**-11 * blocks).reshape(want.shape)
        assert bool(((got - want).abs() <= bound).all()), layer
        assert (got - want).abs().max() > 0  # quantized, not copied
        assert fs.tensor_sources[layer] == {
            "up": f"quantized F32 -> {in_format}",
            "gate": f"quantized F32 -> {in_format}",
            "down": "quantized F32 -> q8_0",
        }
    resident = fs.resident()  # floats, the blocks dequantized
    assert all(t.dtype == torch.float16 for t in resident.values())
    norm = "model.norm.weight"
    assert norm not in fs.resident_formats and torch.equal(resident[norm], state[norm].half())
    embedding = "model.embed_tokens.weight"
    assert torch.equal(fs.resident_weight(embedding).blocks, quantize_rows(state[embedding], "q8_0"))


def test_k_quant_blocks_are_quantized_again(tmp_path):
    """Q6_K up/gate tensors (a type the store does not hold) become q8_0 rows of their gguf-dequantized values."""
    model = tiny_model(
        "llama",
        hidden_size=256,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32,
    )
    k_quants = {"ffn_up": Q.Q6_K, "ffn_gate": Q.Q6_K}
    path = write_tiny_gguf(tmp_path / "k.gguf", model, qtype=Q.Q8_0, qtypes=k_quants)
    fs = store.FlashStore(convert(path, tmp_path / "s", dtype="q8", progress=False))
    assert fs.tensor_sources == [
        {"up": "requantized Q6_K -> q8_0", "gate": "requantized Q6_K -> q8_0", "down": "requantized Q8_0 -> q8_0"}
    ]
    parts = _parts(fs, 0)
    for role in ("up", "gate"):
        values = _dequantized(path, f"blk.0.ffn_{role}.weight")
        assert values.abs().max() > 0 and torch.equal(parts[role], quantize_rows(values, "q8_0"))


@pytest.mark.parametrize("dtype", ["q4", "fp16"])
def test_a_type_gguf_cannot_dequantize_names_the_tensor_and_the_type(tmp_path, tiny_llama, dtype):
    path = write_tiny_gguf(tmp_path / "f64.gguf", tiny_llama, qtypes={"ffn_up": Q.F64})
    with pytest.raises(FormatError, match=r"f64\.gguf: blk\.0\.ffn_up\.weight: cannot dequantize F64 data"):
        convert(path, tmp_path / "s", dtype=dtype, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f64.gguf"]


def test_mostly_q4_1_inputs_make_a_q4_1_store(tmp_path, tiny_llama):
    """q4 takes q4_1 when more up/gate tensors are Q4_1 than Q4_0: those are kept, the rest quantized to q4_1."""
    types = {"ffn_up": Q.Q4_1, "ffn_gate": Q.Q4_0}
    path = write_tiny_gguf(tmp_path / "mixed.gguf", tiny_llama, qtype=Q.Q4_1, qtypes=types)
    fs = store.FlashStore(convert(path, tmp_path / "s", dtype="q4", progress=False))
    assert fs.bundle_format.name == "q4_0+q8_0"  # a tie: up Q4_1, gate Q4_0 in every layer
    assert fs.tensor_sources[1] == {
        "up": "requantized Q4_1 -> q4_0",
        "gate": "kept Q4_0 blocks",
        "down": "requantized Q4_1 -> q8_0",
    }
    path = write_tiny_gguf(tmp_path / "q41.gguf", tiny_llama, qtype=Q.Q4_1, qtypes={"ffn_down": Q.Q4_0})
    fs = store.FlashStore(convert(path, tmp_path / "s1", dtype="q4", progress=False))
    assert fs.bundle_format.name == "q4_1+q8_0"
    assert describe_sources(fs.tensor_sources) == "4 kept Q4_1 blocks, 2 requantized Q4_0 -> q8_0"


def test_quantized_convert_holds_one_layer_at_a_time(tmp_path, tiny_llama, monkeypatch):
    """Reading a GGUF for a quantized store never holds more than one layer's up, gate and down tensors, and never
    dequantizes the up/gate tensors whose blocks it keeps."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, qtype=Q.Q4_0)
    alive: weakref.WeakSet = weakref.WeakSet()
    most_alive = [0]
    dequantized = []

    def tracked(real, calls=None):
        def read(self, name):
            got = real(self, name)
            if calls is not None:
                calls.append(name)
            alive.add(got[0] if isinstance(got, tuple) else got)
            most_alive[0] = max(most_alive[0], len(alive))
            return got

        return read

    monkeypatch.setattr(GGUFCheckpoint, "__getitem__", tracked(GGUFCheckpoint.__getitem__, dequantized))
    monkeypatch.setattr(GGUFCheckpoint, "raw_blocks", tracked(GGUFCheckpoint.raw_blocks))
    convert(path, tmp_path / "s", dtype="q4", progress=False)
    assert 0 < most_alive[0] <= 3
    ffn = [name for name in dequantized if ".mlp." in name]
    assert ffn == [f"model.layers.{layer}.mlp.down_proj.weight" for layer in range(2)]


def _calibration(model, n_tokens: int = 192) -> dict[str, torch.Tensor]:
    """Weight name -> its inputs fp16 [N, in], for every linear layer of `model` but the LM head, over random
    tokens."""
    ids = torch.randint(0, model.config.vocab_size, (n_tokens,), generator=torch.Generator().manual_seed(0))
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    with torch.inference_mode():
        return {f"{n}.weight": x.half() for n, x in collect_linear_inputs(model, ids, names).items()}


@pytest.mark.parametrize("dtype,in_format", [("q8", "q8_0"), ("q4", "q4_0")])
def test_gptq_rounding_against_calibration_inputs(tmp_path, dtype, in_format):
    """rounding "gptq": every FFN row and attention projection the store quantizes is GPTQ's against what its
    weight multiplies (up and gate x, down's columns h), each window's first token weighted SINK_WEIGHT, on round to
    nearest's grid; each FFN weight's outputs on those inputs err less than the round-to-nearest store's;
    tensor_sources says GPTQ; the embedding stays rounded to nearest."""
    model = tiny_model("llama", num_hidden_layers=2)
    model.save_pretrained(tmp_path / "ckpt")
    calibration = _calibration(model)
    gptq = store.FlashStore(
        convert(
            tmp_path / "ckpt", tmp_path / "g", dtype=dtype, rounding="gptq", calibration=calibration, progress=False
        )
    )
    nearest = store.FlashStore(convert(tmp_path / "ckpt", tmp_path / "n", dtype=dtype, progress=False))
    state = model.state_dict()
    for layer in range(2):
        mlp = f"model.layers.{layer}.mlp."
        up, gate, down = (state[f"{mlp}{r}_proj.weight"] for r in ("up", "gate", "down"))
        x, h = calibration[f"{mlp}up_proj.weight"], calibration[f"{mlp}down_proj.weight"]
        x_factor, h_factor = quantized_rows.calibration_factor(x), quantized_rows.calibration_factor(h)
        parts = _parts(gptq, layer)
        assert torch.equal(parts["up"], quantize_rows_gptq(up, in_format, x_factor))
        assert torch.equal(parts["gate"], quantize_rows_gptq(gate, in_format, x_factor))
        assert torch.equal(parts["down"], quantize_columns_gptq(down, "q8_0", h_factor))
        ids = torch.arange(gptq.n_neurons)
        ours, theirs = (fs.bundle_format.dequantize(fs.bundle(layer, ids), 64, True) for fs in (gptq, nearest))
        for k, (weight, inputs) in enumerate(((up, x), (gate, x), (down, h))):
            want = inputs.float() @ weight.T
            errors = [
                (inputs.float() @ (rows[:, k * 64 : (k + 1) * 64] if k < 2 else rows[:, 128:].t()).T - want)
                .pow(2)
                .sum()
                for rows in (ours, theirs)
            ]
            assert errors[0] < errors[1], (layer, k)
        assert gptq.tensor_sources[layer] == {
            "up": f"quantized F32 -> {in_format}, GPTQ",
            "gate": f"quantized F32 -> {in_format}, GPTQ",
            "down": "quantized F32 -> q8_0, GPTQ",
        }
        for projection in ("q", "o"):  # the resident attention blocks: GPTQ's too
            name = f"model.layers.{layer}.self_attn.{projection}_proj.weight"
            factor = quantized_rows.calibration_factor(calibration[name])
            assert torch.equal(gptq.resident_weight(name).blocks, quantize_rows_gptq(state[name], in_format, factor))
    embedding = "model.embed_tokens.weight"  # looked up as rows: to nearest
    assert torch.equal(gptq.resident_weight(embedding).blocks, nearest.resident_weight(embedding).blocks)


def test_gptq_keeps_the_blocks_a_gguf_has(tmp_path, tiny_llama):
    """A GGUF's up/gate (and attention) blocks in the input format stay bit for bit under GPTQ rounding; only down is
    rounded, and only its inputs are needed."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, qtype=Q.Q4_0)
    down = "model.layers.1.mlp.down_proj.weight"
    calibration = {n: x for n, x in _calibration(tiny_llama).items() if n.endswith("down_proj.weight")}
    fs = store.FlashStore(
        convert(path, tmp_path / "s", dtype="q4", rounding="gptq", calibration=calibration, progress=False)
    )
    parts = _parts(fs, 1)
    assert torch.equal(parts["up"], torch.from_numpy(_gguf_tensor(path, "blk.1.ffn_up.weight")[0]))
    values = _dequantized(path, "blk.1.ffn_down.weight")
    factor = quantized_rows.calibration_factor(calibration[down])
    assert torch.equal(parts["down"], quantize_columns_gptq(values, "q8_0", factor))
    assert describe_sources(fs.tensor_sources) == "4 kept Q4_0 blocks, 2 requantized Q4_0 -> q8_0, GPTQ"


@pytest.mark.slow
def test_calibration_inputs_are_the_models_own_on_calibration_text(default_model, monkeypatch):
    """calibration_inputs runs the checkpoint's model (its own tokenizer reading the calibration text): each named
    weight's inputs are what the model's layer multiplies on those tokens."""
    path, model, tokenizer = default_model
    monkeypatch.setattr(quantized_rows, "CALIBRATION_WINDOWS", 2)
    monkeypatch.setattr(quantized_rows, "CALIBRATION_WINDOW", 16)
    names = [
        "model.layers.3.mlp.up_proj.weight",
        "model.layers.3.mlp.down_proj.weight",
        "layers.3.self_attn.o_proj.weight",
    ]
    calibration = quantized_rows.calibration_inputs(path, names, progress=False)
    ids = spread_windows(corpus_token_ids(tokenizer, "calibration"), 2, 16)
    modules = [n.removesuffix(".weight") for n in names[:2]] + ["model.layers.3.self_attn.o_proj"]
    with torch.inference_mode():
        captured = collect_linear_inputs(model, ids[16:], modules)
    assert sorted(calibration) == sorted(names)
    for name, module in zip(names, modules):
        got = calibration[name]
        assert got.dtype == torch.float16 and got.shape == (32, model.get_submodule(module).in_features)
        torch.testing.assert_close(got[16:].float(), captured[module], atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match="no module for the weight model.layers.3.mlp.fc9.weight"):
        quantized_rows.calibration_inputs(path, ["model.layers.3.mlp.fc9.weight"], progress=False)


def test_gptq_arguments_are_checked(tmp_path, tiny_llama):
    """GPTQ takes a quantized dtype, a dense model, one calibration entry per layer, and (to read the calibration
    text) the checkpoint's tokenizer; nothing is written when it refuses."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, qtype=Q.Q4_0)
    calibration = _calibration(tiny_llama)
    with pytest.raises(ValueError, match="rounding must be one of"):
        convert(path, tmp_path / "s", dtype="q4", rounding="awq", progress=False)
    with pytest.raises(ValueError, match="rounding 'gptq' applies to the quantized dtypes"):
        convert(path, tmp_path / "s", dtype="fp16", rounding="gptq", calibration=calibration, progress=False)
    with pytest.raises(ValueError, match="calibration inputs apply to rounding 'gptq', not 'nearest'"):
        convert(path, tmp_path / "s", dtype="q4", calibration=calibration, progress=False)
    del calibration["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match="calibration inputs lack 1 of the weights GPTQ rounds, e.g. model.layers.1"):
        convert(path, tmp_path / "s", dtype="q4", rounding="gptq", calibration=calibration, progress=False)
    tiny_model("llama", num_hidden_layers=2).save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="has no tokenizer"):
        convert(tmp_path / "ckpt", tmp_path / "s", dtype="q8", rounding="gptq", progress=False)
    tiny_model("mixtral", num_hidden_layers=2).save_pretrained(tmp_path / "moe")
    with pytest.raises(ValueError, match="rounding 'gptq' takes dense models"):
        convert(tmp_path / "moe", tmp_path / "s", dtype="q8", rounding="gptq", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "moe", "tiny.gguf"]


def test_quantized_dtype_arguments_are_checked(tmp_path, tiny_llama):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, qtype=Q.Q4_0)
    with pytest.raises(ValueError, match="Endor compression takes float bundles"):
        convert(path, tmp_path / "s", dtype="q4", endor=True, progress=False)
    with pytest.raises(ValueError, match="down_format applies to the quantized dtypes"):
        convert(path, tmp_path / "s", dtype="fp16", down_format="q4_0", progress=False)
    with pytest.raises(ValueError, match="block format must be one of"):
        convert(path, tmp_path / "s", dtype="q4", down_format="q5_0", progress=False)
    with pytest.raises(ValueError, match="dtype must be one of"):
        convert(path, tmp_path / "s", dtype="q2", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def test_cli_convert_q4(tmp_path, tiny_llama, capsys):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, qtype=Q.Q4_0)
    out = tmp_path / "s"
    assert cli.main(["convert", str(path), str(out), "--dtype", "q4", "--down-format", "q4_1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "bundle_format=q4_0+q4_1" in lines[0]
    assert lines[1] == "FFN tensors: 4 kept Q4_0 blocks, 2 requantized Q4_0 -> q4_1"
    fs = store.FlashStore(out)
    assert torch.equal(_parts(fs, 1)["up"], torch.from_numpy(_gguf_tensor(path, "blk.1.ffn_up.weight")[0]))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_gguf_attention_and_embedding_blocks_are_kept_as_resident_blocks(tmp_path, tiny_llama, qtype):
    """A quantized store holds the GGUF's attention, embedding (and LM head) blocks as they are, q/k rows in the
    Hugging Face order: each dequantizes to exactly what the dequantized file gives; resident_tensor gives floats,
    resident_weight the blocks."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, qtype=qtype)
    ckpt = GGUFCheckpoint(path)
    fs = store.FlashStore(convert(path, tmp_path / "s", dtype="q4", progress=False))
    fmt = qtype.name.lower()
    names = [n for n in ckpt.names if "self_attn" in n or "embed_tokens" in n or "lm_head" in n]
    assert names and set(fs.resident_formats) == set(names)
    for name in names:
        weight = fs.resident_weight(name)
        assert weight.fmt == fmt and weight.shape == tuple(ckpt.shape(name))
        assert torch.equal(weight.dequantize(), ckpt[name])  # q and k un-permuted as the dequantized reader does
        assert torch.equal(fs.resident_tensor(name), ckpt[name].to(fs.dtype))
    assert fs.resident_nbytes() < sum(t.numel() * 2 for t in fs.resident().values())


def test_hugging_face_attention_takes_the_input_format_and_the_embedding_q8_0(tmp_path):
    model = tiny_model("llama", num_hidden_layers=1)
    model.save_pretrained(tmp_path / "hf")
    fs = store.FlashStore(convert(tmp_path / "hf", tmp_path / "s", dtype="q4", progress=False))
    formats = {name: fmt for name, (fmt, _) in fs.resident_formats.items()}
    assert formats["model.embed_tokens.weight"] == "q8_0" and formats["lm_head.weight"] == "q8_0"
    attention = {fmt for name, fmt in formats.items() if "self_attn" in name}
    assert attention == {"q4_0"} and len([n for n in formats if "self_attn" in n]) == 4
    weights = dict(model.state_dict())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(fs.resident_weight(q).blocks, quantize_rows(weights[q], "q4_0"))


@pytest.mark.parametrize(
    "formats,message",
    [
        ('{"model.norm.weight": ["q8_0", 64]}', "is not a resident uint8 tensor"),
        ('{"model.embed_tokens.weight": ["q5_0", 64]}', "must be \\[one of"),
        ('{"model.embed_tokens.weight": ["q8_0", 65]}', "is not a resident uint8 tensor"),
        ("[1]", "must map tensor names"),
        ("{", "not JSON"),
    ],
)
def test_bad_resident_formats_name_the_file_and_field(tmp_path, tiny_llama, formats, message):
    from safetensors import safe_open
    from flashllm_ext.io.safetensors import save_tensors

    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, qtype=Q.Q8_0)
    out = convert(path, tmp_path / "s", dtype="q8", progress=False)
    resident = out / store.RESIDENT_FILE
    with safe_open(resident, "pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k).clone() for k in f.keys()}
    save_tensors(tensors, tmp_path / "patched", {**meta, "resident_formats": formats})
    (tmp_path / "patched").replace(resident)
    with pytest.raises(FormatError, match=message) as e:
        store.FlashStore(out)
    assert "resident_formats" in str(e.value) and str(resident) in str(e.value)
