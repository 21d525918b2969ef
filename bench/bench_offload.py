"""Endor offloaded inference: greedy decoding with whole decoder layers in memory or on SSD under a
DRAM budget, each mode and the accelerate disk-offload peer in its own process inside a memory cgroup of that
process's baseline + the budget (page cache counted, dropped first; bench/common.py run_limited_child).

Modes (flashllm_ext.offload): dense (dense layer store), endor (Endor store on dense's placement: the same layers in
memory, dense), endor+more-resident (in-memory layers kept compressed: more of them fit), and accelerate (transformers +
accelerate device_map disk offload of the same pruned checkpoint, max_memory = the budget). Asked for by --modes: q8
and q4, dense mode on a layer store of the same checkpoint quantized to GGUF blocks (q8_0, q4_0), computed as stored
(quantized_linear), at the same budget (a share of the fp16 model). On the CPU the offloaded layers run on the lean
decoder (load_offload_decoder, its KV cache charged to the budget; --decoder transformers: load_offload's
transformers model, as on cuda); `decoder` in each row says which. Same prompt, same number
of greedy decode tokens; ms_per_token is the median decode token; read_ms (exposed read wait), decompress_ms,
compute_ms (decoder-layer time minus both), bytes_read_per_token and reads are the runtime's per-token means over the
decode tokens; proc_read_mb_per_token is the child's storage reads from /proc/self/io (every mode, accelerate
included). Configurations run round-robin for --rounds rounds (each in a fresh process); bench:"offload_median"
rows are per-mode medians.

--device cuda (Endor's GPU setting): layers in GPU memory by --device-budget, then in host memory by --budget (as
stored: compressed in the Endor modes, copied to the GPU and decompressed there), the rest read from SSD into GPU
memory (kvikio, or a pinned buffer); bytes_moved_per_token counts the host-to-GPU copies, read_path the SSD route.
accelerate gets the same budgets (max_memory GPU, cpu, then disk); device_peak_mb is each mode's peak of allocated
GPU memory (accelerate's max_memory charges its weights, not the layers it brings to the GPU to compute).

Default: the default model (SmolLM2-135M) Wanda-pruned to 50% in every decoder Linear (attention and FFN), fp16,
at 30% of the dense model's bytes. --scale: a synthesized OPT-6.7B-shaped checkpoint pruned 50% (bench/
synth_checkpoint.py, shared with the other scale runs) at the same share.

    python -m bench.bench_offload [--json] [--budget 30%] [--tokens 16] [--rounds 3] [--scale [--scale-layers 8]]
                                  [--modes ...] [--device cuda --device-budget 30%] [--slots 1|2|1,2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

from bench.common import arg_parser, device_name, emit, error_fields, median_rows, run_limited_child, stacked_token_bars
from bench.e2e_common import RESULTS, prompt_ids
from bench.e2e_decode import _decode, _load, timed_decode

from flashllm_ext.errors import FormatError
from flashllm_ext.io.paths import resolve_cache_dir

MODES = ("accelerate", "dense", "endor", "endor+more-resident")
DECODERS = ("lean", "transformers")
QUANTIZED_MODES = ("q8", "q4")  # dense mode on the quantized layer store of that dtype; run when asked for
KEYS = (
    "bench",
    "model",
    "mode",
    "device",
    "budget_mb",
    "cgroup_peak_mb",
    "ms_per_token",
    "read_ms",
    "decompress_ms",
    "compute_ms",
    "bytes_read_per_token",
    "layers_in_memory",
    "layers_on_ssd",
)
COLUMNS = [
    "mode",
    "decoder",
    "budget_mb",
    "cgroup_limit_mb",
    "cgroup_peak_mb",
    "oom_killed",
    "ms_per_token",
    "read_ms",
    "hidden_read_ms",
    "decompress_ms",
    "compute_ms",
    "bytes_read_per_token",
    "bytes_moved_per_token",
    "proc_read_mb_per_token",
    "layers_on_device",
    "layers_in_memory",
    "layers_on_ssd",
    "slots",
    "device_peak_mb",
    "error",
]


# ------------------------------------------------------------------------------------------- the child runs


def _accelerate_placement(model) -> tuple[int, int]:
    """(decoder layers accelerate keeps in memory, decoder layers it offloads to disk) from its device map."""
    import re

    placed = {}
    for name, device in model.hf_device_map.items():
        m = re.search(r"layers\.(\d+)", name)
        if m:
            placed.setdefault(int(m.group(1)), set()).add(str(device))
    on_disk = sum(1 for devices in placed.values() if "disk" in devices)
    return len(placed) - on_disk, on_disk


def run_child(config: dict) -> dict:
    """One configuration in this process: load, prefill, decode; the row (without the cgroup facts)."""
    from flashllm_ext.decoder.offload import load_offload_decoder
    from flashllm_ext.offload.api import load_offload

    torch.set_num_threads(config["compute_threads"])  # before any op: every mode computes on the same threads
    mode = config["mode"]
    device = config["device"]
    row = {
        "bench": "offload",
        "model": config["model"],
        "mode": mode,
        "device": device_name(device),
        "budget_mb": config["budget_bytes"] / 1e6,
    }
    lean = mode != "accelerate" and config["decoder"] == "lean"
    row["decoder"] = "transformers" if mode == "accelerate" else config["decoder"]
    try:
        if mode == "accelerate":
            model, reset = _load(config)
        elif lean:
            model = load_offload_decoder(
                config["store"],
                config["budget_bytes"],
                mode="dense" if mode in QUANTIZED_MODES else mode,
                threads=config["threads"],
                layers_in_memory=config.get("layers_in_memory"),
                slots=config["slots"],
                max_len=len(config["prompt_ids"]) + config["tokens"] + 1,
                progress=False,
            )
            reset = model.reset_stats
        else:
            model = load_offload(
                config["store"],
                config["budget_bytes"],
                mode="dense" if mode in QUANTIZED_MODES else mode,
                threads=config["threads"],
                layers_in_memory=config.get("layers_in_memory"),
                device=device,
                device_budget=config.get("device_budget_bytes"),
                layers_on_device=config.get("layers_on_device"),
                slots=config["slots"],
            )
            reset = model.offload.counters.reset
        if lean:
            times, tokens, storage = timed_decode(
                lambda: int(model.prefill(config["prompt_ids"]).argmax()),
                lambda token: int(model.forward([token]).argmax()),
                config["tokens"],
                reset,
            )
        else:  # on CUDA one untimed decode token first: the first one pays first-use costs that would land in the
            # per-token means (an H200 endor row: 1592 ms, then 732-827).
            times, tokens, storage = _decode(
                model,
                torch.tensor([config["prompt_ids"]], device=device),
                config["tokens"],
                reset,
                warmup=1 if device == "cuda" else 0,
            )
    except Exception as e:  # the row says why this configuration could not run
        return {**row, **error_fields(e)}
    row.update(
        ms_per_token=statistics.median(times) * 1e3,
        mean_ms_per_token=statistics.mean(times) * 1e3,
        tokens=len(times),
        token_ms=[round(t * 1e3, 1) for t in times],
        generated=tokens,
        **storage,
    )
    if device == "cuda":  # what each mode held on the GPU at its peak: accelerate's budget leaves its transfers out
        row["device_peak_mb"] = torch.cuda.max_memory_allocated() / 1e6
    if mode == "accelerate":
        in_memory, on_disk = _accelerate_placement(model)
        row.update(
            read_ms=None,
            decompress_ms=None,
            compute_ms=None,
            bytes_read_per_token=None,
            layers_in_memory=in_memory,
            layers_on_ssd=on_disk,
        )
    else:
        runtime = model.runtime if lean else model.offload
        stats = runtime.stats()
        row.update(
            read_ms=stats["read_ms"],
            hidden_read_ms=max(0.0, stats["read_wall_ms"] - stats["read_ms"]),
            decompress_ms=stats["decompress_ms"],
            compute_ms=stats["compute_ms"],
            bytes_read_per_token=stats["bytes_read_per_token"],
            reads_per_token=stats["reads_per_token"],
            mean_read_bytes=stats["bytes_read_per_token"] / max(stats["reads_per_token"], 1),
            layers_in_memory=stats["layers_in_memory"],
            layers_on_ssd=stats["layers_on_ssd"],
            layers_on_device=stats["layers_on_device"],
            read_path=stats["read_path"],
            bytes_moved_per_token=stats["bytes_moved_per_token"],
            accounted_mb=stats["accounted_bytes"] / 1e6,
            staging_mb=stats["staging_bytes"] / 1e6,
            slots=stats["slots"],
        )
        (model if lean else runtime).close()
    return row


# ------------------------------------------------------------------------------------------------- the parent


def plot_offload(medians: list[dict], path: Path) -> None:
    """Per mode (medians): stacked per-token parts (exposed read, decompression, compute; accelerate and failed
    parts: the whole token) against the measured ms/token, and the bytes read from storage per token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in medians if r.get("ms_per_token") is not None]
    if not rows:
        return

    def placement(r: dict) -> str:
        staged = r.get("layers_on_device") is not None and r["layers_on_device"] != r.get("layers_in_memory")
        memory = (
            f"{r['layers_on_device']} on GPU, {r['layers_in_memory'] - r['layers_on_device']} in host"
            if staged
            else f"{r.get('layers_in_memory')} in memory"
        )
        return f"{memory}\n{r.get('layers_on_ssd')} on SSD"

    several_slots = len({r.get("slots") for r in rows if r["mode"] != "accelerate"}) > 1
    several_decoders = len({r.get("decoder") for r in rows if r["mode"] != "accelerate"}) > 1

    def label(r: dict) -> str:
        slots = f" ({r['slots']} slot)" if several_slots and r.get("slots") else ""
        decoder = f", {r['decoder']}" if several_decoders and r["mode"] != "accelerate" else ""
        return f"{r['mode']}{slots}{decoder}\n{placement(r)}"

    labels = [label(r) for r in rows]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(max(9.0, 2.6 * len(rows) + 2), 4.4))
    stacked_token_bars(
        ax,
        labels,
        rows,
        (("read_ms", "read (exposed)"), ("decompress_ms", "decompress"), ("compute_ms", "compute")),
        has_breakdown="read_ms",
        markersize=24,
    )
    read_mb = [
        (r.get("bytes_read_per_token") or 0) / 1e6
        if r.get("bytes_read_per_token") is not None
        else (r.get("proc_read_mb_per_token") or 0.0)
        for r in rows
    ]
    bx.bar(labels, read_mb, color="tab:gray")
    bx.set_ylabel("MB read from storage / token")
    bx.set_title("accelerate: /proc; the others: the reader", fontsize=8)
    fig.suptitle(f"{rows[0]['model']}, budget {rows[0]['budget_mb']:.0f} MB, {rows[0].get('device')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pruned_default(cache: Path, sparsity: float = 0.5, calibration_tokens: int = 512) -> Path:
    """The default model with every decoder Linear Wanda-pruned (fp16) as a Hugging Face directory (accelerate's
    input and the stores' source), written once."""
    from flashllm_ext.demos.endor import decoder_linear_names, wanda_prune
    from flashllm_ext.hub import corpus_token_ids, load_hf_model, replace_weights, save_hf_checkpoint

    path = cache / f"smollm2-135m-wanda{round(sparsity * 100)}-hf"
    if not (path / "config.json").is_file():
        model, tokenizer = load_hf_model()
        ids = corpus_token_ids(tokenizer, "calibration", calibration_tokens)
        replace_weights(model, wanda_prune(model, ids, decoder_linear_names(model), sparsity, torch.float16))
        save_hf_checkpoint(model, tokenizer, path)
    return path


def layer_stores(hf_dir: Path, cache: Path, quantized: list[str]) -> dict[str, Path]:
    """The dense and Endor layer stores of a checkpoint, and those of the `quantized` dtypes, converted once (again
    when a store is of an older format version than this library writes)."""
    from flashllm_ext.offload.store import FORMAT_VERSION, LayerStore
    from flashllm_ext.offload.convert import convert_offload

    stores = {}
    kinds = [("dense", "fp16", False), ("endor", "fp16", True), *((q, q, False) for q in quantized)]
    for kind, dtype, compress in kinds:
        path = cache / f"{hf_dir.name.removesuffix('-hf')}-{kind}"
        try:
            current = LayerStore(path).format_version == FORMAT_VERSION
        except (OSError, FormatError):
            current = False
        if not current:
            print(f"converting {hf_dir} into the {kind} layer store {path} (once)", file=sys.stderr)
            convert_offload(hf_dir, path, dtype=dtype, endor_compress=compress, force=True)
        stores[kind] = path
    return stores


def resident_and_layer_bytes(store_dir: Path) -> tuple[int, int]:
    """(the resident tensors' bytes, every decoder layer's weights dense): what a share budget is a share of."""
    import math

    from flashllm_ext.offload.store import LayerStore
    from flashllm_ext.io.safetensors import DTYPE_SIZES, read_header

    store = LayerStore(store_dir)
    resident = sum(math.prod(t.shape) * DTYPE_SIZES[t.dtype] for t in read_header(store.resident_path).tensors.values())
    return resident, sum(store.dense_bytes(i) for i in range(store.n_layers))


def _child_argv(config: dict) -> list[str]:
    return [sys.executable, "-m", "bench.bench_offload", "--child", json.dumps(config)]  # cwd and env inherited


def probe_child(config: dict) -> dict:
    """What every child holds before its weights: python, torch, transformers, accelerate and flashllm_ext imported,
    and the model's modules built on the meta device (its modeling code imported, its buffers real)."""
    from transformers import AutoConfig

    from flashllm_ext.hub.hf import empty_model

    torch.set_num_threads(config["compute_threads"])
    if config["device"] == "cuda":  # the CUDA context's host memory is every GPU child's too
        torch.zeros(1, device="cuda")
    empty_model(AutoConfig.from_pretrained(config["hf_dir"]).to_dict(), torch.float16, config["hf_dir"])
    return {"probe": True}


def measure_baseline(base: dict, timeout_s: float = 600) -> int | None:
    """The peak of an unlimited probe child's cgroup (probe_child), page cache of what it imports counted; None
    where no cgroup can be made (then no limit is enforced, and every row's cgroup_note says why)."""
    _, facts = run_limited_child(_child_argv({**base, "mode": "probe"}), None, None, "offload-probe", timeout_s)
    if facts["cgroup_peak_mb"] is None:
        print(f"no memory cgroup, so no budget is enforced: {facts['cgroup_note']}", file=sys.stderr)
        return None
    return int(facts["cgroup_peak_mb"] * 1e6)


def decoder_ratios(medians: list[dict]) -> dict:
    """Per mode and slot count: transformers' ms/token over the lean decoder's (> 1: the lean decoder is faster)."""
    by = {(r["mode"], r.get("slots"), r.get("decoder")): r.get("ms_per_token") for r in medians}
    out = {"bench": "offload_decoder_ratios"}
    for (mode, slots, decoder), lean in by.items():
        hf = by.get((mode, slots, "transformers"))
        if decoder == "lean" and lean and hf:
            out[f"{mode}_slots{slots}_lean_vs_transformers"] = hf / lean
    return out


def ratios(medians: list[dict]) -> dict:
    """The targets from the medians: endor vs accelerate and vs dense per token, bytes endor / dense."""
    by = {r["mode"]: r for r in medians}
    out = {"bench": "offload_ratios"}
    for name, (a, b, key) in {
        "endor_vs_accelerate": ("accelerate", "endor", "ms_per_token"),
        "endor_vs_dense": ("dense", "endor", "ms_per_token"),
        "more_resident_vs_accelerate": ("accelerate", "endor+more-resident", "ms_per_token"),
        "more_resident_vs_dense": ("dense", "endor+more-resident", "ms_per_token"),
        "q8_vs_dense": ("dense", "q8", "ms_per_token"),
        "q4_vs_dense": ("dense", "q4", "ms_per_token"),
        "q4_vs_accelerate": ("accelerate", "q4", "ms_per_token"),
    }.items():
        if a in by and b in by:
            out[name] = by[a][key] / by[b][key]
    for mode in ("endor", *QUANTIZED_MODES):
        if "dense" in by and mode in by and by["dense"]["bytes_read_per_token"]:
            out[f"{mode}_bytes_vs_dense"] = by[mode]["bytes_read_per_token"] / by["dense"]["bytes_read_per_token"]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--budget", default="30%", help="DRAM budget: a share of the dense model's bytes, or a size")
    parser.add_argument("--tokens", type=int, default=16, help="greedy decode tokens after the prompt")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--threads", type=int, default=32, help="reader threads")
    parser.add_argument(
        "--compute-threads",
        type=int,
        default=1,
        help="torch / OpenMP threads of every child (1: OpenMP barriers on a shared, oversubscribed "
        "machine cost 10-50x on these small matrices)",
    )
    parser.add_argument("--scale", action="store_true", help="the synthesized OPT-6.7B-shaped pruned checkpoint")
    parser.add_argument(
        "--scale-layers",
        type=int,
        default=None,
        help="with --scale (or --smoke): a checkpoint of that many layers (written once to the "
        "cache), not the shared 32-layer one: a shorter run, e.g. on a lent GPU",
    )
    parser.add_argument("--hf-dir", help="a pruned Hugging Face checkpoint to run instead")
    parser.add_argument("--child-timeout", type=float, default=1800)
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: layers in GPU memory by --device-budget, then host memory by --budget (as stored, "
        "moved and decompressed on the GPU), then SSD read into GPU memory; accelerate gets the "
        "same two budgets",
    )
    parser.add_argument("--device-budget", default="30%", help="GPU memory for --device cuda, as --budget")
    parser.add_argument(
        "--slots",
        default=None,
        help="buffers moved layers are fetched into (load_offload slots=): 2 overlap the next "
        "fetch with compute, 1 leaves a layer's room more; '1,2': every mode with each, "
        "interleaved (default: the library's, 1 on cuda and 2 on cpu)",
    )
    parser.add_argument(
        "--decoder",
        help="what computes the offloaded layers: lean (load_offload_decoder; the CPU's default), transformers "
        "(load_offload's model; on cuda always), or lean,transformers: every mode with each, interleaved",
    )
    parser.add_argument("--no-plot", action="store_true", help="no figure")
    parser.add_argument("--figure", help="the figure's path (default bench/results/bench_offload[_scale][_cuda].png)")
    parser.set_defaults(rounds=3)
    args = parser.parse_args(argv)
    if args.child:
        config = json.loads(args.child)
        print(json.dumps(probe_child(config) if config["mode"] == "probe" else run_child(config)), flush=True)
        return
    if args.smoke:  # the synthesized checkpoint at its smoke shapes
        args.tokens, args.prompt_tokens, args.rounds, args.no_plot = 2, 4, 1, True
    from flashllm_ext.runtime import parse_budget

    cache = resolve_cache_dir() / "offload"
    cache.mkdir(exist_ok=True)
    if args.hf_dir:
        hf_dir, name = Path(args.hf_dir), Path(args.hf_dir).name
    elif args.scale or args.smoke:
        from bench.synth_checkpoint import shared_checkpoint

        hf_dir = shared_checkpoint("opt-6.7b", layers=args.scale_layers, smoke=args.smoke)
        name = (
            ("OPT-6.7B family, smoke shapes" if args.smoke else "OPT-6.7B shapes")
            + (f", {args.scale_layers} layers" if args.scale_layers else "")
            + " (synthesized, 50% pruned)"
        )
    else:
        hf_dir, name = pruned_default(cache), "SmolLM2-135M-Instruct (Wanda 50%, attention + FFN)"
    decoders = (args.decoder or ("transformers" if args.device == "cuda" else "lean")).split(",")
    if any(d not in DECODERS for d in decoders) or len(set(decoders)) != len(decoders):
        parser.error(f"--decoder: one or both of {', '.join(DECODERS)}, got {args.decoder!r}")
    if "lean" in decoders and args.device == "cuda":
        parser.error("--decoder lean runs on the CPU; on cuda the offloaded layers run in transformers' model")
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in (*MODES, *QUANTIZED_MODES)]
    if unknown:
        parser.error(f"--modes: unknown {unknown} (known: {', '.join((*MODES, *QUANTIZED_MODES))})")
    stores = layer_stores(hf_dir, cache, [m for m in modes if m in QUANTIZED_MODES])
    from flashllm_ext.offload.store import LayerStore
    from flashllm_ext.offload.placement import default_slots, plan_placement
    from flashllm_ext.flash.reader import host_bounce_bytes, select_read_path

    resident, layers = resident_and_layer_bytes(stores["dense"])
    total = resident + layers
    budget = parse_budget(args.budget, total)
    # endor runs on dense's placement (the same placement): with smaller staging buffers the budget may
    # hold one more dense layer, which would credit Endor with more than its reads.
    cuda = args.device == "cuda"
    device_budget = parse_budget(args.device_budget, total, "device_budget") if cuda else None
    args.slots = args.slots or str(default_slots(torch.device(args.device)))
    slot_counts = [int(s) for s in args.slots.split(",") if s.strip().isdigit()]
    if len(slot_counts) != len(args.slots.split(",")) or any(s not in (1, 2) for s in slot_counts):
        parser.error(f"--slots must be 1, 2 or 1,2, got {args.slots!r}")
    try:
        dense = {
            slots: plan_placement(
                LayerStore(stores["dense"]),
                "dense",
                budget if cuda else budget - resident,
                device_layer_budget=device_budget - resident if cuda else None,
                separate=cuda,
                bounce=partial(host_bounce_bytes, select_read_path("cuda"), threads=args.threads) if cuda else None,
                slots=slots,
            )
            for slots in slot_counts
        }
    except ValueError as e:
        raise SystemExit(
            f"bench_offload: --budget {args.budget} ({budget} bytes) does not fit dense offload of {name}: {e}"
        ) from None
    from transformers import AutoConfig

    ids, prompt_note = prompt_ids(
        args.prompt_tokens, AutoConfig.from_pretrained(hf_dir).vocab_size, synthesized=args.scale or args.smoke
    )
    base = {
        "model": name,
        "tokens": args.tokens,
        "prompt_ids": ids,
        "budget_bytes": budget,
        "threads": args.threads,
        "compute_threads": args.compute_threads,
        "device": args.device,
        "device_budget_bytes": device_budget,
        "slots": slot_counts[0],
        "max_memory": {"0": device_budget, "cpu": budget} if cuda else None,
        "hf_dir": str(hf_dir),
        "offload_dir": str(cache / f"accelerate-{hf_dir.name}"),
    }
    baseline = measure_baseline(base)
    jobs = [  # accelerate has no slots and is its own decoder
        (m, s, d)
        for m in modes
        for s in ([None] if m == "accelerate" else slot_counts)
        for d in (["transformers"] if m == "accelerate" else decoders)
    ]
    rows = []
    for round_index, (mode, slots, decoder) in [(r, j) for r in range(args.rounds) for j in jobs]:  # round-robin
        placement = dense.get(slots)
        config = {
            **base,
            "mode": mode,
            "decoder": decoder,
            "store": str(stores[mode if mode in ("dense", *QUANTIZED_MODES) else "endor"]),
            "slots": slots or slot_counts[0],
            "layers_in_memory": placement.in_memory if mode == "endor" else None,
            "layers_on_device": placement.on_device if mode == "endor" and cuda else None,
        }
        child_rows, facts = run_limited_child(
            _child_argv(config), budget, baseline, f"offload-{mode}", args.child_timeout
        )
        row = {
            "bench": "offload",
            "model": name,
            "mode": mode,
            "decoder": decoder,
            "budget_mb": budget / 1e6,
            **(child_rows[0] if child_rows else {"error": "the child printed no row"}),
            **facts,
        }
        if len(child_rows) > 1 and not row.get("error"):
            row["error"] = child_rows[-1].get("error")
        row.update(
            round=round_index,
            budget_spec=args.budget,
            model_mb=total / 1e6,
            baseline_mb=None if baseline is None else baseline / 1e6,
            prompt_tokens=len(ids),
            prompt_note=prompt_note,
        )
        row = {**{k: row.get(k) for k in KEYS}, **row}
        rows.append(row)
        emit([row], args.json, COLUMNS)
    medians = median_rows(rows, ("mode", "slots", "decoder"), "offload_median")
    for row in medians:  # the modes' greedy tokens should agree (same pruned weights; fp16 rounding may differ)
        row["same_tokens_as_dense"] = row.get("generated") == next(
            (m.get("generated") for m in medians if m["mode"] == "dense"), None
        )
    if not args.json:
        print(f"\nmedians over {args.rounds} round(s):")
    emit(medians, args.json, COLUMNS)
    ratio_rows = [
        {
            **ratios([m for m in medians if m["mode"] == "accelerate" or (m.get("slots"), m.get("decoder")) == key]),
            "slots": key[0],
            "decoder": key[1],
        }
        for key in [(s, d) for s in slot_counts for d in decoders]
    ]
    if len(decoders) > 1:
        ratio_rows.append(decoder_ratios(medians))
    emit(ratio_rows, args.json)
    if not args.no_plot:
        path = Path(
            args.figure or RESULTS / f"bench_offload{'_scale' if args.scale else ''}{'_cuda' if cuda else ''}.png"
        )
        plot_offload(medians, path)
        print(f"figure: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
