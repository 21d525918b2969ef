"""torch <-> mlx conversions, bit-exact, and the fixture that runs each MLX op test on each path: the mlx-op
fallback everywhere and, on Apple Silicon, the Metal kernel."""

import numpy as np
import pytest
import torch

from flashllm_ext.ops.bits import BITS_VIEW

mx = pytest.importorskip("mlx.core", reason="mlx is not importable (install the [mlx] extra)")
fmlx = pytest.importorskip("flashllm_ext.mlx")

_MX_DTYPE = {
    torch.float32: mx.float32,
    torch.float16: mx.float16,
    torch.bfloat16: mx.bfloat16,
    torch.int8: mx.int8,
    torch.uint8: mx.uint8,
    torch.int16: mx.int16,
    torch.int32: mx.int32,
    torch.int64: mx.int64,
    torch.float64: mx.float64,
}
_MX_BITS = {mx.float32: mx.uint32, mx.float16: mx.uint16, mx.bfloat16: mx.uint16, mx.int8: mx.uint8}


def to_mx(t: torch.Tensor) -> "mx.array":
    """Bit-exact torch -> mlx (through an integer view: numpy has no bfloat16)."""
    t = t.contiguous()
    if t.dtype in BITS_VIEW:
        return mx.array(t.view(BITS_VIEW[t.dtype]).numpy()).view(_MX_DTYPE[t.dtype])
    return mx.array(t.numpy(), dtype=_MX_DTYPE[t.dtype])


def to_torch(a: "mx.array", dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.array(a.view(_MX_BITS[a.dtype]))).view(BITS_VIEW[dtype]).view(dtype)


@pytest.fixture(autouse=True, params=["mlx_ops", "metal"])
def path(request, monkeypatch):
    """Each test runs the mlx-op fallback (forced where Metal exists) and, on Apple Silicon, the Metal kernel."""
    if request.param == "mlx_ops":
        monkeypatch.setattr(fmlx.metal, "metal_available", lambda: False)
    elif not fmlx.metal_available():
        pytest.skip("no Metal device (Apple Silicon only)")
    return request.param
