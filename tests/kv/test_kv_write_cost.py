"""Emulated devices' write requests: a write is charged max(nbytes, request_bytes), reads their bytes; every spill
is charged to its shard's device (near storage and baseline), so delayed writeback saves device time; the
regen/read regime's bandwidth arithmetic and the alpha it leads to; bench_kv times the final flush."""

import argparse
import os
import time

import pytest
import torch

from bench import bench_kv
from flashllm_ext.kv import KVShard, Link, NearStorageAttention
from flashllm_ext.kv.baseline import HostKVAttention
from flashllm_ext.kv.link import probe_write_request
from flashllm_ext.kv.xcache import choose_alpha, regeneration_flops, regime_device_gbps
from tests.helpers.kv import run_decode

B, H, D, LAYERS = 2, 4, 64, 2  # MHA fp16 on 1 shard: a token is 1 KiB per file, a write one 4 KiB block


def test_write_requests_charged_at_least_request_bytes_reads_by_bytes():
    link = Link(gbps=1000, request_bytes=10_000)
    link.transfer(100, write=True)
    link.transfer(20_000, write=True)
    link.transfer(100)
    assert (link.transferred, link.charged, link.write_requests) == (20_200, 10_000 + 20_000 + 100, 2)
    with pytest.raises(ValueError):
        Link(1, request_bytes=-1)


def test_write_request_cost_takes_device_time():
    reads, writes = Link(gbps=0.08, burst_bytes=1000), Link(gbps=0.08, burst_bytes=1000, request_bytes=100_000)
    elapsed = []
    for link, write in ((reads, False), (writes, True)):  # 10 MB/s: five 100 B writes cost 5 x 10 ms
        start = time.perf_counter()
        for _ in range(5):
            link.transfer(100, write=write)
        elapsed.append(time.perf_counter() - start)
    assert elapsed[0] < 0.02 <= 0.045 <= elapsed[1] < 1.0


@pytest.mark.parametrize("kind", ["ans", "baseline"])
def test_spills_charged_to_their_device(tmp_path, kind):
    """Every write request of every shard reaches its device Link once, charged max(bytes, request_bytes); with
    c = 4 the device is charged 4x less for the same tokens."""
    request = 64 << 10
    charged = {}
    for c in (1, 4):
        dirs = [tmp_path / f"{kind}{c}-{i}" for i in range(2)]
        common = dict(
            n_layers=LAYERS,
            batch=B,
            q_heads=H,
            kv_heads=H,
            head_dim=D,
            dtype=torch.float16,
            max_tokens=64,
            writeback=c,
            storage_gbps=1000.0,
            write_request_bytes=request,
        )
        attn = (
            NearStorageAttention(dirs, processes=False, **common) if kind == "ans" else HostKVAttention(dirs, **common)
        )
        with attn:
            run_decode(
                attn, n_layers=LAYERS, batch=B, q_heads=H, kv_heads=H, dim=D, dtype=torch.float16, prompt=8, steps=8
            )
            attn.flush()
            devices = [s.engine.storage_link for s in attn.shards] if kind == "ans" else attn.storage_links
            shards = [s.engine.shard for s in attn.shards] if kind == "ans" else attn.shards
            for device, shard in zip(devices, shards):
                io = shard.counters()
                assert device is shard.device and device.request_bytes == request
                assert device.write_requests == io.n_writes > 0
                # every write here is below the request cost (4 KiB blocks): each is charged the request cost, the
                # reads their bytes
                assert device.charged - device.transferred == io.n_writes * request - io.bytes_written
            charged[c] = sum(d.write_requests for d in devices)
    prompt_writes = 2 * 2 * LAYERS  # one bulk write per shard, file and layer
    assert charged[1] - prompt_writes == 4 * (charged[4] - prompt_writes) == 2 * 2 * LAYERS * 8


def test_spill_without_device_charges_nothing(tmp_path):
    with KVShard.create(tmp_path, 1, 2, 64, torch.float16, 16, writeback=1) as shard:
        assert shard.device is None
        shard.append(0, torch.zeros(3, 2, 64, dtype=torch.float16), torch.zeros(3, 2, 64, dtype=torch.float16))
        shard.flush()
        assert shard.counters().n_writes > 0


def test_regen_read_regime_arithmetic_and_alpha():
    """hidden 512 (8 x 64 heads): regenerating a token's K/V is 2 x 512 x 1024 flops; at 1 GFLOP/s 1.048576 ms.
    With R = 0.6 reading its 2 KiB from the 4 devices together takes 1.048576 / 0.6 ms."""
    shape = dict(hidden=512, kv_heads=8, head_dim=64)
    assert regeneration_flops(**shape) == 1_048_576
    gbps = regime_device_gbps(host_flops=1e9, ratio=0.6, devices=4, **shape)
    assert gbps == pytest.approx(2048 * 8 / (1.048576e-3 / 0.6) / 1e9 / 4)
    # in that regime the compute-aware choice keeps X: the balance 1 / (1 + R) caps HILOS' 2 x 2 / (4 + 2)
    fast = choose_alpha(link_gbps=2 * gbps, storage_gbps=4 * gbps, host_flops=1e9, **shape)
    assert fast.alpha == pytest.approx(1 / 1.6) and fast.alpha > 0 and "keeps pace" in fast.reason
    # where regenerating is slower than the read (R > 1), none
    slow_gbps = regime_device_gbps(host_flops=1e9, ratio=1.5, devices=4, **shape)
    slow = choose_alpha(link_gbps=2 * slow_gbps, storage_gbps=4 * slow_gbps, host_flops=1e9, **shape)
    assert slow.alpha == 0.0 and "cannot pay" in slow.reason
    with pytest.raises(ValueError):
        regime_device_gbps(host_flops=1e9, ratio=0, devices=4, **shape)


def test_probe_write_request(tmp_path):
    probe = probe_write_request(tmp_path, writes=8, seq_bytes=4 << 20, rounds=1)
    assert probe.request_s > 0 and probe.seq_bytes_per_s > 0 and probe.write_bytes == 4096
    assert probe.request_bytes == round(probe.request_s * probe.seq_bytes_per_s)
    assert not list(tmp_path.iterdir())  # the scratch file is gone


def test_probe_write_request_never_writes_through_a_planted_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / f".flashllm-write-probe-{os.getpid()}").symlink_to(victim)
    probe_write_request(scratch, writes=8, seq_bytes=4 << 20, rounds=1)
    assert victim.read_text() == "precious"
    assert [p.name for p in scratch.iterdir()] == [f".flashllm-write-probe-{os.getpid()}"]


def test_bench_times_the_final_flush(tmp_path):
    """The baseline spills its one decode step's token in the background (c = 1): 2 write requests of 0.3 s each
    on a 1 MB/s device with a 300 KB request cost (more than the Link's 256 KiB burst, which the prompt's writes
    have used up), which only the final flush waits for."""
    args = argparse.Namespace(
        batch=1,
        heads=2,
        head_dim=16,
        layers=1,
        context=8,
        steps=1,
        prefill_chunk=8,
        link_gbps=1.0,
        device_gbps=0.008,
        writeback=None,
        write_request_bytes=300_000,
    )
    row = bench_kv.run("baseline", 1, args, tmp_path)
    assert row["writes_per_step"] == 2
    assert args.batch * args.steps / row["tokens_per_s"] >= 0.5
