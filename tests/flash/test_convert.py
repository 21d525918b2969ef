import os
import weakref
from functools import partial

import pytest
import torch
from safetensors import safe_open

from flashllm_ext import FormatError, cli, endor
from flashllm_ext.flash import store
from flashllm_ext.flash.convert import convert, synthesize
from flashllm_ext.io.safetensors import PADDING_PREFIX, AlignedWriter, TensorSpec, read_header
from tests.helpers.models import tiny_model


def _llama() -> torch.nn.Module:
    return tiny_model("llama", num_hidden_layers=3)


def _opt() -> torch.nn.Module:
    return tiny_model("opt", seed=1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (checkpoint dir, state dict); the sharded Llama is split over several safetensors files."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, model, shard in (("llama", _llama(), None), ("llama_sharded", _llama(), "60KB"), ("opt", _opt(), None)):
        kwargs = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(root / name, **kwargs)
        out[name] = (root / name, {k: v.detach().clone() for k, v in model.state_dict().items()})
    assert (root / "llama_sharded" / "model.safetensors.index.json").is_file()
    return out


@pytest.fixture(scope="module")
def stores(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    return {name: convert(path, root / name, progress=False) for name, (path, _) in checkpoints.items()}


def _expected_bundles(state: dict[str, torch.Tensor], layer: int, dtype: torch.dtype) -> torch.Tensor:
    """Bundles computed independently of the converter, straight from the nn.Linear weights."""
    if any(".fc1." in k for k in state):
        prefix = f"model.decoder.layers.{layer}."
        up, gate, down = state[prefix + "fc1.weight"], None, state[prefix + "fc2.weight"]
    else:
        prefix = f"model.layers.{layer}.mlp."
        up, gate, down = (state[prefix + f"{p}_proj.weight"] for p in ("up", "gate", "down"))
    rows = []
    for i in range(up.shape[0]):
        parts = [up[i, :]] + ([gate[i, :]] if gate is not None else []) + [down[:, i]]
        rows.append(torch.cat(parts))
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("name", ["llama", "llama_sharded", "opt"])
def test_every_bundle_equals_original_weights(checkpoints, stores, name):
    _, state = checkpoints[name]
    fs = store.FlashStore(stores[name])
    assert fs.glu == (name != "opt")
    assert fs.n_layers == (2 if name == "opt" else 3)
    for layer in range(fs.n_layers):
        want = _expected_bundles(state, layer, torch.float16)
        assert torch.equal(fs.bundle(layer, torch.arange(fs.n_neurons)), want)
        ids = torch.tensor([5, 0, 5, fs.n_neurons - 1])
        assert torch.equal(fs.bundle(layer, ids), want[ids])
    assert fs.bundle(0, []).shape == (0, fs.bundle_width)


@pytest.mark.parametrize("name", ["llama", "opt"])
def test_plain_safetensors_opens_store_and_tensors_are_aligned(checkpoints, stores, name):
    fs = store.FlashStore(stores[name])
    header = read_header(fs.bundles_path)
    with safe_open(fs.bundles_path, framework="pt") as f:
        names = [k for k in f.keys() if not k.startswith(PADDING_PREFIX)]
        assert sorted(names) == sorted(store.layer_tensor_name(l) for l in range(fs.n_layers))
        for layer in range(fs.n_layers):
            t = f.get_tensor(store.layer_tensor_name(layer))
            assert torch.equal(t, fs.bundle(layer, torch.arange(fs.n_neurons)))
            assert fs.layer_location(layer).offset == header.tensors[store.layer_tensor_name(layer)].begin
    assert header.data_start % store.ALIGNMENT == 0
    assert all(e.begin % store.ALIGNMENT == 0 for n, e in header.tensors.items() if not n.startswith(PADDING_PREFIX))


def test_resident_holds_everything_but_ffn_weights(checkpoints, stores):
    _, state = checkpoints["opt"]
    fs = store.FlashStore(stores["opt"])
    resident = fs.resident()
    ffn = {k for k in state if k.endswith(("fc1.weight", "fc2.weight"))}
    saved = set(read_header(checkpoints["opt"][0] / "model.safetensors").tensors)
    assert set(resident) == saved - ffn
    assert "model.decoder.layers.0.fc1.bias" in resident
    assert torch.equal(resident["model.decoder.layers.1.fc1.bias"], state["model.decoder.layers.1.fc1.bias"].half())
    assert fs.config["model_type"] == "opt" and fs.config["ffn_dim"] == 136


def test_ffn_roles_name_every_layers_weights_and_biases(checkpoints, stores):
    """The store records each layer's FFN tensor names by role; biases are read back through them."""
    opt, llama = store.FlashStore(stores["opt"]), store.FlashStore(stores["llama"])
    prefix = "model.decoder.layers.1."
    assert opt.ffn_roles[1] == {
        "up": prefix + "fc1.weight",
        "down": prefix + "fc2.weight",
        "up_bias": prefix + "fc1.bias",
        "down_bias": prefix + "fc2.bias",
    }
    state = checkpoints["opt"][1]
    assert torch.equal(opt.layer_bias(1, "up_bias"), state[prefix + "fc1.bias"].half())
    assert torch.equal(opt.layer_bias(1, "down_bias"), state[prefix + "fc2.bias"].half())
    assert opt.layer_bias(1, "gate_bias") is None
    mlp = "model.layers.2.mlp."
    assert llama.ffn_roles[2] == {r: f"{mlp}{r}_proj.weight" for r in ("up", "gate", "down")}


def test_glu_biases(tmp_path):
    """Llama with mlp_bias: the gate bias feeds the activation, the down bias the output; an up_proj bias has no
    place in the bundle kernel and the cache refuses it."""
    from flashllm_ext.flash.cache import NeuronCache, layer_input_bias

    model = tiny_model(
        "llama",
        hidden_size=16,
        intermediate_size=24,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
        mlp_bias=True,
    )
    model.save_pretrained(tmp_path / "ckpt")
    fs = store.FlashStore(convert(tmp_path / "ckpt", tmp_path / "s", dtype="fp32", progress=False))
    assert set(fs.ffn_roles[1]) == {"up", "gate", "down", "up_bias", "gate_bias", "down_bias"}
    assert torch.equal(fs.layer_bias(1, "gate_bias"), model.model.layers[1].mlp.gate_proj.bias)
    with pytest.raises(ValueError, match="up_proj bias"):
        layer_input_bias(fs, 1)
    with pytest.raises(ValueError, match="up_proj bias"):
        NeuronCache(fs, 0, capacity=4)


def test_integer_and_bool_resident_buffers_keep_their_dtype(checkpoints, tmp_path):
    """Only float tensors take the store dtype: int64 ids past fp16's exact range and bool masks come back as
    they were saved."""
    from safetensors.torch import load_file, save_file

    source, state = checkpoints["llama"]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    buffers = {
        "model.position_ids": torch.arange(5000, dtype=torch.int64).unsqueeze(0),
        "model.layers.0.self_attn.index_table": torch.tensor([[-7, 70000], [3, 2049]], dtype=torch.int32),
        "model.layers.0.self_attn.causal_mask": torch.ones(4, 4, dtype=torch.bool).tril(),
    }
    save_file({**tensors, **buffers}, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    resident = store.FlashStore(convert(ckpt, tmp_path / "s", dtype="fp16", progress=False)).resident()
    for name, buffer in buffers.items():
        assert resident[name].dtype == buffer.dtype and torch.equal(resident[name], buffer), name
    norm = "model.layers.0.input_layernorm.weight"
    assert resident[norm].dtype == torch.float16 and torch.equal(resident[norm], state[norm].half())


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_dtypes(checkpoints, tmp_path, dtype):
    path, state = checkpoints["llama"]
    fs = store.FlashStore(convert(path, tmp_path / "s", dtype=dtype, progress=False))
    assert fs.dtype == store.DTYPES[dtype]
    assert torch.equal(fs.bundle(2, torch.arange(fs.n_neurons)), _expected_bundles(state, 2, fs.dtype))


def test_endor_store_round_trips_pruned_weights(tmp_path):
    model = _llama()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.mlp.up_proj, layer.mlp.gate_proj, layer.mlp.down_proj):
                proj.weight.copy_(endor.prune(proj.weight, 0.7))
    model.save_pretrained(tmp_path / "ckpt")
    state = model.state_dict()
    convert(tmp_path / "ckpt", tmp_path / "dense", progress=False)
    fs = store.FlashStore(convert(tmp_path / "ckpt", tmp_path / "endor", endor=True, progress=False))
    assert fs.endor
    for layer in range(fs.n_layers):
        want = _expected_bundles(state, layer, torch.float16)
        assert torch.equal(fs.bundle(layer, torch.arange(fs.n_neurons)), want)
        ids = torch.tensor([7, 3, 7, 0])
        assert torch.equal(fs.bundle(layer, ids), want[ids])
    assert (tmp_path / "endor" / store.BUNDLES_FILE).stat().st_size < 0.6 * (
        tmp_path / "dense" / store.BUNDLES_FILE
    ).stat().st_size
    with pytest.raises(ValueError, match="Endor"):
        fs.layer_location(0)


def test_endor_convert_holds_one_compressed_layer_at_a_time(tmp_path, monkeypatch):
    """convert(endor=True) sizes the layers first (counting, not compressing), then compresses and writes one layer
    at a time: no two layers' EndorTensors are ever alive together."""
    model = _llama()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.mlp.up_proj, layer.mlp.gate_proj, layer.mlp.down_proj):
                proj.weight.copy_(endor.prune(proj.weight, 0.5))
    model.save_pretrained(tmp_path / "ckpt")
    alive: weakref.WeakSet = weakref.WeakSet()
    most_alive, compressed = [0], []
    real_compress = endor.compress

    def tracked_compress(w):
        t = real_compress(w)
        alive.add(t)
        compressed.append(t.shape)
        most_alive[0] = max(most_alive[0], len(alive))
        return t

    monkeypatch.setattr(endor, "compress", tracked_compress)
    fs = store.FlashStore(convert(tmp_path / "ckpt", tmp_path / "s", endor=True, progress=False))
    assert len(compressed) == fs.n_layers and most_alive[0] == 1
    state = model.state_dict()
    for layer in range(fs.n_layers):
        assert torch.equal(fs.bundle(layer, torch.arange(fs.n_neurons)), _expected_bundles(state, layer, torch.float16))


def test_refuses_to_overwrite_and_force_replaces(checkpoints, tmp_path):
    path, _ = checkpoints["opt"]
    out = convert(path, tmp_path / "s", progress=False)
    with pytest.raises(FileExistsError, match="force"):
        convert(path, out, progress=False)
    convert(checkpoints["llama"][0], out, force=True, progress=False)
    assert store.FlashStore(out).glu
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]  # no temporary or old directory left


@pytest.mark.parametrize("converter", ["flash store", "layer store"])
def test_force_replaces_a_store_and_nothing_else(checkpoints, tmp_path, monkeypatch, converter):
    """force=True replaces a store or an empty directory, and refuses, before writing anything, a directory holding
    other files (the working directory given as "." too), the checkpoint itself or a directory holding it (also
    as "."), and a file."""
    import shutil

    from flashllm_ext.offload.convert import convert_offload

    write = partial(convert, progress=False) if converter == "flash store" else partial(convert_offload, progress=False)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints["opt"][0], ckpt)
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("keep me")
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("keep me too")
    monkeypatch.chdir(tmp_path / "work")
    for other_files in (tmp_path / "work", "."):
        with pytest.raises(FileExistsError, match="holds files but no"):
            write(ckpt, other_files, force=True)
    with pytest.raises(FileExistsError, match="is not a directory"):
        write(ckpt, tmp_path / "a-file", force=True)
    monkeypatch.chdir(tmp_path)
    for holder in (ckpt, tmp_path, "."):
        with pytest.raises(ValueError, match="the checkpoint it would be written from"):
            write("ckpt", holder, force=True)
    assert [p.name for p in (tmp_path / "work").iterdir()] == ["notes.txt"]
    assert (tmp_path / "a-file").read_text() == "keep me too" and (ckpt / "config.json").is_file()
    assert write(ckpt, "empty", force=True) == (tmp_path / "empty").resolve()
    write(checkpoints["llama"][0], "empty", force=True)  # a store: replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "ckpt", "empty", "work"]  # nothing left beside


def test_failed_conversion_leaves_nothing(checkpoints, tmp_path, monkeypatch):
    def broken_verify(*args):
        raise RuntimeError("read-back differs")

    monkeypatch.setattr("flashllm_ext.flash.convert._verify", broken_verify)
    with pytest.raises(RuntimeError, match="read-back"):
        convert(checkpoints["opt"][0], tmp_path / "s", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_verification_catches_corrupt_write(checkpoints, tmp_path, monkeypatch):
    real_write_rows = AlignedWriter.write_rows

    def corrupting_write_rows(self, name, chunks):
        if name.endswith("1.bundles"):
            chunks = (chunk.clone().fill_(1) for chunk in chunks)
        real_write_rows(self, name, chunks)

    monkeypatch.setattr(AlignedWriter, "write_rows", corrupting_write_rows)
    with pytest.raises(RuntimeError, match="layer 1"):
        convert(checkpoints["llama"][0], tmp_path / "s", progress=False)


def test_gguf_converts_one_tensor_at_a_time(tmp_path, tiny_llama, monkeypatch):
    """A GGUF converts through GGUFCheckpoint: bundles equal the model's weights (F32 GGUF: exact), and at no time
    are more dequantized fp32 tensors alive than one layer's up, gate and down."""
    from flashllm_ext.io.checkpoint import GGUFCheckpoint
    from tests.helpers.checkpoints import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama)
    alive: weakref.WeakSet = weakref.WeakSet()
    most_alive = [0]
    real_getitem = GGUFCheckpoint.__getitem__

    def tracked_getitem(self, name):
        tensor = real_getitem(self, name)
        alive.add(tensor)
        most_alive[0] = max(most_alive[0], len(alive))
        return tensor

    monkeypatch.setattr(GGUFCheckpoint, "__getitem__", tracked_getitem)
    fs = store.FlashStore(convert(path, tmp_path / "s", progress=False))
    state = tiny_llama.state_dict()
    for layer in range(fs.n_layers):
        assert torch.equal(fs.bundle(layer, torch.arange(fs.n_neurons)), _expected_bundles(state, layer, torch.float16))
    assert 0 < most_alive[0] <= 3


def test_cli_convert(checkpoints, tmp_path, capsys):
    assert cli.main(["convert", str(checkpoints["opt"][0]), str(tmp_path / "s"), "--dtype", "fp32"]) == 0
    assert "FlashStore" in capsys.readouterr().out
    assert store.FlashStore(tmp_path / "s").dtype == torch.float32


def test_bad_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError):
        convert(tmp_path / "missing", tmp_path / "s")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FormatError, match="config.json"):
        convert(tmp_path / "empty", tmp_path / "s")
    with pytest.raises(ValueError, match="dtype"):
        convert(tmp_path / "empty", tmp_path / "s", dtype="fp8")
    (tmp_path / "empty" / "config.json").write_text("{not json")
    with pytest.raises(FormatError, match="config.json: not readable JSON"):
        convert(tmp_path / "empty", tmp_path / "s")
    (tmp_path / "empty" / "config.json").write_text("{}")
    (tmp_path / "empty" / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(FormatError, match="must be a JSON object"):
        convert(tmp_path / "empty", tmp_path / "s")


def test_synthesized_store(tmp_path):
    fs = store.FlashStore(synthesize(tmp_path / "s", n_layers=2, hidden_size=40, n_neurons=300, glu=True))
    assert (fs.n_layers, fs.n_neurons, fs.bundle_width, fs.glu) == (2, 300, 120, True)
    with safe_open(fs.bundles_path, framework="pt") as f:
        assert torch.equal(f.get_tensor("layers.1.bundles")[[4, 2]], fs.bundle(1, [4, 2]))
    assert fs.resident() == {}


@pytest.mark.slow
def test_convert_the_default_model(default_model, tmp_path):
    """The embedded default model's GGUF: every checked bundle equals transformers' own weights (fp16)."""
    path, model, _ = default_model
    s = store.FlashStore(convert(path, tmp_path / "smollm2", progress=False))
    d = model.config.hidden_size
    assert (s.n_layers, s.n_neurons, s.hidden_size, s.glu, s.bundle_width) == (30, 1536, d, True, 3 * d)
    state = model.state_dict()
    ids = torch.tensor([1535, 0, 7, 800, 801])
    for layer in (0, 15, 29):
        mlp = f"model.layers.{layer}.mlp."
        up, gate, down = (state[f"{mlp}{k}_proj.weight"].half() for k in ("up", "gate", "down"))
        got = s.bundle(layer, ids)
        assert torch.equal(got[:, :d], up[ids]) and torch.equal(got[:, d : 2 * d], gate[ids])
        assert torch.equal(got[:, 2 * d :], down[:, ids].t())
    assert torch.equal(s.resident()["model.embed_tokens.weight"], state["model.embed_tokens.weight"].half())
    with safe_open(s.bundles_path, "pt") as f:  # any safetensors reader opens the store
        assert torch.equal(f.get_tensor(store.layer_tensor_name(3))[5], s.bundle(3, [5])[0])


def test_convert_more_than_ten_layers(tmp_path):
    # tensor names sort as strings (layers.10 before layers.2); the store must still be written in layer order
    model = tiny_model(
        "llama",
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=11,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
    )
    model.save_pretrained(tmp_path / "ckpt")
    s = store.FlashStore(convert(tmp_path / "ckpt", tmp_path / "s", dtype="fp32", progress=False))
    for layer in (2, 10):
        up = model.state_dict()[f"model.layers.{layer}.mlp.up_proj.weight"]
        assert torch.equal(s.bundle(layer, [3])[0, :8], up[3])


@pytest.mark.parametrize("converter", ["flash store", "layer store"])
def test_force_keeps_files_it_did_not_write_and_the_folder_mode(checkpoints, tmp_path, converter):
    """force=True on a store holding another file refuses, naming that file, before any work (the file survives);
    on a store alone it replaces the store's files and keeps the folder's mode."""
    from flashllm_ext.offload.convert import convert_offload

    write = partial(convert, progress=False) if converter == "flash store" else partial(convert_offload, progress=False)
    ckpt = checkpoints["opt"][0]
    out = write(ckpt, tmp_path / "s")
    (out / "thesis.txt").write_text("four years of work")
    with pytest.raises(FileExistsError, match="thesis.txt"):
        write(ckpt, out, force=True)
    assert (out / "thesis.txt").read_text() == "four years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]  # refused before any work: nothing written beside
    (out / "thesis.txt").unlink()
    out.chmod(0o750)
    write(checkpoints["llama"][0], out, force=True)
    assert out.stat().st_mode & 0o777 == 0o750
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_force_keeps_a_file_put_in_the_store_while_it_is_written(checkpoints, tmp_path, monkeypatch):
    """A file saved into OUT after the check, while the new store is being written, is moved into the new folder,
    not removed with the old store."""
    import flashllm_ext.flash.convert as convert_module

    out = convert(checkpoints["opt"][0], tmp_path / "s", progress=False)
    real_verify = convert_module._verify

    def verify_then_save_a_file(*args):
        real_verify(*args)
        (out / "notes.txt").write_text("written meanwhile")

    monkeypatch.setattr(convert_module, "_verify", verify_then_save_a_file)
    convert(checkpoints["llama"][0], out, force=True, progress=False)
    assert (out / "notes.txt").read_text() == "written meanwhile" and store.FlashStore(out).glu
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


@pytest.mark.parametrize("converter", ["flash store", "layer store"])
def test_stale_staging_folders_of_dead_converts_are_removed(checkpoints, tmp_path, converter):
    """A convert killed mid-way leaves its staging folder beside OUT: the next convert into OUT removes those of
    dead processes and names (without touching) those it cannot tell are dead."""
    import subprocess

    from flashllm_ext.offload.convert import convert_offload

    write = partial(convert, progress=False) if converter == "flash store" else partial(convert_offload, progress=False)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".s.tmp-{dead.pid}-x1y2"
    running = tmp_path / f".s.tmp-{os.getppid()}-a3b4"  # a live process: maybe a convert still running
    for d in (stale, running):
        d.mkdir()
        (d / "bundles.safetensors").write_bytes(b"\0" * 4096)
    other = tmp_path / f".t.tmp-{dead.pid}-c5d6"  # another store's: not this convert's to judge
    other.mkdir()
    with pytest.warns(UserWarning, match=str(running)):
        write(checkpoints["opt"][0], tmp_path / "s")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["s", running.name, other.name])


def test_index_naming_a_shard_outside_the_checkpoint_is_refused(checkpoints, tmp_path):
    """model.safetensors.index.json is untrusted: a shard path leaving the checkpoint folder (.. or absolute) is a
    FormatError naming the entry, before the file is opened."""
    import json
    import shutil

    src = checkpoints["llama"][0]
    (tmp_path / "outside").mkdir()
    shutil.copy(src / "model.safetensors", tmp_path / "outside" / "x.safetensors")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(src / "config.json", ckpt / "config.json")
    names = list(checkpoints["llama"][1])
    for shard in ("../outside/x.safetensors", str(tmp_path / "outside" / "x.safetensors"), "a/../../outside/x"):
        index = {"metadata": {}, "weight_map": {name: shard for name in names}}
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(FormatError, match=f"weight_map.*{shard}.*outside"):
            convert(ckpt, tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("converter", ["flash store", "layer store"])
def test_store_files_follow_the_umask(checkpoints, tmp_path, umask, converter):
    """A store is the user's like any file they write: its folder and files take the umask's modes."""
    from flashllm_ext.offload.convert import convert_offload

    write = partial(convert, progress=False) if converter == "flash store" else partial(convert_offload, progress=False)
    for mask, dir_mode, file_mode in ((0o022, 0o755, 0o644), (0o077, 0o700, 0o600)):
        umask(mask)
        out = write(checkpoints["opt"][0], tmp_path / f"s{mask:o}")
        assert out.stat().st_mode & 0o777 == dir_mode
        assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {file_mode}


def test_aligned_writer_takes_a_tensor_in_blocks_of_rows(tmp_path):
    """write_rows writes a tensor from blocks of its rows (what safetensors reads back is the whole tensor) and
    refuses blocks of another row shape or dtype, and too many or too few rows."""
    tensor = torch.arange(24, dtype=torch.float16).reshape(6, 4)
    specs = [TensorSpec("a", "F16", (6, 4)), TensorSpec("b", "F16", (3,))]
    with AlignedWriter(tmp_path / "x.safetensors", specs, alignment=64) as writer:
        writer.write_rows("a", [tensor[:1], tensor[1:5], tensor[5:]])
        writer.write("b", torch.ones(3, dtype=torch.float16))
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        assert torch.equal(f.get_tensor("a"), tensor) and torch.equal(f.get_tensor("b"), torch.ones(3).half())
    for blocks, match in (
        ([tensor[:3], tensor[3:].reshape(-1, 2)], r"got torch.float16\[6, 2\] \(rows from 3 on\)"),
        ([tensor[:3], tensor[3:].float()], r"got torch.float32\[3, 4\]"),
        ([tensor, tensor[:1]], r"got torch.float16\[1, 4\] \(rows from 6 on\)"),
        ([tensor[:5]], r"got 5 rows \(40 bytes\)"),
    ):
        writer = AlignedWriter(tmp_path / "y.safetensors", specs[:1])
        with pytest.raises(ValueError, match=r"a: declared F16\[6, 4\], " + match):
            writer.write_rows("a", blocks)
