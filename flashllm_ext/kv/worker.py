"""Shard workers: one process per shard (the accelerator of one storage device), driven through shared memory.

Host <-> worker: each worker has a request and a reply region in one `multiprocessing.shared_memory` segment and
a pipe. The host writes the tensors of a request into the request region and sends a small struct header
(op, sequence number, layer, tokens) over the pipe, which also wakes the worker; the worker answers with a header
(status, sequence number, its storage counters) and the tensors in the reply region. No tensor is ever pickled:
only q, k_new, v_new go in and (out, lse) come out, as on a computational storage device.

The host waits with a timeout and checks that the worker is alive while it waits, so a worker that dies (killed,
crashed, out of memory) gives `WorkerError` naming the shard and the exit code, never a hang.

`LocalShard` is the same interface in the calling process (tests, small runs): the exact same ShardAttention.
"""

from __future__ import annotations

import multiprocessing as mp
import struct
import time
import traceback
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

from flashllm_ext.kv.attention import ShardAttention
from flashllm_ext.kv.files import FaultInjector, IOCounters
from flashllm_ext.kv.link import Link
from flashllm_ext.kv.store import DTYPES, KVShard

# ops
OP_STEP, OP_APPEND, OP_FLUSH, OP_RESET, OP_CLOSE, OP_STARTS = 1, 2, 3, 4, 5, 6
OP_NAMES = {
    OP_STEP: "step",
    OP_APPEND: "append",
    OP_FLUSH: "flush",
    OP_RESET: "reset",
    OP_CLOSE: "close",
    OP_STARTS: "set_starts",
}
REQUEST = struct.Struct("<iiqq")  # op, layer, sequence number, tokens (OP_APPEND)
REPLY = struct.Struct("<iqqqqqq")  # status (0 ok, 1 error: the message is in the reply region), sequence number,
#                                    bytes read, reads, bytes written, writes (the shard's totals), message bytes
DEFAULT_CHUNK_BYTES = 8 << 20  # prefill K+V per OP_APPEND message
POLL_S = 0.05


class WorkerError(RuntimeError):
    """A shard worker failed: it raised (its traceback is in the message) or its process died."""


@dataclass(frozen=True)
class ShardSpec:
    """Everything a worker needs to own its shard (plain values: it crosses the process boundary once)."""

    directory: str
    n_layers: int
    pairs: int
    group: int
    head_dim: int
    dtype: str
    max_tokens: int
    writeback: int | None = None
    scale: float | None = None
    block_tokens: int | None = None
    prefetch: bool = True
    read_threads: int = 4
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    torch_threads: int = 1
    storage_gbps: float | None = None  # emulated storage bandwidth of this shard's device (None: the real one)
    write_request_bytes: int = 0  # the emulated device's least charge per write request (kv/link.py)
    fault_injector: FaultInjector | None = None  # runs before every write in the worker (picklable; tests)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def token_bytes(self) -> int:
        return self.pairs * self.head_dim * self.torch_dtype.itemsize

    @property
    def chunk_tokens(self) -> int:
        return max(1, self.chunk_bytes // (2 * self.token_bytes))

    def region_bytes(self) -> tuple[int, int]:
        """(request, reply) region sizes: the largest message each way."""
        item = self.torch_dtype.itemsize
        step_in = self.pairs * (self.group + 2) * self.head_dim * item
        append_in = 2 * self.chunk_tokens * self.token_bytes
        reply = self.pairs * self.group * (self.head_dim * item + 4)
        starts = self.pairs * 8
        return max(step_in, append_in, starts), max(reply, 64 << 10)  # room for an error message


def open_shard(spec: ShardSpec) -> ShardAttention:
    """The shard and its attention; with storage_gbps one emulated device paces both its reads and its spills."""
    device = None if spec.storage_gbps is None else Link(spec.storage_gbps, request_bytes=spec.write_request_bytes)
    shard = KVShard.create(
        spec.directory,
        spec.n_layers,
        spec.pairs,
        spec.head_dim,
        spec.torch_dtype,
        spec.max_tokens,
        writeback=spec.writeback,
        read_threads=spec.read_threads,
        fault_injector=spec.fault_injector,
        device=device,
    )
    return ShardAttention(
        shard,
        group=spec.group,
        scale=spec.scale,
        block_tokens=spec.block_tokens,
        prefetch=spec.prefetch,
        storage_link=device,
    )


class _Regions:
    """Typed views of the request and reply regions of one worker's shared memory."""

    def __init__(self, spec: ShardSpec, buf: memoryview):
        self.spec = spec
        self.request_bytes, self.reply_bytes = spec.region_bytes()
        self.raw = torch.frombuffer(buf, dtype=torch.uint8, count=self.request_bytes + self.reply_bytes)

    def _tensor(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        return self.raw[offset : offset + n * dtype.itemsize].view(dtype).view(shape)

    def step_request(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, dt = self.spec, self.spec.torch_dtype
        q = self._tensor(0, (s.pairs, s.group, s.head_dim), dt)
        k = self._tensor(q.nbytes, (s.pairs, s.head_dim), dt)
        v = self._tensor(q.nbytes + k.nbytes, (s.pairs, s.head_dim), dt)
        return q, k, v

    def append_request(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, dt = self.spec, self.spec.torch_dtype
        k = self._tensor(0, (n, s.pairs, s.head_dim), dt)
        return k, self._tensor(k.nbytes, (n, s.pairs, s.head_dim), dt)

    def starts_request(self) -> torch.Tensor:
        return self._tensor(0, (self.spec.pairs,), torch.int64)

    def reply(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        out = self._tensor(self.request_bytes, (s.pairs, s.group, s.head_dim), s.torch_dtype)
        return out, self._tensor(self.request_bytes + out.nbytes, (s.pairs, s.group), torch.float32)

    def message(self, n: int | None = None, text: str | None = None) -> str | None:
        region = self.raw[self.request_bytes :]
        if text is not None:
            data = text.encode()[: region.numel()]
            region[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            return str(len(data))
        return bytes(region[:n].numpy()).decode(errors="replace")


def worker_main(spec: ShardSpec, shm_name: str, conn) -> None:
    """The worker process: owns the shard, serves requests until OP_CLOSE or until the host goes away."""
    torch.set_num_threads(spec.torch_threads)
    shm = shared_memory.SharedMemory(name=shm_name)
    regions = _Regions(spec, shm.buf)
    engine = None
    try:
        engine = open_shard(spec)
        ready = True
    except Exception:
        ready = False
        n = int(regions.message(text=traceback.format_exc()))
        conn.send_bytes(REPLY.pack(1, -1, 0, 0, 0, 0, n))
    while ready:
        try:
            op, layer, seq, tokens = REQUEST.unpack(conn.recv_bytes())
        except (EOFError, OSError):  # the host is gone
            break
        status, n_msg = 0, 0
        try:
            if op == OP_STEP:
                q, k, v = regions.step_request()
                out, lse = engine.step(layer, q, k, v)
                out_region, lse_region = regions.reply()
                out_region.copy_(out)
                lse_region.copy_(lse)
            elif op == OP_APPEND:
                k, v = regions.append_request(tokens)
                engine.append(layer, k.clone(), v.clone())  # the buffer must not alias the request region
            elif op == OP_FLUSH:
                engine.shard.flush()
            elif op == OP_RESET:
                engine.shard.reset()
                engine.set_starts(None)
            elif op == OP_STARTS:
                engine.set_starts(regions.starts_request().clone())
            elif op == OP_CLOSE:
                engine.shard.close()
                engine.close()
        except Exception:
            status = 1
            n_msg = int(regions.message(text=traceback.format_exc()))
        c = engine.shard.counters()
        conn.send_bytes(REPLY.pack(status, seq, c.bytes_read, c.n_reads, c.bytes_written, c.n_writes, n_msg))
        if op == OP_CLOSE and status == 0:
            break
    del regions
    shm.close()


class ShardWorker:
    """Host-side handle of one worker process. submit_* sends a request; wait() returns its reply. One request in
    flight at a time (the host waits on every shard of a layer before the next layer can start anyway)."""

    def __init__(self, spec: ShardSpec, *, timeout_s: float = 600.0, name: str = "shard"):
        self.spec, self.timeout_s, self.name = spec, timeout_s, name
        request_bytes, reply_bytes = spec.region_bytes()
        self._shm = shared_memory.SharedMemory(create=True, size=request_bytes + reply_bytes)
        self._regions = _Regions(spec, self._shm.buf)
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=worker_main, args=(spec, self._shm.name, child), daemon=True, name=f"flashllm-kv-{name}"
        )
        self._proc.start()
        child.close()
        self._seq = 0
        self._inflight: tuple[int, int, int] | None = None  # (op, layer, seq)
        self._dead: str | None = None
        self.counters = IOCounters()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def dead(self) -> str | None:
        """Why the worker is known to be gone (None: it is not)."""
        return self._dead

    def _send(self, op: int, layer: int, tokens: int = 0) -> None:
        if self._dead is not None:
            raise WorkerError(self._dead)
        if self._inflight is not None:
            raise RuntimeError(f"{self.name}: a {OP_NAMES[self._inflight[0]]} request is still in flight")
        self._seq += 1
        self._inflight = (op, layer, self._seq)
        try:
            self._conn.send_bytes(REQUEST.pack(op, layer, self._seq, tokens))
        except OSError:
            self._inflight = None
            self._fail(op, layer)

    def _fail(self, op: int, layer: int, what: str | None = None) -> None:
        self._proc.join(timeout=1.0)
        code = self._proc.exitcode
        what = what or (f"exited with code {code}" if code is not None else "stopped answering")
        self._dead = (
            f"KV worker {self.name} (pid {self._proc.pid}, {self.spec.directory}) {what} "
            f"during {OP_NAMES[op]} of layer {layer}"
        )
        raise WorkerError(self._dead)

    def wait(self) -> None:
        """Waits for the reply to the request in flight; raises WorkerError if the worker failed or died."""
        op, layer, seq = self._inflight
        deadline = time.monotonic() + self.timeout_s
        while not self._conn.poll(POLL_S):
            if not self._proc.is_alive():
                self._inflight = None
                self._fail(op, layer)
            if time.monotonic() > deadline:  # hung (stopped, deadlocked, stuck in I/O): give up on it
                self._inflight = None
                self._proc.kill()
                self._fail(op, layer, f"did not answer within {self.timeout_s:g} s (killed)")
        try:
            status, got_seq, *io, n_msg = REPLY.unpack(self._conn.recv_bytes())
        except (EOFError, OSError):
            self._inflight = None
            self._fail(op, layer)
        self._inflight = None
        if status != 0:
            text = self._regions.message(n_msg)
            if got_seq == -1:  # the shard could not be opened: the worker has exited
                self._dead = f"KV worker {self.name} ({self.spec.directory}) failed to start:\n{text}"
                raise WorkerError(self._dead)
            raise WorkerError(
                f"KV worker {self.name} ({self.spec.directory}) failed in {OP_NAMES[op]} of layer {layer}:\n{text}"
            )
        if got_seq != seq:
            raise WorkerError(f"KV worker {self.name}: reply {got_seq} to request {seq}")
        self.counters = IOCounters(*io)

    def submit_step(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """q [pairs, group, D], k_new / v_new [pairs, D] (any dtype: cast to the shard's)."""
        q_r, k_r, v_r = self._regions.step_request()
        q_r.copy_(q)
        k_r.copy_(k_new)
        v_r.copy_(v_new)
        self._send(OP_STEP, layer)

    def step_result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [pairs, group, D] in the shard's dtype, lse [pairs, group] float32), copied out of the region."""
        self.wait()
        out, lse = self._regions.reply()
        return out.clone(), lse.clone()

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Bulk append (prefill) of k, v [n, pairs, D], in chunks of the request region's size."""
        for t0 in range(0, k.shape[0], self.spec.chunk_tokens):
            t1 = min(t0 + self.spec.chunk_tokens, k.shape[0])
            k_r, v_r = self._regions.append_request(t1 - t0)
            k_r.copy_(k[t0:t1])
            v_r.copy_(v[t0:t1])
            self._send(OP_APPEND, layer, t1 - t0)
            self.wait()

    def submit(self, op: int) -> None:
        """OP_FLUSH, OP_RESET or OP_CLOSE; wait() for the reply."""
        self._send(op, -1)

    def submit_starts(self, starts: torch.Tensor) -> None:
        """Left padding: pair p attends only tokens >= starts[p] (int64 [pairs]); wait() for the reply."""
        self._regions.starts_request().copy_(starts)
        self._send(OP_STARTS, -1)

    def close(self, timeout_s: float = 30.0) -> None:
        """Spills what is buffered and stops the worker (a dead one is only reaped). If the spill fails the worker
        stays up with its buffer (WorkerError; close() again retries, terminate() gives up on the buffer)."""
        if self._dead is None and self._proc.is_alive():
            try:
                self._send(OP_CLOSE, -1)
                self.wait()
            except WorkerError:
                if self._dead is None:
                    raise
        self.terminate(timeout_s)

    def terminate(self, timeout_s: float = 5.0) -> None:
        self._proc.join(timeout=timeout_s if self._dead is None else 0.1)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()
        del self._regions
        self._shm.close()
        self._shm.unlink()


class LocalShard:
    """ShardWorker's interface in this process: the same ShardAttention, no process and no shared memory."""

    dead: str | None = None  # it lives as long as this process

    def __init__(self, spec: ShardSpec, **_):
        self.spec, self.name = spec, spec.directory
        self.engine = open_shard(spec)
        self._result = None

    @property
    def counters(self) -> IOCounters:
        return self.engine.shard.counters()

    def submit_step(self, layer, q, k_new, v_new) -> None:
        dt = self.spec.torch_dtype
        out, lse = self.engine.step(layer, q.to(dt), k_new.to(dt), v_new.to(dt))
        self._result = (out.to(dt), lse)  # what crosses the link: out in the KV dtype, as a worker sends it

    def step_result(self) -> tuple[torch.Tensor, torch.Tensor]:
        result, self._result = self._result, None
        return result

    def append(self, layer, k, v) -> None:
        self.engine.append(layer, k.to(self.spec.torch_dtype).contiguous(), v.to(self.spec.torch_dtype).contiguous())

    def submit(self, op: int) -> None:
        if op == OP_FLUSH:
            self.engine.shard.flush()
        elif op == OP_RESET:
            self.engine.shard.reset()
            self.engine.set_starts(None)
        elif op == OP_CLOSE:
            self.close()

    def submit_starts(self, starts: torch.Tensor) -> None:
        self.engine.set_starts(starts)

    def wait(self) -> None:
        pass

    def close(self, timeout_s: float = 0.0) -> None:
        self.engine.shard.close()
        self.engine.close()

    def terminate(self, timeout_s: float = 0.0) -> None:
        self.engine.shard.abandon()
        self.engine.close()
