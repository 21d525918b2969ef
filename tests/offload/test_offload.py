"""Offloaded inference (flashllm_ext.offload): greedy tokens equal to transformers' in every mode, placement by the
budget (nearest first, more layers when kept compressed), the minimum budget, read failures, the store format."""

import os
import re
from functools import partial

import pytest
import torch

from flashllm_ext import FormatError, endor, offload
from flashllm_ext.io.checkpoint import TensorsCheckpoint
from flashllm_ext.flash.convert import convert
from flashllm_ext.runtime import parse_budget
from flashllm_ext.offload.store import LayerStore
from flashllm_ext.offload.runtime import OffloadedLinear
from flashllm_ext.offload.convert import convert_offload
from flashllm_ext.offload import load_offload, load_offloaded, patch_offload
from flashllm_ext.offload.placement import plan_placement
from flashllm_ext.flash.reader import host_bounce_bytes, kvikio_available
from flashllm_ext.io.buffers import pinned_buffer, pinned_bytes
from tests.helpers.memory import mapped_ranges, page_locked
from tests.helpers.models import tiny_model

N_LAYERS = 6


def pruned_model(kind: str) -> torch.nn.Module:
    sizes = dict(hidden_size=128, num_hidden_layers=N_LAYERS, vocab_size=96, max_position_embeddings=64)
    if kind == "llama":
        model = tiny_model("llama", intermediate_size=352, **sizes)
    else:
        model = tiny_model("opt", ffn_dim=352, **sizes)
    with torch.no_grad():  # 50% magnitude pruning of every decoder-layer Linear, as a pruned checkpoint has
        for name, p in model.named_parameters():
            if ".layers." in name and name.endswith(".weight") and p.dim() == 2:
                p.copy_(endor.prune(p, 0.5))
    return model.eval()


def model_checkpoint(model: torch.nn.Module) -> TensorsCheckpoint:
    # named_parameters lists a tied weight once, as save_pretrained writes it.
    return TensorsCheckpoint(model.config.to_dict(), {n: p.detach() for n, p in model.named_parameters()})


@pytest.fixture(scope="module", params=["llama", "opt"])
def case(request, tmp_path_factory):
    model = pruned_model(request.param)
    root = tmp_path_factory.mktemp(request.param)
    ckpt = model_checkpoint(model)
    dense = convert_offload(ckpt, root / "dense", dtype="fp32", progress=False)
    compressed = convert_offload(ckpt, root / "endor", dtype="fp32", endor_compress=True, progress=False)
    prompt = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(1))
    reference = model.generate(prompt, max_new_tokens=8, do_sample=False)
    return {"model": model, "dense": dense, "endor": compressed, "prompt": prompt, "reference": reference}


def store_of(case, mode):
    return case["dense"] if mode == "dense" else case["endor"]


def budget_for(store: LayerStore, mode: str, in_memory: int, resident: int) -> int:
    """The least budget that keeps `in_memory` layers in memory in `mode`."""
    keep = mode == "endor+more-resident"
    cost = sum(store.stored_bytes(i) if keep else store.dense_bytes(i) for i in range(in_memory))
    return resident + cost + _staging(store, mode, in_memory)


def _staging(store: LayerStore, mode: str, k: int) -> int:
    """Two read buffers of the largest SSD layer + a decompression buffer for a block of rows of the largest Endor
    matrix computed from its compressed form (SSD layers, and in-memory ones in endor+more-resident)."""
    rest = [store.stored_bytes(i) for i in range(k, store.n_layers)]
    item = store.dtype.itemsize
    decompress = max(
        (
            offload.decompress_block_rows(*e.shape, item) * e.shape[1] * item
            for i in range(store.n_layers)
            for e in store.layers[i]
            if e.endor and (i >= k or mode == "endor+more-resident")
        ),
        default=0,
    )
    return 2 * max(rest, default=0) + decompress


@pytest.mark.parametrize("mode", ["dense", "endor", "endor+more-resident"])
@pytest.mark.parametrize("in_memory", [0, 2, N_LAYERS])
def test_greedy_tokens_equal_transformers(case, mode, in_memory):
    store = LayerStore(store_of(case, mode))
    model = load_offload(store.path, None, mode=mode)  # resident bytes of the built model, for the budget
    resident = model.offload.resident_bytes
    model = load_offload(store.path, budget_for(store, mode, in_memory, resident), mode=mode)
    assert model.offload.layers_in_memory == in_memory and model.offload.layers_on_ssd == N_LAYERS - in_memory
    out = model.generate(case["prompt"], max_new_tokens=8, do_sample=False)
    assert torch.equal(out, case["reference"])
    stats = model.offload.stats()
    tokens = stats["forwards"]
    assert tokens == 8
    want = sum(store.stored_bytes(i) for i in range(in_memory, N_LAYERS))
    assert stats["bytes_read_per_token"] == want  # every SSD layer, every token, once
    assert stats["accounted_bytes"] <= stats["budget_bytes"]
    model.offload.close()


def test_endor_reads_fewer_bytes_and_decode_paths_agree(case):
    dense, compressed = LayerStore(case["dense"]), LayerStore(case["endor"])
    assert compressed.endor and not dense.endor
    assert sum(map(compressed.stored_bytes, range(N_LAYERS))) < 0.75 * sum(map(dense.stored_bytes, range(N_LAYERS)))
    for compute in ("linear", "decompress"):
        model = load_offload(case["endor"], None, mode="endor+more-resident", compute=compute)
        assert torch.equal(model.generate(case["prompt"], max_new_tokens=8, do_sample=False), case["reference"])


@pytest.mark.parametrize(
    "block_bytes, buffer_bytes", [(1, 352 * 4), (3 * 128 * 4, 3 * 128 * 4), (1 << 30, 352 * 128 * 4)]
)
def test_prompts_decompress_a_block_of_rows_at_a_time(case, monkeypatch, block_bytes, buffer_bytes):
    """Blocks of one row (the buffer holds the widest row, of fc2/down: 352 columns), of 3 rows of 128 columns (no
    matrix has a multiple of 3 rows: short last blocks; the wider ones one row a block), and whole matrices (the
    largest, 352 x 128): the same tokens, and the buffer charged is that block."""
    monkeypatch.setattr(offload.placement, "DECOMPRESS_BLOCK_BYTES", block_bytes)
    model = load_offload(case["endor"], None, mode="endor+more-resident", compute="decompress")
    assert torch.equal(model.generate(case["prompt"], max_new_tokens=8, do_sample=False), case["reference"])
    assert model.offload.placement.decompress_bytes == buffer_bytes
    assert model.offload.stats()["decompress_ms"] > 0
    model.offload.close()


def test_placement_nearest_first_and_more_layers_when_compressed(case):
    store = LayerStore(case["endor"])
    resident = load_offload(store.path, None, mode="endor").offload.resident_bytes
    counts = {}
    for budget in range(
        resident + _staging(store, "endor", 0), resident + 4 * store.dense_bytes(0), store.dense_bytes(0) // 8
    ):
        for mode in ("endor", "endor+more-resident"):
            model = load_offload(store.path, budget, mode=mode)
            runtime, k = model.offload, model.offload.layers_in_memory
            counts.setdefault(mode, []).append(k)
            # Nearest first: the first k layers are held, and a forward (with the fetch it starts for the next one)
            # reads exactly the others from the store.
            read = []
            read_layer = runtime.read_layer
            runtime.read_layer = lambda layer, out: (read.append(layer), read_layer(layer, out))[1]
            model(case["prompt"][:, :4])
            runtime.close()  # waits for that fetch
            assert len(runtime.memory) == k and sorted(set(read)) == list(range(k, N_LAYERS))
            assert runtime.accounted_bytes <= budget
    assert counts["endor"] == sorted(counts["endor"])
    assert all(c >= e for c, e in zip(counts["endor+more-resident"], counts["endor"]))
    assert any(c > e for c, e in zip(counts["endor+more-resident"], counts["endor"]))


@pytest.mark.parametrize("mode", ["dense", "endor+more-resident"])
def test_budget_below_minimum_is_refused_naming_it(case, mode):
    store = LayerStore(store_of(case, mode))
    resident = load_offload(store.path, None, mode=mode).offload.resident_bytes
    minimum = resident + _staging(store, mode, 0)
    with pytest.raises(ValueError, match=re.escape(f"below the minimum of {minimum} for {mode} offload")):
        load_offload(store.path, minimum - 1, mode=mode)
    load_offload(store.path, minimum, mode=mode).offload.close()


def test_read_failure_raises_and_model_stays_usable(case):
    path = os.path.join(case["endor"], "layers.safetensors")
    with open(path, "rb") as f:
        original = f.read()
    model = load_offload(case["endor"], None, mode="endor")
    model.offload.close()
    store = LayerStore(case["endor"])
    model = load_offload(case["endor"], budget_for(store, "endor", 1, model.offload.resident_bytes), mode="endor")
    last_offset, _ = store.layer_range(N_LAYERS - 1)
    try:
        with open(path, "r+b") as f:
            f.truncate(last_offset)  # the last layer's range is gone: its read hits the end of the file
        with pytest.raises(RuntimeError, match=f"reading layer {N_LAYERS - 1} from .*layers.safetensors failed"):
            model.generate(case["prompt"], max_new_tokens=8, do_sample=False)
    finally:
        with open(path, "wb") as f:
            f.write(original)
    out = model.generate(case["prompt"], max_new_tokens=8, do_sample=False)
    assert torch.equal(out, case["reference"])
    model.offload.close()


def test_patch_and_unpatch(case):
    model = case["model"]
    runtime = patch_offload(model, case["endor"], mode="endor", dram_budget="60%")
    assert runtime.layers_on_ssd > 0
    with pytest.raises(ValueError, match="already offloaded"):
        patch_offload(model, case["endor"], mode="endor")
    assert torch.equal(model.generate(case["prompt"], max_new_tokens=8, do_sample=False), case["reference"])
    runtime.unpatch(model)
    assert not any(isinstance(m, OffloadedLinear) for m in model.modules()) and not hasattr(model, "offload")
    assert torch.equal(model.generate(case["prompt"], max_new_tokens=8, do_sample=False), case["reference"])
    # A runtime unpatched already, or replaced by a newer patch, leaves the model alone.
    again = patch_offload(model, case["endor"], mode="endor", dram_budget="60%")
    with pytest.raises(RuntimeError, match="no longer serves that model"):
        runtime.unpatch(model)
    assert model.offload is again
    assert torch.equal(model.generate(case["prompt"], max_new_tokens=8, do_sample=False), case["reference"])
    with pytest.warns(DeprecationWarning, match=r"use model.offload.stats\(\)"):
        assert model.offload_stats()["forwards"] == again.stats()["forwards"] > 0
    again.unpatch(model)
    with pytest.warns(DeprecationWarning, match="use load_offload"):
        load_offloaded(case["endor"], "60%", mode="endor").offload.close()


def test_a_closed_runtime_refuses_to_run(case):
    model = load_offload(case["endor"], "60%", mode="endor")
    assert model.offload.layers_on_ssd > 0
    model.offload.close()
    with pytest.raises(RuntimeError, match="runtime is closed"):
        model.generate(case["prompt"], max_new_tokens=2, do_sample=False)


def test_bad_arguments_and_stores(case, tmp_path):
    for kind in ("dense", "endor"):  # without a mode: the store's own
        model = load_offload(case[kind], None)
        assert model.offload.mode == kind
        model.offload.close()
    with pytest.raises(ValueError, match="needs an Endor layer store"):
        load_offload(case["dense"], None, mode="endor")
    with pytest.raises(ValueError, match="mode must be one of"):
        load_offload(case["endor"], None, mode="flash")
    with pytest.raises(ValueError, match="compute must be one of"):
        load_offload(case["endor"], None, mode="endor", compute="gemm")
    with pytest.raises(ValueError, match="differ from the store's"):
        patch_offload(pruned_model("llama" if "opt" in str(case["endor"]) else "opt"), case["endor"])
    with pytest.raises(FileExistsError):
        convert_offload(model_checkpoint(case["model"]), case["dense"], dtype="fp32")
    # Counts are ints (not floats, strings or bools), budgets finite; each refusal names its argument.
    for name, value in (
        ("layers_in_memory", 2.5),
        ("layers_in_memory", "2"),
        ("layers_in_memory", True),
        ("layers_on_device", 1.0),
        ("slots", 1.0),
        ("slots", True),
        ("threads", 0),
        ("dram_budget", float("nan")),
        ("dram_budget", float("inf")),
    ):
        with pytest.raises(ValueError, match=f"{name} must be"):
            load_offload(case["endor"], **{"dram_budget": None, "mode": "endor", name: value})
    store = LayerStore(case["endor"])
    with pytest.raises(TypeError, match="store must be a LayerStore, got str"):
        plan_placement(str(case["endor"]), "endor", None)
    with pytest.raises(ValueError, match="mode must be one of"):
        plan_placement(store, "bogus", None)
    with pytest.raises(ValueError, match="dense mode needs a dense layer store"):
        plan_placement(store, "dense", None)
    with pytest.raises(ValueError, match="layer_budget must be bytes"):
        plan_placement(store, "endor", "30%")
    case["model"].save_pretrained(tmp_path / "hf")
    flash = convert(tmp_path / "hf", tmp_path / "flash", progress=False)
    for where, says in (
        (tmp_path / "none", "it does not exist"),
        (flash, "it is a flash store: load_flash"),
        (tmp_path / "hf", "a checkpoint\\? convert_offload"),
        (tmp_path, "no layers.safetensors in it"),
    ):
        with pytest.raises(FileNotFoundError, match=f"is not a layer store \\({says}"):
            LayerStore(where)
    broken = tmp_path / "broken"
    broken.mkdir()
    data = open(os.path.join(case["endor"], "layers.safetensors"), "rb").read()
    (broken / "resident.safetensors").write_bytes(
        open(os.path.join(case["endor"], "resident.safetensors"), "rb").read()
    )
    (broken / "layers.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError, match="layers.safetensors"):
        LayerStore(broken)


def test_cli_converts_a_hugging_face_directory(tmp_path, capsys):
    from flashllm_ext import cli

    model = pruned_model("opt")
    model.save_pretrained(tmp_path / "hf")
    assert (
        cli.main(["offload", str(tmp_path / "store"), "--convert", str(tmp_path / "hf"), "--endor", "--dtype", "fp32"])
        == 0
    )
    assert "endor=True" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="flashllm offload: --device-budget applies to --device cuda"):
        cli.main(["offload", str(tmp_path / "store"), "--tokenizer", str(tmp_path / "hf"), "--device-budget", "20%"])
    # Clean exits, not tracebacks: a store there already, no store, a missing tokenizer (before the model loads).
    for store, argv, says in (
        ("store", ["--convert", str(tmp_path / "hf")], "exists; pass force=True"),
        ("new", ["--convert", str(tmp_path / "none")], "none"),
        ("nowhere", ["--tokenizer", str(tmp_path / "hf")], "is not a layer store"),
        ("store", ["--tokenizer", str(tmp_path / "no-tokenizer")], "--tokenizer .* does not"),
        ("store", ["--tokenizer", str(tmp_path / "hf"), "--endor"], "apply to --convert"),
    ):
        with pytest.raises(SystemExit, match=f"flashllm offload: .*{says}"):
            cli.main(["offload", str(tmp_path / store), *argv])
    offloaded = load_offload(tmp_path / "store", "60%", mode="endor")
    prompt = torch.tensor([[5, 7, 11, 13]])
    assert torch.equal(
        offloaded.generate(prompt, max_new_tokens=4, do_sample=False),
        model.generate(prompt, max_new_tokens=4, do_sample=False),
    )
    offloaded.offload.close()


@pytest.mark.slow
def test_default_model_wanda_pruned_greedy_tokens(default_model, tmp_path, capsys):
    """The Wanda-50%-pruned default model (attention and FFN), fp16: offloaded at 30% in dense and Endor modes gives
    transformers' greedy tokens."""
    from flashllm_ext.demos.endor import decoder_linear_names, wanda_prune
    from flashllm_ext.hub import corpus_token_ids, replace_weights

    from flashllm_ext import cli

    gguf, model, tokenizer = default_model
    names = decoder_linear_names(model)
    originals = {n: t.clone() for n, t in model.state_dict().items()}  # every tensor: the fp16 cast below rounds all
    pruned = wanda_prune(
        model, corpus_token_ids(tokenizer, "calibration", 128), names, 0.5, torch.float16, progress=False
    )
    try:
        replace_weights(model, pruned)
        reference_model = model.to(torch.float16)
        ckpt = model_checkpoint(reference_model)
        prompt = corpus_token_ids(tokenizer, "heldout", 16).view(1, -1)
        reference = reference_model.generate(prompt, max_new_tokens=12, do_sample=False)
        for mode, compress in (("dense", False), ("endor", True)):
            store = convert_offload(
                ckpt, tmp_path / mode, dtype="fp16", endor_compress=compress, force=True, progress=False
            )
            offloaded = load_offload(store, "30%", mode=mode)
            assert offloaded.offload.layers_on_ssd > 0
            out = offloaded.generate(prompt, max_new_tokens=12, do_sample=False)
            assert out.tolist() == reference.tolist(), mode
            offloaded.offload.close()
        assert (
            cli.main(
                ["offload", str(store), "--tokenizer", str(gguf), "--mode", "endor", "--tokens", "4", "--slots", "1"]
            )
            == 0
        )
        out = capsys.readouterr().out
        assert "tokens in" in out and "bytes_read_per_token" in out and "slots 1" in out
    finally:
        model.to(torch.float32)
        model.load_state_dict(originals)


def test_forced_placement_compares_modes_on_the_same_layers(case):
    store = LayerStore(case["endor"])
    resident = load_offload(store.path, None, mode="endor").offload.resident_bytes
    budget = budget_for(store, "endor", 2, resident)
    model = load_offload(store.path, budget, mode="endor", layers_in_memory=1)
    assert model.offload.layers_in_memory == 1 and model.offload.accounted_bytes <= budget
    assert torch.equal(model.generate(case["prompt"], max_new_tokens=8, do_sample=False), case["reference"])
    model.offload.close()
    with pytest.raises(ValueError, match="3 layers in memory in endor mode need"):
        load_offload(store.path, budget, mode="endor", layers_in_memory=3)


@pytest.mark.parametrize("mode", ["dense", "endor+more-resident"])
def test_one_slot_holds_one_layer_more(case, mode):
    """slots=1 at the budget that holds k layers beside two slots: k + 1 layers (a slot is as large as a moved
    layer, as stored), the same tokens (the next fetch waits for the layer using the slot), every SSD layer read
    once per token. The CPU's default is two slots. slots must be 1, 2 or None."""
    store = LayerStore(store_of(case, mode))
    resident = load_offload(store.path, None, mode=mode).offload.resident_bytes
    budget = budget_for(store, mode, 2, resident)
    assert load_offload(store.path, budget, mode=mode).offload.layers_in_memory == 2
    model = load_offload(store.path, budget, mode=mode, slots=1)
    assert model.offload.layers_in_memory == 3 and model.offload.accounted_bytes <= budget
    assert torch.equal(model.generate(case["prompt"], max_new_tokens=8, do_sample=False), case["reference"])
    assert model.offload.stats()["bytes_read_per_token"] == sum(store.stored_bytes(i) for i in range(3, N_LAYERS))
    model.offload.close()
    with pytest.raises(ValueError, match="slots must be 1, 2 or None, got 3"):
        load_offload(store.path, None, mode=mode, slots=3)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")
@pytest.mark.parametrize("mode", ["dense", "endor+more-resident"])
def test_in_memory_layers_do_not_map_the_store(case, mode):
    """In-memory layers own their memory: a view of a mapping of the store's file could be evicted by a memory
    cgroup and read again from storage on every use."""
    store = LayerStore(store_of(case, mode))
    model = load_offload(store.path, None, mode=mode)
    mapped = mapped_ranges(store.layers_path)
    tensors = [
        t
        for layer in model.offload.memory
        for w in layer.values()
        for t in ((w.values, w.bitmap, w.row_offsets) if isinstance(w, endor.EndorTensor) else (w,))
    ]
    assert model.offload.layers_in_memory == store.n_layers and tensors
    assert not [t for t in tensors if any(b <= t.data_ptr() < e for b, e in mapped)]
    assert not mapped_ranges(store.resident_path)  # the resident tensors are copies, the file unmapped
    model.offload.close()


# ---- three tiers (the GPU's placement): resident, staged in host memory, SSD ---------------------------------------


@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("mode", ["dense", "endor", "endor+more-resident"])
def test_staged_tier_on_the_cpu_runs_the_three_tier_path(case, mode, slots):
    """layers_on_device < layers_in_memory on the CPU: the staged layers are copied from host memory into a slot
    for every use, as a GPU's CPU tier is (the same fetch, views and slot rotation, with copies instead of
    transfers). Same greedy tokens; the staged layers' stored bytes are moved, the SSD layers' read, every token."""
    store = LayerStore(store_of(case, mode))
    model = load_offload(store.path, None, mode=mode, layers_on_device=1, layers_in_memory=4, slots=slots)
    runtime = model.offload
    assert [runtime.placement.tier(i) for i in range(N_LAYERS)] == ["resident"] + ["staged"] * 3 + ["ssd"] * 2
    assert len(runtime.memory) == 1 and [t.numel() for t in runtime.host_layers] == [
        store.stored_bytes(i) for i in range(1, 4)
    ]
    assert torch.equal(model.generate(case["prompt"], max_new_tokens=8, do_sample=False), case["reference"])
    stats = model.offload.stats()
    assert stats["forwards"] == 8 and stats["read_path"] == "host" and stats["layers_on_device"] == 1
    assert stats["bytes_moved_per_token"] == sum(store.stored_bytes(i) for i in range(1, 4))
    assert stats["bytes_read_per_token"] == sum(store.stored_bytes(i) for i in range(4, N_LAYERS))
    runtime.close()
    # The budget charges the staged layers as stored (compressed in the Endor modes) and sizes the slots by them.
    resident = runtime.resident_bytes
    budget = runtime.accounted_bytes
    assert budget == resident + runtime.placement.device_bytes + runtime.placement.host_bytes
    assert runtime.placement.slot_bytes == slots * max(store.stored_bytes(i) for i in range(1, N_LAYERS))
    fitted = load_offload(store.path, budget, mode=mode, layers_on_device=1, slots=slots)
    assert (fitted.offload.layers_on_device, fitted.offload.layers_in_memory) == (1, 4)
    fitted.offload.close()
    with pytest.raises(ValueError, match=re.escape(f"5 layers in memory in {mode} mode (4 of them staged) need")):
        load_offload(store.path, budget, mode=mode, layers_on_device=1, layers_in_memory=5, slots=slots)


def test_pinned_buffer_registers_exactly_its_bytes(monkeypatch):
    """transfer.pinned_buffer (the GPU's staged tier and staging buffer) without a GPU, through a stand-in for
    torch.cuda.cudart(): it registers the aligned buffer's own bytes, not a power of two, unregisters them when the
    tensor is freed, and says so when registration fails."""
    calls = []

    class Cudart:
        status = 0

        def cudaHostRegister(self, address, nbytes, flags):
            calls.append(("register", address, nbytes))
            return self.status

        def cudaHostUnregister(self, address):
            calls.append(("unregister", address))
            return 0

    cudart = Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    buffer = pinned_buffer(3 * 4096 + 5)
    address = buffer.data_ptr()
    assert buffer.numel() == 3 * 4096 + 5 and address % 4096 == 0
    assert calls == [("register", address, 3 * 4096 + 5)]
    del buffer
    assert calls[-1] == ("unregister", address)
    assert pinned_buffer(0).numel() == 0 and len(calls) == 2  # nothing to pin
    cudart.status = 2
    with pytest.raises(RuntimeError, match=r"pinning 4096 bytes .* cudaError 2"):
        pinned_buffer(4096)


def test_gpu_placement_fills_device_then_host_memory(case):
    """plan_placement with separate pools (a CUDA device): the device budget sets the resident layers (the most
    whose bytes, two slots for the rest and the decompression buffer fit), the host budget the staged ones after
    them (as stored, pinned page by page, plus what reads of the largest SSD layer pass through: a bounce buffer of
    its size when kvikio is absent, which torch's caching host allocator pins to a power of two). Checked against a
    brute-force search over every pair of budgets one layer's placement needs; each pool's shortfall is named."""
    assert [pinned_bytes(b) for b in (0, 1, 3, 4096, 4097)] == [0, 1, 4, 4096, 8192]
    store = LayerStore(case["endor"])
    n = store.n_layers
    assert any(pinned_bytes(store.stored_bytes(i)) != store.stored_bytes(i) for i in range(n))  # rounding matters
    for mode in ("endor", "endor+more-resident"):
        keep = mode == "endor+more-resident"

        def device_need(g):
            return sum(store.stored_bytes(i) if keep else store.dense_bytes(i) for i in range(g)) + _staging(
                store, mode, g
            )

        def host_need(g, k, bounce):
            largest_on_ssd = max((store.stored_bytes(i) for i in range(k, n)), default=0)
            return sum(store.stored_bytes(i) for i in range(g, k)) + (
                pinned_bytes(largest_on_ssd) if bounce and largest_on_ssd else 0
            )

        for bounce in (None, partial(host_bounce_bytes, "pinned", threads=32)):
            device_budgets = sorted({device_need(g) for g in range(n + 1)})
            host_budgets = sorted({host_need(g, k, bounce) for g in range(n + 1) for k in range(g, n + 1)})
            for device_budget in device_budgets:
                g = max(g for g in range(n + 1) if device_need(g) <= device_budget)
                for host_budget in host_budgets:
                    fits = [k for k in range(g, n + 1) if host_need(g, k, bounce) <= host_budget]
                    if not fits:
                        with pytest.raises(ValueError) as info:
                            plan_placement(
                                store,
                                mode,
                                host_budget,
                                device_layer_budget=device_budget,
                                separate=True,
                                bounce=bounce,
                            )
                        assert info.value.pool == "host"
                        continue
                    p = plan_placement(
                        store, mode, host_budget, device_layer_budget=device_budget, separate=True, bounce=bounce
                    )
                    assert (p.on_device, p.in_memory) == (g, max(fits))
                    assert (p.device_bytes, p.host_bytes) == (device_need(g), host_need(g, max(fits), bounce))
    with pytest.raises(ValueError) as info:
        plan_placement(store, "endor", 0, device_layer_budget=_staging(store, "endor", 0) - 1, separate=True)
    assert info.value.pool == "device"
    with pytest.raises(ValueError, match="bytes of device memory and .* of host memory .* the budgets leave"):
        plan_placement(
            store, "endor", 0, device_layer_budget=None, separate=True, layers_on_device=1, layers_in_memory=2
        )


def test_device_arguments_are_checked(case):
    with pytest.raises(ValueError, match="device_budget is the GPU memory"):
        load_offload(case["endor"], None, mode="endor", device_budget="50%")
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        load_offload(case["endor"], None, mode="endor", device="meta")
    with pytest.raises(ValueError, match="device_budget must be bytes"):  # its errors name it
        parse_budget("lots", 1, "device_budget")
    with pytest.raises(ValueError, match="exceeds layers_in_memory"):
        load_offload(case["endor"], None, mode="endor", layers_on_device=3, layers_in_memory=2)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_offload(case["endor"], None, mode="endor", device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("mode", ["dense", "endor", "endor+more-resident"])
def test_gpu_offload_three_tiers_greedy_tokens(case, mode, slots):
    """On a GPU: 2 layers in GPU memory, 2 staged in pinned host memory, 2 read from SSD into GPU memory (kvikio, or
    a pinned buffer), Endor ones decompressed on the GPU; the greedy tokens of transformers on the CPU. With one
    slot, each fetch waits for the event after the compute of the layer before it."""
    store = LayerStore(store_of(case, mode))
    model = load_offload(
        store.path, None, mode=mode, device="cuda", layers_on_device=2, layers_in_memory=4, slots=slots
    )
    out = model.generate(case["prompt"].cuda(), max_new_tokens=8, do_sample=False)
    assert torch.equal(out.cpu(), case["reference"])
    stats = model.offload.stats()
    path = "kvikio" if kvikio_available() else "pinned"
    assert stats["read_path"] == path and stats["device"].startswith("cuda")
    assert [model.offload.placement.tier(i) for i in range(N_LAYERS)] == ["resident"] * 2 + ["staged"] * 2 + ["ssd"] * 2
    ssd_bytes = sum(store.stored_bytes(i) for i in range(4, N_LAYERS))
    assert stats["bytes_read_per_token"] == ssd_bytes  # every SSD layer, every token, once
    # Staged layers cross to the GPU as stored; SSD layers too on the pinned path (kvikio writes GPU memory itself).
    moved = sum(store.stored_bytes(i) for i in (2, 3)) + (ssd_bytes if path == "pinned" else 0)
    assert stats["bytes_moved_per_token"] == moved
    assert all(page_locked(t) for t in model.offload.host_layers)
    model.offload.close()
