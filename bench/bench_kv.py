"""INF² benchmark: batched decoding with the KV cache on storage (ablation: INF² Figure 11; scaling: Figures 3c/16).

Configs: `baseline` (FlexGen-style: the host reads every layer's whole KV history over the link each step, next
layer prefetched, writes each step's K/V back: c = 1), `ans` (attention near storage: one worker process per
device, c = 1), `ans+wb` (+ delayed writeback, default c: one spill per shard and file >= 4 KiB), `ans+x` and
`ans+wb+x` (+ X-cache, alpha from HILOS' formula over the emulated bandwidths; X regenerated on the host CPU).

Every device is a directory on this machine's one disk, its bandwidth emulated by a token bucket (--device-gbps),
all of them behind one emulated host link (--link-devices x the device bandwidth); tokens/s counts decode steps
only (prefill excluded). Bytes are exact counters (kv/traffic.py): interconnect per step (lse included; the
Eq. 3 check excludes it), storage bytes with direct-I/O padding, writes per step and mean write size after the
prompt (flushed before the clock starts, so the decode writes are counted alone).

    python -m bench.bench_kv [--json] [--only ablation|scaling|kernel] [--workers 1,2,4,8,16] [--context 1024]
                             [--dir /dev/shm/kv-bench]   # emulated devices need no disk: tmpfs keeps O_DIRECT
    python -m bench.bench_kv --only generate [--batch 16 --context 2048 --new-tokens 6 --hidden 1024 ...]

`--only generate`: batched greedy `generate()` of a synthesized Llama model (random weights; heads x head_dim as
given, residual width --hidden, --layers layers) with its KV cache on the emulated devices, through
`flashllm_ext.kv.hf`: prefill writes the store in bulk, every decode step runs each config's attention. tokens/s
counts the decode steps (from the end of the last layer's prefill); the generated tokens of every config are
compared with the baseline's. X-cache alpha: --x-alpha hilos (the paper's formula) or auto (choose_alpha given the
host's measured K/V regeneration rate: alpha 0 where regenerating is slower than reading).
    python -m bench.bench_kv --plot ABLATION.jsonl SCALING.jsonl   # the two plots from earlier --json runs

Devices' write requests: `--write-request probe` measures the per-request cost of a small durable write on the real
disk (`flashllm_ext.kv.link.probe_write_request`, under the disk lock) and charges every spill on an emulated device
at least that many bytes (`BYTES`: a given cost; 0: writes cost their bytes only), so the writes per step, which
delayed writeback (`--writeback C` for the +wb configs) reduces, cost device time as on a real SSD. The final
flush of the buffered K/V is inside the timed window.

An emulated regime where the X-cache can pay: `--regen-read-ratio R` measures the host's K/V regeneration rate
and sets each device's bandwidth so that reading one token's K/V from the ablation's devices takes the host's
regeneration time / R (INF²'s GPU host against its SmartSSDs: R ~0.6, see BENCHMARKS.md), the link at
--link-devices devices; alpha is then the compute-aware choice (`--x-alpha auto`).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import device_name, emit
from flashllm_ext.kv import HostKVAttention, Link, NearStorageAttention, XCacheAttention, choose_alpha, linear_projector
from flashllm_ext.kv.link import probe_write_request
from flashllm_ext.kv.traffic import Traffic
from flashllm_ext.kv.xcache import regime_device_gbps
from flashllm_ext.io.paths import resolve_cache_dir

RESULTS = Path(__file__).resolve().parent / "results"
DISK_LOCK = "/tmp/flashllm-disk.lock"  # the shared disk: benchmarks that touch it take turns
CONFIGS = ["baseline", "ans", "ans+wb", "ans+x", "ans+wb+x"]
COLUMNS = [
    "config",
    "workers",
    "batch",
    "context",
    "tokens_per_s",
    "interconnect_bytes_per_step",
    "storage_read_bytes_per_step",
    "writes_per_step",
    "mean_write_kib",
    "link_gbps",
    "n_x",
]


def make_backend(config: str, workers: int, args, root: Path):
    dirs = [root / f"dev{i}" for i in range(workers)]
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    link = Link(args.link_gbps)
    writeback = args.writeback if "+wb" in config else 1
    shape = dict(
        n_layers=args.layers,
        q_heads=args.heads,
        kv_heads=args.heads,
        head_dim=args.head_dim,
        dtype=torch.float16,
        max_tokens=args.context + args.steps + 1,
        writeback=writeback,
        link=link,
        storage_gbps=args.device_gbps,
        write_request_bytes=args.write_request_bytes,
    )
    n_x, reason, alpha = (
        x_sequences(args, workers, hidden=args.heads * args.head_dim) if "+x" in config else (0, None, 0.0)
    )
    if config == "baseline":
        backend = HostKVAttention(dirs, batch=args.batch, **shape)
    else:
        backend = NearStorageAttention(dirs, batch=args.batch - n_x, processes=True, torch_threads=1, **shape)
    if n_x:  # alpha 0 (the compute-aware choice on a slow host) leaves the config without X rows: as +wb alone
        hidden, kv = args.heads * args.head_dim, args.heads * args.head_dim
        g = torch.Generator().manual_seed(1)
        wk = [torch.randn(kv, hidden, generator=g) / hidden**0.5 for _ in range(args.layers)]
        wv = [torch.randn(kv, hidden, generator=g) / hidden**0.5 for _ in range(args.layers)]
        backend = XCacheAttention(
            backend,
            linear_projector(wk, wv, kv_heads=args.heads),
            n_x=n_x,
            hidden=hidden,
            max_tokens=args.context + args.steps + 1,
            x_dtype=torch.float16,
        )
    return backend, link, n_x, (reason, alpha)


def unpaced(backend, link: Link | None) -> None:
    """Attaches `link` to the backend's storage side (None: detaches it): the prompt's bulk write is not timed, so
    it is not paced either (at the default sizes it would cost minutes of wall time per run)."""
    storage = getattr(backend, "storage", backend)
    storage.link = link


def run(config: str, workers: int, args, root: Path) -> dict:
    backend, link, n_x, (reason, alpha) = make_backend(config, workers, args, root)
    b, h, d, s = args.batch, args.heads, args.head_dim, args.context
    g = torch.Generator().manual_seed(0)
    hidden = h * d
    try:
        # the prompt in chunks of one random block, repeated (the kernels' speed does not depend on the values):
        # at batch 32 x 4K x 56 heads a layer's K+V are 3.5 GiB, more than the host should hold twice
        chunk = min(s, args.prefill_chunk)
        k = torch.randn(b, h, chunk, d, generator=g).half()
        v = torch.randn(b, h, chunk, d, generator=g).half()
        x = torch.randn(b, chunk, hidden, generator=g).half() if n_x else None
        unpaced(backend, None)
        for layer in range(args.layers):
            for t0 in range(0, s, chunk):
                n = min(chunk, s - t0)
                if n_x:
                    backend.prefill(layer, k[:, :, :n], v[:, :, :n], x[:, :n])
                else:
                    backend.prefill(layer, k[:, :, :n], v[:, :, :n])
        del k, v, x
        backend.flush()
        unpaced(backend, link)
        before = backend.traffic.total()
        inputs = [
            [
                (
                    torch.randn(b, h, d, generator=g),
                    torch.randn(b, h, d, generator=g).half(),
                    torch.randn(b, h, d, generator=g).half(),
                    torch.randn(b, hidden, generator=g).half(),
                )
                for _ in range(args.layers)
            ]
            for _ in range(args.steps)
        ]
        start = time.perf_counter()
        for step in inputs:
            for layer, (q, k_new, v_new, x) in enumerate(step):
                if n_x:
                    backend.step(layer, q, k_new, v_new, x)
                else:
                    backend.step(layer, q, k_new, v_new)
        backend.flush()  # the buffered K/V's last spill is part of the work: without it writeback looks free
        elapsed = time.perf_counter() - start
        traffic = backend.traffic
        decode = traffic.total(steps=range(args.steps))
        after = traffic.total()
        writes = Traffic()
        writes.add(after)
        for f in ("storage_write_bytes", "storage_writes"):
            setattr(writes, f, getattr(after, f) - getattr(before, f))
        read_per_step = decode.storage_read_bytes / args.steps
        # what the devices are charged for the writes: each request at least --write-request bytes
        write_charged = writes.storage_writes * max(writes.mean_write_bytes, args.write_request_bytes) / args.steps
        # the emulated bandwidths' bound: the devices read and write in parallel; the baseline's history also
        # crosses the link
        device_s = (read_per_step + write_charged) / (workers * args.device_gbps * 1e9 / 8)
        link_s = decode.interconnect_bytes() / args.steps / (link.gbps * 1e9 / 8)
        row = {
            "bench": "kv",
            "config": config,
            "workers": workers,
            "batch": b,
            "context": s,
            "layers": args.layers,
            "heads": h,
            "head_dim": d,
            "steps": args.steps,
            "tokens_per_s": b * args.steps / elapsed,
            "bound_tokens_per_s": b / max(device_s, link_s),
            "interconnect_bytes_per_step": decode.interconnect_bytes() / args.steps,
            "interconnect_bytes_no_lse": decode.interconnect_bytes(include_lse=False),
            "storage_read_bytes_per_step": read_per_step,
            "storage_reads_per_step": decode.storage_reads / args.steps,
            "writes_per_step": writes.storage_writes / args.steps,
            "mean_write_kib": writes.mean_write_bytes / 1024,
            "write_charged_bytes_per_step": write_charged,
            "x_bytes_per_step": decode.x_bytes / args.steps,
            "link_gbps": link.gbps,
            "device_gbps": args.device_gbps,
            "n_x": n_x,
            "alpha": alpha,
            "x_alpha_reason": reason,
            "write_request_bytes": args.write_request_bytes,
            "writeback": backend.storage.writeback[0] if n_x else backend.writeback[0],
            "loadavg": os.getloadavg(),
        }
        backend.close()
        return row
    except BaseException:
        backend.terminate()
        raise
    finally:  # the devices' files go with the run: /dev/shm holds one run's KV at a time
        for i in range(workers):
            shutil.rmtree(root / f"dev{i}", ignore_errors=True)


def median_rows(rows: list[dict]) -> dict:
    """The median-tokens/s row of repeated runs (the byte counters are the same in every run)."""
    rows = sorted(rows, key=lambda r: r["tokens_per_s"])
    row = dict(rows[len(rows) // 2])
    row["tokens_per_s_runs"] = [round(r["tokens_per_s"], 3) for r in rows]
    return row


def interleaved(jobs: list[tuple[str, int]], args, root: Path, run_job=None) -> list[dict]:
    """Every job (config, workers) once per round, the order rotated each round; the median row of each."""
    run_job = run_job or (lambda config, workers: run(config, workers, args, root))
    runs: dict[tuple[str, int], list[dict]] = {job: [] for job in jobs}
    for r in range(args.rounds):
        for job in jobs[r % len(jobs) :] + jobs[: r % len(jobs)]:
            print(f"round {r + 1}/{args.rounds}: {job[0]} x{job[1]}", file=sys.stderr, flush=True)
            runs[job].append(run_job(*job))
    return [median_rows(runs[job]) for job in jobs]


def host_regeneration_flops(hidden: int, kv_values: int, tokens: int | None = None, rounds: int = 5) -> float:
    """The host's K/V regeneration rate (flop/s): X [tokens, hidden] @ [hidden, kv_values] in float32, as
    XCacheAttention runs it, median of `rounds`. tokens: default 2048, fewer at OPT-30B's width (~50 GFLOP per
    call at most: the rate of a large GEMM does not need more, and the run should not take minutes)."""
    from flashllm_ext.harness.timing import time_interleaved

    tokens = tokens or max(64, min(2048, int(50e9 / (2 * hidden * kv_values))))
    x, w = torch.randn(tokens, hidden), torch.randn(kv_values, hidden)
    seconds = time_interleaved({"regen": lambda: torch.nn.functional.linear(x, w)}, rounds=rounds)["regen"]
    return 2 * tokens * hidden * kv_values / seconds


def synthesized_llama(args):
    """A Llama-architecture model with random weights: args.heads x args.head_dim attention (MHA), residual width
    args.hidden, MLP width args.hidden, args.layers layers, a small vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.context + args.new_tokens + 1,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def measured_host_flops(hidden: int, kv_values: int) -> float:
    """host_regeneration_flops, measured once per process and shape (the regime and alpha use the same rate)."""
    key = (hidden, kv_values)
    if key not in HOST_FLOPS:
        HOST_FLOPS[key] = host_regeneration_flops(hidden, kv_values)
    return HOST_FLOPS[key]


def x_sequences(args, workers: int, hidden: int | None = None) -> tuple[int, str, float]:
    """(sequences kept as X, why, alpha) for the X-cache configs; hidden: the model's width (default
    args.hidden). With --x-alpha auto alpha is given the host's measured regeneration rate."""
    hidden = hidden or args.hidden
    host_flops = measured_host_flops(hidden, 2 * args.heads * args.head_dim) if args.x_alpha == "auto" else None
    choice = choose_alpha(
        link_gbps=args.link_gbps,
        storage_gbps=args.device_gbps * workers,
        hidden=hidden,
        kv_heads=args.heads,
        head_dim=args.head_dim,
        host_flops=host_flops,
    )
    n_x = min(args.batch - 1, round(choice.alpha * args.batch))
    if host_flops is not None:
        reason = f"{choice.reason} (host: {host_flops / 1e9:.3g} GFLOP/s measured)"
    return n_x, choice.reason if host_flops is None else reason, choice.alpha


HOST_FLOPS: dict[tuple[int, int], float] = {}


def regen_read_regime(args) -> dict:
    """--regen-read-ratio R: sets args.device_gbps (and the link) so that reading one token's K/V from the
    ablation's devices takes the host's measured regeneration time / R; X-cache alpha becomes compute-aware."""
    hidden = args.heads * args.head_dim
    host_flops = measured_host_flops(hidden, 2 * args.heads * args.head_dim)
    args.device_gbps = regime_device_gbps(
        host_flops=host_flops,
        hidden=hidden,
        kv_heads=args.heads,
        head_dim=args.head_dim,
        ratio=args.regen_read_ratio,
        devices=args.ablation_workers,
    )
    args.link_gbps = args.link_devices * args.device_gbps
    args.x_alpha = "auto"
    return {
        "bench": "kv",
        "check": "regime",
        "regen_read_ratio": args.regen_read_ratio,
        "host_gflops": host_flops / 1e9,
        "devices": args.ablation_workers,
        "device_gbps": args.device_gbps,
        "link_gbps": args.link_gbps,
        "loadavg": os.getloadavg(),
    }


def write_request_cost(spec: str, probe_dir: Path) -> tuple[int, dict | None]:
    """--write-request: 'probe' (measured on the disk under probe_dir, holding the disk lock), or a byte count."""
    if spec != "probe":
        return int(spec), None
    probe_dir.mkdir(parents=True, exist_ok=True)
    with open(DISK_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        probe = probe_write_request(probe_dir)
    return probe.request_bytes, {
        "bench": "kv",
        "check": "write_request_probe",
        "directory": str(probe_dir),
        "request_us": probe.request_s * 1e6,
        "write_bytes": probe.write_bytes,
        "seq_gbytes_per_s": probe.seq_bytes_per_s / 1e9,
        "request_bytes": probe.request_bytes,
        "loadavg": os.getloadavg(),
    }


def run_generate(config: str, workers: int, model, ids: torch.Tensor, args, root: Path, n_x: int) -> dict:
    """One batched greedy generate() of `model` with its KV on `workers` emulated devices, as `config`."""
    from flashllm_ext.kv import hf

    dirs = [root / f"dev{i}" for i in range(workers)]
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    link = Link(args.link_gbps)
    kind = "baseline" if config == "baseline" else "near_storage"
    kwargs = {"processes": True, "torch_threads": 1} if kind == "near_storage" else {}
    n_x = n_x if "+x" in config else 0
    b, s, n = args.batch, args.context, args.new_tokens
    backend = hf.storage_attention(
        model,
        dirs,
        batch=b,
        max_tokens=s + n,
        kind=kind,
        dtype=torch.float16,
        x_cache=n_x,
        link=link,
        storage_gbps=args.device_gbps,
        write_request_bytes=args.write_request_bytes,
        writeback=args.writeback if "+wb" in config else 1,
        **kwargs,
    )
    marks = {}
    prefill = backend.prefill

    def timed_prefill(layer, *a, **kw):
        prefill(layer, *a, **kw)
        if layer == args.layers - 1:
            marks["decode_start"] = time.perf_counter()

    backend.prefill = timed_prefill
    try:
        backend.reset()  # waits for the workers to be up: their start is not the prefill's time
        start = time.perf_counter()
        out = hf.generate(model, ids, backend, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        backend.flush()  # timed, as in run()
        end = time.perf_counter()
        steps = n - 1  # the first new token comes from the prefill
        traffic = backend.traffic
        decode = traffic.total(steps=range(steps))
        # writes of steps 1..: step 0's record also holds the prompt's bulk spill (finished during it)
        later = traffic.total(steps=range(1, steps))
        storage = backend.storage if n_x else backend
        row = {
            "bench": "kv",
            "mode": "generate",
            "config": config,
            "workers": workers,
            "batch": b,
            "context": s,
            "layers": args.layers,
            "heads": args.heads,
            "head_dim": args.head_dim,
            "hidden": args.hidden,
            "new_tokens": n,
            "prefill_s": marks["decode_start"] - start,
            "tokens_per_s": b * steps / (end - marks["decode_start"]),
            "interconnect_bytes_per_step": decode.interconnect_bytes() / steps,
            "storage_read_bytes_per_step": decode.storage_read_bytes / steps,
            "storage_reads_per_step": decode.storage_reads / steps,
            "writes_per_step": later.storage_writes / (steps - 1),
            "mean_write_kib": later.mean_write_bytes / 1024,
            "x_bytes_per_step": decode.x_bytes / steps,
            "link_gbps": link.gbps,
            "device_gbps": args.device_gbps,
            "n_x": n_x,
            "writeback": storage.writeback[0],
            "tokens": out[:, s:].tolist(),
        }
        backend.close()
        return row
    except BaseException:
        backend.terminate()
        raise
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def generate_ablation(args, root: Path) -> list[dict]:
    """baseline, ans, ans+wb, ans+wb+x through generate() of a synthesized model, interleaved, medians."""
    workers = args.ablation_workers
    model = synthesized_llama(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.context), generator=torch.Generator().manual_seed(0))
    n_x, reason, _ = x_sequences(args, workers)
    auto = None
    if args.x_alpha == "hilos":  # what the compute-aware choice would have done, for the record
        auto = x_sequences(argparse.Namespace(**{**vars(args), "x_alpha": "auto"}), workers)
    print(f"X-cache: {n_x} of {args.batch} sequences ({reason})", file=sys.stderr, flush=True)
    configs = ["baseline", "ans", "ans+wb", "ans+wb+x"]
    rows = interleaved(
        [(c, workers) for c in configs],
        args,
        root,
        lambda config, w: run_generate(config, w, model, ids, args, root, n_x),
    )
    base_tokens = rows[0]["tokens"]
    for row in rows:
        row["tokens_equal_baseline"] = row.pop("tokens") == base_tokens
        row["x_alpha_reason"] = reason if "+x" in row["config"] else None
        if auto is not None and "+x" in row["config"]:
            row["x_auto_n_x"], row["x_auto_reason"], _ = auto
    return rows


def eq3_checks(rows: list[dict], args) -> list[dict]:
    """INF² Eq. 3 on the measured counters, per device count with a baseline row: baseline / near-storage
    interconnect bytes (lse excluded) against the mean of (s + 1) / 2 over the decode steps (MHA, fp16, no X rows;
    the baseline writes back every step, and near storage's traffic does not depend on its c)."""
    checks = []
    for base in (r for r in rows if r["config"] == "baseline"):
        ans = next(
            (r for r in rows if r["workers"] == base["workers"] and r["config"] != "baseline" and r["n_x"] == 0), None
        )
        if ans is None:
            continue
        tokens = [args.context + i + 1 for i in range(args.steps)]
        exact = 2 * base["interconnect_bytes_no_lse"] * args.steps == ans["interconnect_bytes_no_lse"] * sum(tokens)
        checks.append(
            {
                "bench": "kv",
                "check": "eq3",
                "workers": base["workers"],
                "against": ans["config"],
                "measured_ratio": base["interconnect_bytes_no_lse"] / ans["interconnect_bytes_no_lse"],
                "expected_ratio": statistics.mean(tokens) / 2,
                "exact_integers": exact,
            }
        )
    return checks


def kernel_vs_storage(args, root: Path) -> dict:
    """One worker's attention kernel against the storage read bandwidth it is fed: the same shard's blocks read
    with direct I/O (no compute) and attended in memory (no I/O), interleaved, medians. Target: kernel >= 0.8x."""
    from flashllm_ext.kv import KVShard, ShardAttention
    from flashllm_ext.harness.timing import time_interleaved

    shutil.rmtree(root / "kernel", ignore_errors=True)
    pairs = args.batch * args.heads
    shard = KVShard.create(root / "kernel", 1, pairs, args.head_dim, torch.float16, args.context, writeback=1)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(args.context, pairs, args.head_dim, generator=g).half()
    v = torch.randn(args.context, pairs, args.head_dim, generator=g).half()
    shard.append(0, k, v)
    shard.flush()
    attn = ShardAttention(shard, group=1)
    view = shard.view(0)
    q = torch.randn(pairs, 1, args.head_dim, generator=g).half()
    blocks = [(t0, min(t0 + attn.block_tokens, view.disk_len)) for t0 in range(0, view.disk_len, attn.block_tokens)]
    kb, vb = (
        torch.empty(attn.block_tokens, pairs, args.head_dim).half(),
        torch.empty(attn.block_tokens, pairs, args.head_dim).half(),
    )

    def read_only():
        for t0, t1 in blocks:
            shard.read(0, t0, t1, kb[: t1 - t0], vb[: t1 - t0])

    def compute_only():
        for t0, t1 in blocks:
            attn.attend_rows(q, k[t0:t1], v[t0:t1], t0)

    times = time_interleaved(
        {"read": read_only, "kernel": compute_only, "both": lambda: attn.attend(view, q)},
        rounds=args.rounds,
        min_seconds=0.0,
    )
    nbytes = k.nbytes + v.nbytes
    # a native CPU kernel registered for the op (else its pure-torch reference ran)
    native = torch._C._dispatch_has_kernel_for_dispatch_key("flashllm::decode_attention", "CPU")
    attn.close()
    shard.close()
    shutil.rmtree(root / "kernel", ignore_errors=True)
    return {
        "bench": "kv",
        "check": "kernel_vs_storage",
        "bytes": nbytes,
        "pairs": pairs,
        "context": args.context,
        "read_gbps": nbytes / times["read"] / 1e9,
        "kernel_gbps": nbytes / times["kernel"] / 1e9,
        "attend_gbps": nbytes / times["both"] / 1e9,
        "kernel_over_read": times["read"] / times["kernel"],
        "native_kernel": native,
        "torch_threads": torch.get_num_threads(),
    }


def plot(rows: list[dict], scaling: list[dict], tag: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    RESULTS.mkdir(exist_ok=True)
    if rows:
        base = next(r["tokens_per_s"] for r in rows if r["config"] == "baseline")
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar([r["config"] for r in rows], [r["tokens_per_s"] / base for r in rows], color="tab:blue")
        ax.set_ylabel("tokens/s vs baseline")
        ax.set_title(f"INF² ablation ({rows[0]['workers']} devices, context {rows[0]['context']})")
        fig.tight_layout()
        fig.savefig(RESULTS / f"bench_kv_ablation{tag}.png", dpi=120)
    if scaling:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for config in sorted({r["config"] for r in scaling}):
            pts = sorted((r["workers"], r["tokens_per_s"]) for r in scaling if r["config"] == config)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=config)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices (workers) behind one link of 2 devices' bandwidth")
        ax.set_ylabel("tokens/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / f"bench_kv_scaling{tag}.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest shapes, one round, every section (generate too): proves the script runs",
    )
    parser.add_argument("--only", choices=["ablation", "scaling", "kernel", "generate"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=56)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=6, help="generate: tokens generated per sequence")
    parser.add_argument("--hidden", type=int, default=1024, help="generate: the synthesized model's residual width")
    parser.add_argument("--vocab", type=int, default=512, help="generate: the synthesized model's vocabulary")
    parser.add_argument(
        "--writeback",
        type=int,
        default=None,
        help="c (tokens per spill) of the +wb configs (default: one spill per shard and file >= 4 KiB)",
    )
    parser.add_argument(
        "--write-request",
        default="0",
        help="least charge of one write request on an emulated device, in bytes, or 'probe' "
        "(measured on the disk under --probe-dir)",
    )
    parser.add_argument(
        "--probe-dir",
        type=Path,
        default=None,
        help="where --write-request probe writes its scratch file (default: the cache dir)",
    )
    parser.add_argument(
        "--regen-read-ratio",
        type=float,
        default=None,
        help="emulated regime: device bandwidth set so that reading a token's K/V from the "
        "ablation's devices takes the host's regeneration time / R",
    )
    parser.add_argument(
        "--scaling-configs",
        default=None,
        help="configs the scaling study runs at every device count (default: ans+wb at every "
        "count, the baseline at the first and last, ans+wb+x at the last)",
    )
    parser.add_argument(
        "--results-tag",
        default=None,
        help="also write every row to bench/results/bench_kv<TAG>.jsonl; the plots get the suffix too",
    )
    parser.add_argument(
        "--x-alpha",
        choices=["hilos", "auto"],
        default="hilos",
        help="X-cache fraction from HILOS' formula, or compute-aware (choose_alpha given the host's "
        "measured K/V regeneration rate)",
    )
    parser.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens written per prefill call")
    parser.add_argument("--workers", default="1,2,4,8,16", help="device counts of the scaling study")
    parser.add_argument("--ablation-workers", type=int, default=4)
    parser.add_argument("--device-gbps", type=float, default=0.128, help="emulated read bandwidth of one device")
    parser.add_argument("--link-devices", type=float, default=2.0, help="the link's bandwidth in devices")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--plot",
        type=Path,
        nargs=2,
        metavar=("ABLATION_JSONL", "SCALING_JSONL"),
        help="only draw the plots from two earlier --json outputs",
    )
    args = parser.parse_args()
    if args.plot:
        ablation, scaling = (
            [json.loads(line) for line in f.read_text().splitlines() if '"config"' in line] for f in args.plot
        )
        plot(ablation, scaling)
        return
    if args.smoke:  # a few tokens of a few heads on two devices: every section, seconds each
        args.rounds, args.batch, args.heads, args.head_dim, args.context, args.steps = 1, 2, 4, 32, 64, 1
        args.workers, args.ablation_workers, args.new_tokens, args.hidden, args.prefill_chunk = "1,2", 2, 3, 64, 32
        args.no_plot = True
    args.link_gbps = args.link_devices * args.device_gbps
    root = args.dir or resolve_cache_dir() / "kv-bench"
    root.mkdir(parents=True, exist_ok=True)
    print(f"machine: {device_name()}", file=sys.stderr)
    results = None
    if args.results_tag is not None:
        RESULTS.mkdir(exist_ok=True)
        results = RESULTS / f"bench_kv{args.results_tag}.jsonl"
        results.write_text("")

    def report(rows: list[dict]) -> list[dict]:
        """Print (and with --results-tag, append) rows as soon as they are measured: a failure later in the run
        keeps them."""
        if results is not None:
            with results.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        if args.json:
            emit(rows, True)
        else:
            emit([r for r in rows if "config" in r], False, COLUMNS)
            print(*(json.dumps(r) for r in rows if "config" not in r), sep="\n", flush=True)
        return rows

    ablation, scaling = [], []
    args.write_request_bytes, probe = write_request_cost(
        args.write_request, args.probe_dir or resolve_cache_dir() / "kv-probe"
    )
    report([probe] if probe else [])
    if args.regen_read_ratio is not None:
        report([regen_read_regime(args)])
    if args.only in (None, "ablation"):
        ablation = report(interleaved([(c, args.ablation_workers) for c in CONFIGS], args, root))
        report(eq3_checks(ablation, args))
    if args.only in (None, "generate") if args.smoke else args.only == "generate":
        report(generate_ablation(args, root))
    if args.only in (None, "kernel"):
        report([kernel_vs_storage(args, root)])
    if args.only in (None, "scaling"):
        counts = [int(n) for n in args.workers.split(",")]
        if args.scaling_configs:
            jobs = [(c, n) for n in counts for c in args.scaling_configs.split(",")]
        else:
            jobs = [("ans+wb", n) for n in counts] + [
                ("baseline", counts[0]),
                ("baseline", counts[-1]),
                ("ans+wb+x", counts[-1]),
            ]
        scaling = report(interleaved(list(dict.fromkeys(jobs)), args, root))
        report(eq3_checks(scaling, args))
    shutil.rmtree(root, ignore_errors=True)
    if not args.no_plot:
        plot(ablation, scaling, args.results_tag or "")


if __name__ == "__main__":
    main()
