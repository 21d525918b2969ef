"""Attention near storage equals dense attention (SDPA over the full K/V), for shards x writeback x GQA x prompt
lengths that do and do not fill a read block; worker processes; a dead or failing worker gives a clear error."""

import errno
import os
import signal
import time

import pytest
import torch

from flashllm_ext.kv import HostKVAttention, KVShard, NearStorageAttention, ShardAttention, ShardInUseError, WorkerError
from flashllm_ext.kv.attention import masked_decode_attention
from tests.helpers.kv import dense_attention, random_kv, run_decode


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("writeback", [1, 4, None])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("prompt", [1, 16, 37])  # block_tokens 16: a prompt that fills a block and ones that don't
def test_near_storage_equals_dense(tmp_path, shards, writeback, heads, prompt):
    q_heads, kv_heads = heads
    batch, dim, n_layers, steps = 3, 8, 2, 5
    dirs = [tmp_path / f"dev{i}" for i in range(shards)]
    with NearStorageAttention(
        dirs,
        n_layers=n_layers,
        batch=batch,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=dim,
        dtype=torch.float32,
        max_tokens=64,
        writeback=writeback,
        processes=False,
        block_tokens=16,
    ) as attn:
        k0, v0 = run_decode(
            attn,
            n_layers=n_layers,
            batch=batch,
            q_heads=q_heads,
            kv_heads=kv_heads,
            dim=dim,
            dtype=torch.float32,
            prompt=prompt,
            steps=steps,
        )
    # close() spilled everything: each shard's files hold its pairs' tokens, [token][pair][head_dim]
    flat_k = k0.reshape(batch * kv_heads, -1, dim)
    for (p0, p1), d in zip(attn.ranges, dirs):
        shard = KVShard.open(d)
        assert shard.view(0).length == prompt + steps and shard.buffered(0) == 0
        assert torch.equal(shard.tokens(0)[0], flat_k[p0:p1].transpose(0, 1))
        shard.close()


@pytest.mark.parametrize("kind", ["near_storage", "baseline"])
@pytest.mark.parametrize("writeback", [1, 5])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
def test_left_padding_is_never_attended(tmp_path, kind, writeback, heads):
    """Padding of 0, 3, 9 (a whole block and more) and 11 tokens in front of a 12-token prompt: each sequence
    attends only its own tokens, over disk blocks (block_tokens 4), the block the padding ends in, and the buffer."""
    q_heads, kv_heads = heads
    cls, extra = (
        (NearStorageAttention, {"processes": False, "block_tokens": 4})
        if kind == "near_storage"
        else (HostKVAttention, {})
    )
    with cls(
        [tmp_path / "a", tmp_path / "b"],
        n_layers=2,
        batch=4,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=8,
        dtype=torch.float32,
        max_tokens=32,
        writeback=writeback,
        **extra,
    ) as attn:
        run_decode(
            attn,
            n_layers=2,
            batch=4,
            q_heads=q_heads,
            kv_heads=kv_heads,
            dim=8,
            dtype=torch.float32,
            prompt=12,
            steps=4,
            starts=[0, 3, 9, 11],
        )
        attn.reset()  # forgets the padding too
        run_decode(
            attn,
            n_layers=2,
            batch=4,
            q_heads=q_heads,
            kv_heads=kv_heads,
            dim=8,
            dtype=torch.float32,
            prompt=5,
            steps=2,
            seed=1,
        )


def test_masked_part_with_no_visible_token():
    """A range wholly inside a sequence's padding gives that row out 0, lse -inf (dropped by the merge)."""
    q, k, v = torch.randn(3, 2, 8), torch.randn(5, 3, 1, 8), torch.randn(5, 3, 1, 8)
    out, lse = masked_decode_attention(q, k, v, scale=None, starts=torch.tensor([0, 7, 12]), t0=5)
    full, full_lse = masked_decode_attention(q[:1], k[:, :1], v[:, :1], scale=None)
    torch.testing.assert_close(out[0], full[0])
    torch.testing.assert_close(lse[0], full_lse[0])
    part, _ = masked_decode_attention(q[1:2], k[2:, 1:2], v[2:, 1:2], scale=None)
    torch.testing.assert_close(out[1], part[0])
    assert torch.equal(out[2], torch.zeros(2, 8)) and bool((lse[2] == float("-inf")).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_storage_and_scale(tmp_path, dtype):
    with NearStorageAttention(
        [tmp_path / "a", tmp_path / "b"],
        n_layers=1,
        batch=3,
        q_heads=4,
        kv_heads=2,
        head_dim=16,
        dtype=dtype,
        max_tokens=100,
        processes=False,
        scale=0.3,
        block_tokens=8,
    ) as attn:
        run_decode(attn, n_layers=1, batch=3, q_heads=4, kv_heads=2, dim=16, dtype=dtype, prompt=20, steps=4, scale=0.3)


@pytest.mark.parametrize("prefetch", [True, False])
def test_shard_attention_blocks_merge_exactly(tmp_path, prefetch):
    """Many blocks (block_tokens 3) + a buffer, merged: equal to one dense pass at float32 precision."""
    shard = KVShard.create(tmp_path, 1, 4, 8, torch.float32, 64, writeback=5)
    attn = ShardAttention(shard, group=2, block_tokens=3, prefetch=prefetch)
    k = torch.randn(23, 4, 8)
    v = torch.randn(23, 4, 8)
    attn.append(0, k[:20], v[:20])
    for t in range(20, 23):
        view = shard.append(0, k[t : t + 1], v[t : t + 1])
    assert view.disk_len == 20 and view.k_buf.shape[0] == 3
    q = torch.randn(4, 2, 8)
    out, lse = attn.attend(view, q)
    ref = dense_attention(q, k.transpose(0, 1)[:, None], v.transpose(0, 1)[:, None])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    scores = torch.einsum("pgd,tpd->pgt", q, k) / 8**0.5
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="q must be"):
        attn.attend(view, torch.randn(4, 3, 8))
    attn.close()
    shard.close()


def test_worker_processes_equal_dense(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    with NearStorageAttention(
        dirs,
        n_layers=2,
        batch=2,
        q_heads=4,
        kv_heads=2,
        head_dim=8,
        dtype=torch.float16,
        max_tokens=64,
        writeback=3,
        processes=True,
        block_tokens=4,
        timeout_s=300,
    ) as attn:
        run_decode(attn, n_layers=2, batch=2, q_heads=4, kv_heads=2, dim=8, dtype=torch.float16, prompt=9, steps=4)
    for d in dirs:  # close() left nothing unspilled: every token is on disk
        shard = KVShard.open(d)
        assert [shard.view(layer).disk_len for layer in range(2)] == [13, 13]
        shard.close()


def test_dead_worker_gives_clear_error(tmp_path):
    attn = NearStorageAttention(
        [tmp_path / "a", tmp_path / "b"],
        n_layers=1,
        batch=2,
        q_heads=2,
        kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        max_tokens=16,
        processes=True,
        timeout_s=300,
    )
    try:
        attn.prefill(0, *random_kv(2, 2, 3, 8, torch.float32, 0))
        os.kill(attn.shards[1].pid, signal.SIGKILL)
        with pytest.raises(WorkerError, match=r"shard1 .*exited with code -9"):
            attn.step(0, torch.randn(2, 2, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8))
        with pytest.raises(WorkerError, match="shard1"):  # and stays failed, at once
            attn.step(0, torch.randn(2, 2, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8))
    finally:
        attn.terminate()


def test_worker_exception_is_reported(tmp_path):
    with NearStorageAttention(
        [tmp_path / "a"],
        n_layers=1,
        batch=1,
        q_heads=2,
        kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        max_tokens=4,
        processes=True,
        timeout_s=300,
    ) as attn:
        attn.prefill(0, *random_kv(1, 2, 4, 8, torch.float32, 0))
        with pytest.raises(WorkerError, match="exceed max_tokens"):  # the worker's ValueError, with its traceback
            attn.step(0, torch.randn(1, 2, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8))


class FailWhileExists:
    """A worker-side fault injector (picklable: it crosses into the worker process): every write fails with ENOSPC
    while `marker` exists, so the test switches the fault on and off from outside."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __call__(self, path, offset, nbytes):
        if os.path.exists(self.marker):
            raise OSError(errno.ENOSPC, "injected")


def test_worker_io_error_mid_step(tmp_path):
    """Shard 1's K file loses its data under the worker: the step's read fails there, the parent gets a WorkerError
    naming the shard, the file and the errno at once, further steps are refused, and reset()/close() still work."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    shape = dict(n_layers=1, batch=2, q_heads=2, kv_heads=2, dim=8, dtype=torch.float32)
    with NearStorageAttention(
        dirs,
        n_layers=1,
        batch=2,
        q_heads=2,
        kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        max_tokens=32,
        writeback=2,
        processes=True,
        timeout_s=300,
    ) as attn:
        attn.prefill(0, *random_kv(2, 2, 6, 8, torch.float32, 0))
        attn.flush()
        os.truncate(dirs[1] / "layer0.k", 0)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"(?s)shard1 .*step of layer 0.*end of file.*layer0\.k.*errno 5"):
            attn.step(0, torch.randn(2, 2, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8))
        assert time.monotonic() - start < 30
        with pytest.raises(WorkerError, match="an earlier step failed .layer 0, step 0: KV worker shard1"):
            attn.step(0, torch.randn(2, 2, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8))
        attn.reset()  # both workers are up: a new batch decodes correctly
        run_decode(attn, prompt=5, steps=3, **shape)


def test_worker_spill_fault_keeps_tokens_and_recovers(tmp_path):
    """Writes fail (ENOSPC) inside the workers: the failed spill surfaces in the parent as a WorkerError carrying
    the worker's SpillError, close() refuses to drop the buffers while it lasts, and once the device has room
    again close() spills them: every token of the completed steps is on disk."""
    marker = tmp_path / "full"
    dirs = [tmp_path / "a", tmp_path / "b"]
    attn = NearStorageAttention(
        dirs,
        n_layers=1,
        batch=2,
        q_heads=2,
        kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        max_tokens=32,
        writeback=2,
        processes=True,
        timeout_s=300,
        fault_injector=FailWhileExists(marker),
    )
    try:
        k, v = random_kv(2, 2, 4, 8, torch.float32, 0)
        attn.prefill(0, k, v)
        attn.flush()
        marker.touch()
        g = torch.Generator().manual_seed(1)
        done = 0
        with pytest.raises(WorkerError, match=r"(?s)failed in step of layer 0.*SpillError.*buffered tokens are kept"):
            for _ in range(4):  # step 2's spill (c = 2) fails in the background, step 3's append reports it
                attn.step(
                    0,
                    torch.randn(2, 2, 8, generator=g),
                    torch.randn(2, 2, 8, generator=g),
                    torch.randn(2, 2, 8, generator=g),
                )
                done += 1
        assert done == 2
        with pytest.raises(WorkerError, match="SpillError"):
            attn.close()  # nothing dropped: the workers stay up with their buffers
        marker.unlink()
        attn.close()
    except BaseException:
        attn.terminate()
        raise
    for d in dirs:  # the prompt and the two completed steps, all on disk
        shard = KVShard.open(d)
        assert shard.view(0).disk_len == 6 and shard.buffered(0) == 0
        shard.close()


def test_hung_worker_times_out(tmp_path):
    """A worker that stops answering (SIGSTOP: stuck I/O, a deadlock) gives a WorkerError after timeout_s, not a
    hang; terminate() then stops everything."""
    attn = NearStorageAttention(
        [tmp_path / "a", tmp_path / "b"],
        n_layers=1,
        batch=2,
        q_heads=2,
        kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        max_tokens=16,
        processes=True,
        timeout_s=300,
    )
    try:
        attn.prefill(0, *random_kv(2, 2, 3, 8, torch.float32, 0))
        for shard in attn.shards:
            shard.timeout_s = 2.0
        os.kill(attn.shards[0].pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"shard0 .*did not answer within 2 s \(killed\) during step"):
            attn.step(0, torch.randn(2, 2, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8))
        assert time.monotonic() - start < 20
    finally:
        attn.terminate()
    assert all(not shard._proc.is_alive() for shard in attn.shards) or not attn.shards


def test_close_with_a_dead_worker_spills_every_live_shard(tmp_path):
    """One worker died: close() still spills and closes every other shard (their buffered tokens reach the disk),
    then raises naming the dead one."""
    dirs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    attn = NearStorageAttention(
        dirs,
        n_layers=1,
        batch=3,
        q_heads=2,
        kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        max_tokens=16,
        writeback=8,
        processes=True,
        timeout_s=300,
    )
    try:
        attn.prefill(0, *random_kv(3, 2, 3, 8, torch.float32, 0))  # 3 tokens, all in the buffers (writeback 8)
        os.kill(attn.shards[0].pid, signal.SIGKILL)
        attn.shards[0]._proc.join()
        with pytest.raises(WorkerError, match=r"shard0 .*exited with code -9") as info:
            attn.close()
        assert "shard1" not in str(info.value) and "shard2" not in str(info.value)
        assert attn.shards == []
    except BaseException:
        attn.terminate()
        raise
    for d in dirs[1:]:
        shard = KVShard.open(d)
        assert shard.view(0).disk_len == 3
        shard.close()


@pytest.mark.parametrize("second", ["near storage", "host"])
def test_two_backends_on_one_folder_are_refused(tmp_path, second):
    """Two shards on one folder would read and overwrite each other's K/V: the second owner is refused, within one
    backend or across two, and the folder is free again once the first is closed."""
    shape = dict(n_layers=1, batch=2, q_heads=2, kv_heads=2, head_dim=8, dtype=torch.float32, max_tokens=16)
    with pytest.raises(ShardInUseError, match="in use"):
        NearStorageAttention([tmp_path / "a", tmp_path / "a"], processes=False, **shape)
    first = NearStorageAttention([tmp_path / "a", tmp_path / "b"], processes=False, **shape)
    with pytest.raises(ShardInUseError, match=f"{tmp_path / 'b'}.* in use"):
        if second == "host":
            HostKVAttention([tmp_path / "c", tmp_path / "b"], **shape)
        else:
            NearStorageAttention([tmp_path / "c", tmp_path / "b"], processes=False, **shape)
    first.close()
    HostKVAttention([tmp_path / "c", tmp_path / "b"], **shape).close()
