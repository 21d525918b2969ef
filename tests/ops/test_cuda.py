"""The shipped CUDA kernels (flashllm_ext._C built with CUDA) on a real GPU, against the pure-torch references:
endor_decompress bitwise, endor_linear exactly (on values whose float32 sums are exact), sparse_ffn within the
float32-accumulation tolerance, quantized_sparse_ffn and quantized_linear within it, cache_compact exactly, and the same bad inputs every other backend refuses (with the
glue's debug data checks on; without them metadata is still checked and bad data never reads out of bounds). The same problems as the SIMT tests (test_simt.py,
test_ffn_simt.py), plus shapes too large to emulate.

Runs only where torch sees a CUDA device and the native library was built with CUDA kernels; elsewhere the
module is skipped with that reason (the kernel logic still runs here through the SIMT emulation).
"""

import pytest
import torch

import flashllm_ext
from flashllm_ext import endor
from flashllm_ext.ops import (
    cache_compact_reference,
    endor_decompress_reference,
    endor_linear_reference,
    quantized_linear_reference,
    quantized_sparse_ffn_reference,
    sparse_ffn_reference,
)
from flashllm_ext.ops.blocks import BundleFormat
from tests.helpers.ffn_cases import (
    FFN_DTYPES,
    assert_close,
    bad_ffn_cases,
    bad_quantized_ffn_cases,
    bad_quantized_linear_cases,
    compact_state,
    ffn_case,
    quantized_case,
    quantized_linear_case,
    random_compact_case,
)
from tests.helpers.kernel_cases import (
    BAD_CASES,
    BAD_LINEAR_CASES,
    DTYPES,
    LINEAR_DTYPES,
    SHAPES,
    assert_bitwise_equal,
    endor_case,
    linear_case,
)
from tests.helpers.memory import page_locked

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
if not (
    flashllm_ext.native_available and torch._C._dispatch_has_kernel_for_dispatch_key("flashllm::sparse_ffn", "CUDA")
):
    pytest.fail(
        "a CUDA device is present but flashllm_ext._C has no CUDA kernels: build with FLASHLLM_CUDA=1", pytrace=False
    )

OPS = torch.ops.flashllm
CUDA = torch.device("cuda")


@pytest.fixture
def kernel_checks():
    """The CUDA glue checks data (offsets, ids) on the host only in debug mode (common/kernel_checks.h)."""
    previous = flashllm_ext._C.kernel_checks()
    flashllm_ext._C.set_kernel_checks(True)
    yield
    flashllm_ext._C.set_kernel_checks(previous)


def to_cuda(args):
    return tuple(a.to(CUDA) if isinstance(a, torch.Tensor) else a for a in args)


# ---- endor_decompress ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + ((257, 4099), (4096, 1024)))
def test_endor_matches_reference_bitwise(dtype, shape):
    w, e = endor_case(shape, dtype, seed=shape[0] + shape[1])
    values, bitmap, offsets = to_cuda((e.values, e.bitmap, e.row_offsets))
    assert_bitwise_equal(OPS.endor_decompress(values, bitmap, offsets, shape[1], None).cpu(), w)
    rows = torch.randint(0, shape[0], (2 * shape[0] + 1,), generator=torch.Generator().manual_seed(1))
    got = OPS.endor_decompress(values, bitmap, offsets, shape[1], rows.to(CUDA)).cpu()
    assert_bitwise_equal(got, endor_decompress_reference(e.values, e.bitmap, e.row_offsets, shape[1], rows))


@pytest.mark.parametrize("density", [0.0, 1.0])
def test_endor_empty_and_full_rows(density):
    w, e = endor_case((33, 517), torch.float16, density=density)
    got = OPS.endor_decompress(*to_cuda((e.values, e.bitmap, e.row_offsets)), 517, None)
    assert_bitwise_equal(got.cpu(), w)


def test_endor_out_variant_writes_in_place():
    w, e = endor_case((64, 300), torch.bfloat16)
    out = torch.full((64, 300), 7.0, dtype=torch.bfloat16, device=CUDA)
    OPS.endor_decompress.out(*to_cuda((e.values, e.bitmap, e.row_offsets)), 300, None, out=out)
    assert_bitwise_equal(out.cpu(), w)


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda c: c[0][:30])
def test_endor_refuses_bad_input(kernel_checks, case):
    expected, args = case
    with pytest.raises(RuntimeError, match=expected):
        OPS.endor_decompress(*to_cuda(args))


def test_endor_module_api_on_cuda():
    w, _ = endor_case((40, 96), torch.float16)
    e = endor.compress(w.to(CUDA))
    assert e.values.is_cuda
    assert_bitwise_equal(e.decompress().cpu(), w)


# ---- endor_linear -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LINEAR_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (19, 64), (3, 300), (2, 2100), (257, 4099), (1024, 11008)])
def test_endor_linear_matches_reference_exactly(dtype, shape):
    # linear_case's values make every float32 sum exact, so any summation order matches the reference.
    for n_tok in (1, 4, 8, 11):
        x, _, e, b = linear_case(n_tok, shape, dtype, seed=n_tok + shape[1])
        for bias in (b, None):
            want = endor_linear_reference(x, e.values, e.bitmap, e.row_offsets, shape[1], bias)
            got = OPS.endor_linear(*to_cuda((x, e.values, e.bitmap, e.row_offsets, shape[1], bias)))
            assert got.is_cuda and torch.equal(got.cpu(), want)


def test_endor_linear_float32_x_and_non_contiguous():
    x, _, e, b = linear_case(4, (33, 517), torch.float16, x_dtype=torch.float32)
    xt = x.t().contiguous().t().to(CUDA)
    got = OPS.endor_linear(xt, *to_cuda((e.values, e.bitmap, e.row_offsets, 517, b)))
    assert torch.equal(got.cpu(), endor_linear_reference(x, e.values, e.bitmap, e.row_offsets, 517, b))


@pytest.mark.parametrize("case", BAD_LINEAR_CASES, ids=lambda c: c[0][:40])
def test_endor_linear_refuses_bad_input(kernel_checks, case):
    expected, args = case
    with pytest.raises(RuntimeError, match=expected):
        OPS.endor_linear(*to_cuda(args))


# ---- sparse_ffn ---------------------------------------------------------------------------------------------

INDEX = torch.tensor([30, 2, 2, 0, 17, 29, 8])


@pytest.mark.parametrize("dtype", FFN_DTYPES)
@pytest.mark.parametrize(
    "glu,act", [(False, "relu"), (True, "silu"), (False, "gelu"), (True, "gelu"), (True, "gelu_tanh")]
)
@pytest.mark.parametrize(
    "shape",
    [(1, 40, 40, 31), (3, 37, 40, 31), (9, 16, 33, 33), (8, 576, 200, 150), (1, 4096, 700, 650), (4, 1100, 64, 64)],
)
def test_sparse_ffn_matches_reference(dtype, glu, act, shape):
    n_tok, d, capacity, num_used = shape
    x, m, b = ffn_case(n_tok, d, capacity, glu, dtype, seed=d + n_tok)
    cases = [
        ({}, b),
        ({"index": INDEX, "threshold": 0.1}, b),
        ({"index": INDEX[:0]}, None),
        ({}, None),
        ({"threshold": 0.05}, b),
    ]
    for kwargs, bias in cases:
        want = sparse_ffn_reference(x, m, num_used, bias, act, glu, **kwargs)
        cuda_kwargs = {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        got = OPS.sparse_ffn(*to_cuda((x, m, num_used, bias, act, glu)), **cuda_kwargs)
        assert got.is_cuda
        assert_close(got.cpu(), want)


def test_sparse_ffn_zero_rows_and_non_contiguous_x():
    x, m, b = ffn_case(4, 24, 30, False, torch.float32)
    assert torch.equal(OPS.sparse_ffn(*to_cuda((x, m, 0, b, "relu", False))).cpu(), torch.zeros_like(x))
    xt = torch.randn(24, 4).t()
    assert_close(
        OPS.sparse_ffn(*to_cuda((xt, m, 30, b, "relu", False))).cpu(), sparse_ffn_reference(xt, m, 30, b, "relu", False)
    )


@pytest.mark.parametrize("case", bad_ffn_cases(), ids=lambda c: c[0][:30])
def test_sparse_ffn_refuses_bad_input(kernel_checks, case):
    match, args, kwargs = case
    kwargs = {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with pytest.raises(RuntimeError, match=match):
        OPS.sparse_ffn(*to_cuda(args), **kwargs)


# ---- quantized_sparse_ffn -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout", [BundleFormat("q4_0", "q8_0"), BundleFormat("q4_1", "q4_1"), BundleFormat("q8_0", "q8_0")]
)
@pytest.mark.parametrize("shape", [(1, 40, 40, 31), (9, 64, 33, 33), (4, 4096, 1024, 1000)])
def test_quantized_sparse_ffn_matches_reference(layout, shape):
    n_tok, d, capacity, num_used = shape
    for dtype in FFN_DTYPES:
        x, m, b = quantized_case(n_tok, d, capacity, True, layout, dtype, seed=d + n_tok)
        index = torch.randperm(num_used, generator=torch.Generator().manual_seed(n_tok))[: num_used // 2]
        for kwargs in ({}, {"index": index, "threshold": 0.05}):
            want = quantized_sparse_ffn_reference(x, m, num_used, b, "silu", True, layout.name, **kwargs)
            kwargs = {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            got = OPS.quantized_sparse_ffn(
                x.to(CUDA), m.to(CUDA), num_used, b.to(CUDA), "silu", True, layout.name, **kwargs
            )
            assert_close(got.cpu(), want)


@pytest.mark.parametrize("case", bad_quantized_ffn_cases(), ids=lambda c: c[0][:30])
def test_quantized_sparse_ffn_refuses_bad_input(kernel_checks, case):
    match, args, kwargs = case
    kwargs = {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with pytest.raises(RuntimeError, match=match):
        OPS.quantized_sparse_ffn(*to_cuda(args), **kwargs)


# ---- quantized_linear ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("shape", [(1, 1), (33, 7), (200, 20), (4096, 4096), (4096, 11008)])
def test_quantized_linear_matches_reference(fmt, shape):
    d, n = shape
    for n_tok in (1, 3, 11):
        x, w, b = quantized_linear_case(n_tok, d, n, fmt, seed=n_tok + d)
        for dtype in FFN_DTYPES:
            got = OPS.quantized_linear(x.to(CUDA, dtype), w.to(CUDA), fmt, b.to(CUDA, dtype))
            assert got.device.type == "cuda"
            assert_close(got.cpu(), quantized_linear_reference(x.to(dtype), w, fmt, b.to(dtype)))


@pytest.mark.parametrize("case", bad_quantized_linear_cases(), ids=lambda c: c[0][:30])
def test_quantized_linear_refuses_bad_input(case):
    match, args = case
    with pytest.raises(RuntimeError, match=match):
        OPS.quantized_linear(*to_cuda(args))


# ---- cache_compact ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(
    "width,dtype", [(8, torch.float32), (5, torch.float16), (12, torch.int8), (3 * 576, torch.float16)]
)
def test_cache_compact_matches_reference(seed, width, dtype):
    state, num_used, rows = random_compact_case(seed, width, dtype, max_capacity=300, n_neurons=500)
    got = [t.to(CUDA) for t in state]
    want = [t.clone() for t in state]
    assert OPS.cache_compact(*got, num_used, rows.to(CUDA)) == cache_compact_reference(*want, num_used, rows)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))


def test_cache_compact_refuses_bad_rows(kernel_checks):
    state = [t.to(CUDA) for t in compact_state(10, 4, 6, 20, torch.float32, seed=0)]
    for rows, match in (
        (torch.tensor([1, 1]), "twice"),
        (torch.tensor([6]), "outside"),
        (torch.tensor([-1]), "outside"),
    ):
        with pytest.raises(RuntimeError, match=match):
            OPS.cache_compact(*state, 6, rows.to(CUDA))


# ---- the engine on the GPU: NeuronCache(device="cuda"), FlashFFN, load_flash(device="cuda") ---------------------


@pytest.fixture(scope="module")
def tiny_stores(tmp_path_factory):
    """name -> (transformers model, fp32 store, fp16 store) of tiny random Llama and OPT models."""
    from flashllm_ext.flash.convert import convert
    from flashllm_ext.flash.store import FlashStore
    from tests.helpers.models import tiny_model

    root = tmp_path_factory.mktemp("cuda-engine")
    models = {
        "llama": tiny_model("llama", num_hidden_layers=3, max_position_embeddings=256),
        "opt": tiny_model("opt", seed=None, max_position_embeddings=256, dropout=0.0),
    }
    out = {}
    for name, model in models.items():
        model.save_pretrained(root / name)
        out[name] = (
            model,
            *(
                FlashStore(convert(root / name, root / f"{name}-{dt}", dtype=dt, progress=False))
                for dt in ("fp32", "fp16")
            ),
        )
    return out


@pytest.mark.parametrize("name", ["llama", "opt"])
@pytest.mark.parametrize("capacity,window", [(160, 3), (40, 2), (12, 1)])
def test_cuda_cache_matches_the_cpu_cache_step_by_step(tiny_stores, name, capacity, window):
    from flashllm_ext.flash.cache import NeuronCache
    from tests.helpers.neuron_cache import step_both

    flash_store = tiny_stores[name][2]
    capacity = min(capacity, flash_store.n_neurons)
    g = torch.Generator().manual_seed(capacity + window)
    host = NeuronCache(flash_store, 0, capacity, window)
    dev = NeuronCache(flash_store, 0, capacity, window, device="cuda")
    assert dev.matrix.is_cuda and dev.device_pointer.is_cuda and not dev.pointer.is_cuda
    for t in range(40):
        ids = torch.randint(0, flash_store.n_neurons, (int(torch.randint(0, 40, (1,), generator=g)),), generator=g)
        step_both(host, dev, ids.tolist(), background=bool(t % 2))
    assert dev.transfer.uploads > 0


def test_staging_buffer_is_pinned_as_it_is_sized():
    # StagedTransfer.nbytes is what the engine's budget charges: the buffer pins exactly that (cudaHostRegister), not
    # the power of two a pinned tensor from torch's caching host allocator takes, and the old one is let go on growth.
    from flashllm_ext.flash.transfer import StagedTransfer

    transfer = StagedTransfer("cuda")
    for nbytes in (3 * 4096 + 1, 5 << 20):
        transfer.reserve(nbytes)
        assert transfer.nbytes == nbytes and page_locked(transfer._staging)
        rows = transfer.staging((nbytes // 64, 64), torch.uint8)
        rows.copy_(torch.randint(0, 256, rows.shape, dtype=torch.uint8))
        dst = transfer.empty(rows.shape, torch.uint8)
        transfer.upload(rows, dst)
        assert torch.equal(dst.cpu(), rows)


def test_failed_read_leaves_the_cuda_cache_consistent(tiny_stores, monkeypatch):
    from flashllm_ext.flash.cache import NeuronCache

    s = tiny_stores["opt"][2]
    dev = NeuronCache(s, 0, capacity=50, window=1, device="cuda")
    dev.step(torch.tensor([1, 2, 3]))

    def failing_read(*args, **kwargs):
        raise OSError("injected read failure")

    monkeypatch.setattr(dev.reader, "read", failing_read)
    with pytest.raises(OSError, match="injected"):
        dev.step(torch.tensor([3, 40, 41]))
    assert dev.cached_ids().tolist() == [3]
    assert torch.equal(dev.device_pointer.cpu(), dev.pointer)
    assert torch.equal(dev.matrix[:1].cpu(), s.bundle(0, torch.tensor([3])))
    monkeypatch.undo()
    dev.step(torch.tensor([3, 40, 41]))
    assert torch.equal(dev.matrix[:3].cpu(), s.bundle(0, dev.cached_ids()))
    assert torch.equal(dev.device_pointer.cpu(), dev.pointer)


@pytest.mark.parametrize("name", ["llama", "opt"])
@torch.no_grad()
def test_flash_ffn_on_cuda_matches_the_cpu_one(tiny_stores, name):
    from flashllm_ext.flash.ffn import FlashFFN

    s = tiny_stores[name][2]
    g = torch.Generator().manual_seed(3)
    masks = torch.rand(12, s.n_neurons, generator=g) < 0.3
    at = [0]

    def predictor(chunk):
        return masks[at[0] : at[0] + chunk.shape[0]].to(chunk.device)

    host = FlashFFN(s, 0, predictor=predictor, capacity=60, window=2)
    dev = FlashFFN(s, 0, predictor=predictor, capacity=60, window=2, device="cuda")
    x = torch.randn(12, s.hidden_size, generator=g).half()
    want, got = host(x[:6]), dev(x[:6].to(CUDA))
    assert got.is_cuda and got.dtype == x.dtype
    assert_close(got.cpu(), want)
    for t in range(6, 12):
        at[0] = t
        assert_close(dev(x[t : t + 1].to(CUDA)).cpu(), host(x[t : t + 1]))
    assert dev.stats.inserted == host.stats.inserted > 0


@pytest.mark.parametrize("name", ["llama", "opt"])
@pytest.mark.parametrize("mode", ["naive", "hybrid", "exact"])
@torch.no_grad()
def test_load_flash_on_cuda_generates_the_tokens_of_transformers(tiny_stores, name, mode):
    model, fp32, _ = tiny_stores[name]
    prompt = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    dense = model.to(CUDA)
    try:
        want = dense.generate(prompt.to(CUDA), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    finally:
        model.to("cpu")
    budget = "85%" if mode == "exact" else None  # streamed bundles are staged twice: see test_transfer.py
    flash = flashllm_ext.load_flash(fp32.path, dram_budget=budget, mode=mode, device="cuda")
    got = flash.generate(prompt.to(CUDA), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert torch.equal(got, want)
    stats = flash.flash.stats()
    assert stats["bytes_read"] > 0 and (budget is None or stats["accounted_bytes"] <= stats["budget_bytes"])
