"""Cooperative X-cache: the X part (K/V regenerated on the host) and the storage part together equal dense attention
for every alpha, shard count, writeback and GQA; alpha from HILOS, capped by memory, zero where X cannot pay."""

import pytest
import torch

from flashllm_ext.kv import NearStorageAttention
from flashllm_ext.kv.baseline import HostKVAttention
from flashllm_ext.kv.xcache import HOST, XCacheAttention, choose_alpha, linear_projector, regeneration_flops
from tests.helpers.kv import dense_attention


def simple_rope(k, start):
    """A position-dependent rotation (enough to show the positions of regenerated K are right)."""
    pos = torch.arange(start, start + k.shape[2], dtype=k.dtype)[None, None, :, None]
    return k * torch.cos(pos * 0.1) + k.roll(1, dims=-1) * torch.sin(pos * 0.1)


@pytest.mark.parametrize("n_x", [1, 3])
@pytest.mark.parametrize("shards, writeback", [(1, 1), (2, 3)])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("storage_kind", ["near_storage", "baseline"])
def test_xcache_equals_dense(tmp_path, n_x, shards, writeback, heads, storage_kind):
    q_heads, kv_heads = heads
    batch, hidden, dim, n_layers, prompt, steps = 4, 24, 8, 2, 6, 4
    g = torch.Generator().manual_seed(0)
    wk = [torch.randn(kv_heads * dim, hidden, generator=g) / hidden**0.5 for _ in range(n_layers)]
    wv = [torch.randn(kv_heads * dim, hidden, generator=g) / hidden**0.5 for _ in range(n_layers)]
    bk = [torch.randn(kv_heads * dim, generator=g) for _ in range(n_layers)]
    project = linear_projector(wk, wv, kv_heads=kv_heads, bk=bk, rope=simple_rope)
    cls = NearStorageAttention if storage_kind == "near_storage" else HostKVAttention
    extra = {"processes": False} if storage_kind == "near_storage" else {}
    storage = cls(
        [tmp_path / f"d{i}" for i in range(shards)],
        n_layers=n_layers,
        batch=batch - n_x,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=dim,
        dtype=torch.float32,
        max_tokens=32,
        writeback=writeback,
        **extra,
    )
    xs = [torch.randn(batch, prompt, hidden, generator=g) for _ in range(n_layers)]
    with XCacheAttention(storage, project, n_x=n_x, hidden=hidden, max_tokens=32) as attn:
        for layer in range(n_layers):
            k, v = project(layer, xs[layer], 0)
            attn.prefill(layer, k, v, xs[layer])
        for step in range(steps):
            for layer in range(n_layers):
                x_new = torch.randn(batch, 1, hidden, generator=g)
                xs[layer] = torch.cat([xs[layer], x_new], dim=1)
                k_new, v_new = project(layer, x_new, prompt + step)
                q = torch.randn(batch, q_heads, dim, generator=g)
                out, lse = attn.step(layer, q, k_new[:, :, 0], v_new[:, :, 0], x_new)
                k_all, v_all = project(layer, xs[layer], 0)
                torch.testing.assert_close(out, dense_attention(q, k_all, v_all), atol=1e-5, rtol=1e-5)
                assert lse.shape == (batch, q_heads)
        # X bytes: every step reads the X rows' whole history, per layer
        tokens = sum(prompt + s + 1 for s in range(steps))
        assert attn.traffic.total(shards=[HOST]).x_bytes == n_layers * n_x * tokens * hidden * 4
        assert attn.traffic.total(shards=[HOST]).interconnect_bytes() == 0


def test_xcache_needs_x(tmp_path):
    storage = NearStorageAttention(
        [tmp_path],
        n_layers=1,
        batch=1,
        q_heads=2,
        kv_heads=2,
        head_dim=4,
        dtype=torch.float32,
        max_tokens=8,
        processes=False,
    )
    project = linear_projector([torch.zeros(8, 8)], [torch.zeros(8, 8)], kv_heads=2)
    with XCacheAttention(storage, project, n_x=1, hidden=8, max_tokens=8) as attn:
        with pytest.raises(ValueError, match="needs the attention input"):
            attn.prefill(0, torch.zeros(2, 2, 3, 4), torch.zeros(2, 2, 3, 4))


def test_choose_alpha():
    # MHA (OPT-30B-like: X = 7168, K+V = 14336 values per token): HILOS' formula
    mha = dict(hidden=7168, kv_heads=56, head_dim=128)
    assert choose_alpha(link_gbps=16, storage_gbps=48, **mha).alpha == pytest.approx(2 * 16 / 64)
    assert choose_alpha(link_gbps=16, storage_gbps=8, **mha).alpha == 1.0
    # the memory for X caps it: 1 GiB holds 1 GiB / (7168 x 2 B x 4096 tokens x 4 layers) = 4.6 sequences of 32
    capped = choose_alpha(
        link_gbps=16, storage_gbps=48, memory_bytes=1 << 30, batch=32, context=4096, n_layers=4, **mha
    )
    assert capped.alpha == pytest.approx((1 << 30) / (32 * 4096 * 7168 * 2 * 4)) and "capped" in capped.reason
    # the default model (GQA): X is 576 values per token, K+V 2 x 3 x 64 = 384: X-cache cannot pay
    gqa = choose_alpha(link_gbps=16, storage_gbps=48, hidden=576, kv_heads=3, head_dim=64)
    assert gqa.alpha == 0.0 and "cannot pay" in gqa.reason


def test_choose_alpha_refuses_when_regeneration_is_slower_than_the_read():
    """Per token, regenerating K/V costs 2 x hidden x (K+V) flops; reading them (K+V) x 2 bytes from the devices.
    MHA 56 x 128 (hidden 7168): 411 MFLOP against 28 KiB."""
    mha = dict(hidden=7168, kv_heads=56, head_dim=128)
    assert regeneration_flops(**mha) == 2 * 7168 * 14336
    t_read = 14336 * 2 * 8 / 48e9  # 48 Gb/s of devices
    # a GPU-class host: regeneration is 10x faster than the read, HILOS' alpha (0.5) stands
    fast = choose_alpha(link_gbps=16, storage_gbps=48, host_flops=regeneration_flops(**mha) / (t_read / 10), **mha)
    assert fast.alpha == pytest.approx(0.5) and "capped" not in fast.reason
    # 2x faster: the balance t_read / (t_read + t_regen) = 2/3 is above HILOS' 0.5, which stands; at 1.5x faster
    # the balance (0.6) is below HILOS' 0.75 (link 24 Gb/s) and caps it
    assert choose_alpha(
        link_gbps=16, storage_gbps=48, host_flops=regeneration_flops(**mha) / (t_read / 2), **mha
    ).alpha == pytest.approx(0.5)
    t_read_40 = 14336 * 2 * 8 / 40e9
    capped = choose_alpha(
        link_gbps=24, storage_gbps=40, host_flops=regeneration_flops(**mha) / (t_read_40 / 1.5), **mha
    )
    assert capped.alpha == pytest.approx(0.6) and "keeps pace" in capped.reason
    # a CPU host at 40 GFLOP/s: 10 ms per token against 4.8 us of reads: refused, and the reason says why
    slow = choose_alpha(link_gbps=16, storage_gbps=48, host_flops=40e9, **mha)
    assert slow.alpha == 0.0 and "compute exceeds the transfer saved" in slow.reason
