"""Mixture-of-experts models beyond memory: the lean decoder's expert modes on synthesized MoE checkpoints with real
shapes, each configuration a process of its own in a memory cgroup of its baseline + the budget (page cache dropped
first, counted against the limit).

Checkpoints (bench/synth_checkpoint.py, random weights, written once; say so beside every figure): OLMoE-1B-7B
(64 experts of 1024 neurons, 8 a token, d 2048; first 4 layers, fp16) and Qwen3-30B-A3B (128 experts of 768, 8 a
token; first 2 layers, q4), or --layers / --format for every model (a layer's experts are its own: reads, hits and
compute per layer are those of the whole model's layers), converted once to an expert store (flashllm convert; the
checkpoint is then deleted). The budget is of the whole model's weight bytes (e2e_common.budget_of_first_layers: the
layers run with the share of a whole model's budget).

Routing (--routing): "model", the checkpoint's own routers on its random weights (what they choose is no trained
model's: measured, they return to few experts, see experts_used_per_layer); "trace", a replayed synthetic trace (TraceRoutes: expert popularity Zipf with
exponent TRACE["skew"], each of a token's experts kept from the previous token's set with probability
TRACE["reuse"]), which is no real model's and says only how the cache policies meet skew and reuse.

Peer: llama.cpp (llama-cpp-python, mmap, no repacking, --threads) on a GGUF of the same weights (write_moe_gguf: F16,
or for a quantized store its experts in Q8_0 / Q4_0 blocks, the file the store is converted from), in a cgroup
of its own baseline + the same budget, with its own (the model's) routers: rows mode "llama.cpp", routing "model";
`agree`: the share of our greedy tokens equal to llama.cpp's in the same round.

Modes: naive (a token's experts read every time, nothing kept), flash:<policy> (flashllm_ext.flash.experts, an
ExpertCache per layer within the budget: lru, lfu, window), +ahead (each layer reads the experts the next layer's
router picks for its hidden state while it computes: load_decoder(lookahead="ahead")); accelerate, the peer a
`transformers` user picks (the checkpoint, kept for it, with device_map="auto", max_memory = the budget and the
rest offloaded to disk; its own routers: routing "model" only), in a cgroup of its own baseline (transformers,
accelerate and the model's modeling code imported) + the budget.

Rows (bench:"moe", one per configuration and round; bench:"moe_median" the medians over --rounds, round-robin):
  ms_per_token            median decode token after a --prompt-tokens prompt
  io_ms mem_ms compute_ms router_ms other_ms   the token's parts (other: attention, norms, LM head, Python)
  read_mb_per_token reads_per_token mean_read_kib hit_rate experts_read_per_layer   deterministic counts
  experts_used_per_layer  distinct experts a layer's router chose over the prompt and the decode tokens
  hidden_io_ms ahead_recall   +ahead: read time that overlapped compute; the guessed share of the needed experts
  vs_naive                ms_per_token / naive's at the same model, budget and routing (medians)
  vs_llama_cpp            ms_per_token / llama.cpp's at the same model and budget (model routing)
  cgroup_limit_mb cgroup_peak_mb oom_killed

    python -m bench.bench_moe [--json] [--models olmoe-1b-7b,qwen3-30b-a3b] [--layers N] [--budgets 30%,50%]
                              [--modes naive,flash:lru,flash:lfu,flash:window] [--routing model,trace]
                              [--format fp16|q8|q4] [--tokens 16] [--rounds 3] [--threads 2] [--no-llama-cpp] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from bench.common import arg_parser, emit, median_rows

MODULE = "bench.bench_moe"
# each shape's default first layers and store format: Qwen3-30B-A3B in 4 bits (as its users hold it; two of its
# layers in fp16 with their checkpoint and GGUF would not fit this machine's free disk)
MODELS = {"olmoe-1b-7b": (4, "fp16"), "qwen3-30b-a3b": (2, "q4")}
MODES = ("naive", "flash:lru", "flash:lfu", "flash:window", "flash:lru+ahead", "accelerate")
TRACE = {"skew": 1.0, "reuse": 0.5, "seed": 0}
WINDOW = 2  # flash:window's tokens
COLUMNS = [
    "model",
    "routing",
    "budget_spec",
    "mode",
    "ms_per_token",
    "vs_naive",
    "vs_llama_cpp",
    "agree",
    "io_ms",
    "compute_ms",
    "other_ms",
    "read_mb_per_token",
    "mean_read_kib",
    "hit_rate",
    "experts_read_per_layer",
    "experts_used_per_layer",
    "ahead_recall",
    "hidden_io_ms",
    "cgroup_peak_mb",
    "error",
]


class TraceRoutes:
    """The replayed trace's routers, one per layer: route(x [T, d]) -> the next T tokens' experts [T, k] (weights
    1/k each). Each token keeps each expert of the previous token's set with probability `reuse`; the rest are
    drawn without repeats from a Zipf popularity of exponent `skew` over a fixed random order of the experts."""

    def __init__(self, n_layers: int, n_experts: int, top_k: int, skew: float, reuse: float, seed: int):
        self.generator = torch.Generator().manual_seed(seed)
        rank = torch.arange(1, n_experts + 1, dtype=torch.float64)
        self.popularity = [(rank**-skew)[torch.randperm(n_experts, generator=self.generator)] for _ in range(n_layers)]
        self.top_k, self.reuse = top_k, reuse
        self.previous: list[torch.Tensor | None] = [None] * n_layers

    def _token(self, layer: int) -> torch.Tensor:
        weights = self.popularity[layer].clone()
        kept = torch.empty(0, dtype=torch.int64)
        previous = self.previous[layer]
        if previous is not None:
            kept = previous[torch.rand(self.top_k, generator=self.generator) < self.reuse]
            weights[kept] = 0
        experts = kept
        if kept.numel() < self.top_k:
            drawn = torch.multinomial(weights, self.top_k - kept.numel(), generator=self.generator)
            experts = torch.cat((kept, drawn))
        self.previous[layer] = experts
        return experts

    def route(self, layer: int):
        def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            experts = torch.stack([self._token(layer) for _ in range(x.shape[0])])
            return experts, torch.full(experts.shape, 1.0 / self.top_k)

        return route


def run_child(config: dict) -> dict:
    """One configuration in this process (a child): load within the budget, decode, the row. The probe stops after
    the imports every child makes (its baseline)."""
    import statistics
    import time

    from flashllm_ext.decoder import load_decoder

    if config["mode"] == "accelerate":
        return run_accelerate(config)
    if config.get("probe"):
        return {}
    mode, _, policy = config["mode"].partition(":")
    policy, _, ahead = policy.partition("+")
    prompt, tokens = config["prompt"], config["tokens"]
    decoder = load_decoder(
        config["store"],
        config["budget_bytes"],
        mode=mode,
        expert_policy=policy or "lru",
        window=WINDOW,
        max_len=len(prompt) + tokens,
        lookahead=ahead or None,
    )
    if config["routing"] == "trace":
        c = decoder.config
        trace = TraceRoutes(c.n_layers, c.n_experts, c.top_k, **TRACE)
        for layer, module in enumerate(decoder.runtime.modules):
            module.route = trace.route(layer)
    token = int(decoder.prefill(prompt).argmax())
    decoder.reset_stats()
    times = []
    ids = [token]
    for _ in range(tokens):
        start = time.perf_counter()
        token = int(decoder.forward([token]).argmax())
        times.append(time.perf_counter() - start)
        ids.append(token)
    stats = decoder.stats()
    used = [sum(n > 0 for n in module.cache.uses) for module in decoder.runtime.modules]
    decoder.close()
    return {
        "ms_per_token": statistics.median(times) * 1e3,
        "io_ms": stats["io_ms"],
        "mem_ms": stats["mem_ms"],
        "compute_ms": stats["compute_ms"],
        "router_ms": stats["predictor_ms"],
        "other_ms": stats["other_ms"],
        "read_mb_per_token": stats["bytes_per_token"] / 1e6,
        "reads_per_token": stats["reads_per_token"],
        "mean_read_kib": stats["mean_read_bytes"] / 1024,
        "hit_rate": stats["hit_rate"],
        "experts_read_per_layer": stats["experts_read_per_layer"],
        "experts_used_per_layer": sum(used) / len(used),
        "hidden_io_ms": stats["hidden_io_ms"],
        "ahead_recall": stats["ahead_recall"],
        "accounted_mb": stats["accounted_bytes"] / 1e6,
        "ids": ids,
    }


def run_accelerate(config: dict) -> dict:
    """The accelerate peer in this process: the checkpoint config["hf_dir"] loaded with device_map="auto" within the
    budget (the rest offloaded to disk), greedy decoding with its own routers. The probe stops after the imports
    (transformers, accelerate and the model's modeling code)."""
    from transformers import AutoConfig

    from bench.e2e_decode import run_child as run_hf
    from flashllm_ext.hub.hf import empty_model

    if config.get("probe"):  # the modeling code imported and the modules built on the meta device, as bench_offload's
        empty_model(AutoConfig.from_pretrained(config["hf_dir"]).to_dict(), torch.float16, config["hf_dir"])
        return {}
    row = run_hf(
        {
            "model": Path(config["hf_dir"]).name,
            "mode": "accelerate",
            "budget_bytes": config["budget_bytes"],
            "prompt_ids": config["prompt"],
            "tokens": config["tokens"],
            "hf_dir": config["hf_dir"],
            "offload_dir": config["offload_dir"],
        }
    )
    if "error" in row:
        return {"error": row["error"]}
    return {
        "ms_per_token": row["ms_per_token"],
        "read_mb_per_token": row["proc_read_mb_per_token"],
        "ids": row["generated"],
    }


# the store format -> the blocks of the experts in llama.cpp's GGUF (None: F16), from which a quantized store converts
GGUF_EXPERTS = {"fp16": None, "q8": "q8_0", "q4": "q4_0"}


def model_files(
    name: str, layers: int, fmt: str, smoke: bool, gguf: bool, checkpoint: bool = False
) -> tuple[Path, Path | None, Path | None]:
    """The expert store of `name`'s first `layers` layers, (gguf) llama.cpp's GGUF of the same weights and
    (checkpoint) the synthesized Hugging Face checkpoint they are written from (accelerate's input): each written once,
    the checkpoint deleted afterwards unless asked for (a whole model's would not fit this machine's disk beside its
    store and GGUF; the same seed writes the same weights again). A quantized store is converted from the GGUF,
    whose experts are in GGUF_EXPERTS[fmt] blocks (the rest F16), as a user converts the file they hold: it keeps the
    GGUF's up and gate blocks (down is requantized along the hidden dimension, store.tensor_sources)."""
    from bench.e2e_common import converted_once
    from bench.synth_checkpoint import shared_checkpoint, shared_checkpoint_path, write_moe_gguf
    from flashllm_ext.errors import FormatError
    from flashllm_ext.flash.store import FlashStore

    keep, checkpoint = checkpoint, shared_checkpoint_path(name, layers=layers, smoke=smoke)
    stem, experts = checkpoint.name.removesuffix("-hf"), GGUF_EXPERTS[fmt]
    gguf = gguf or experts is not None
    store = checkpoint.with_name(f"{stem}-{fmt}-store")
    gguf_path = checkpoint.with_name(f"{stem}.{'F16' if experts is None else experts.upper() + '-experts'}.gguf")
    try:
        FlashStore(store).close()
        missing_store = False
    except (OSError, FormatError):
        missing_store = True
    if missing_store or (gguf and not gguf_path.is_file()) or keep:
        source = shared_checkpoint(name, layers=layers, smoke=smoke)  # the same seed: the same weights again
        if gguf and not gguf_path.is_file():
            write_moe_gguf(source, gguf_path, expert_type=experts)
        if missing_store:
            converted_once(source if experts is None else gguf_path, store, fmt)
    if not keep and checkpoint.exists():  # (one kept by an earlier run for accelerate)
        shutil.rmtree(checkpoint)
    return store, gguf_path if gguf else None, checkpoint if keep else None


def run_llama(gguf: Path, limit: int, prompt: list[int], tokens: int, threads: int, timeout: float) -> dict:
    """llama.cpp (mmap, no repacking: the weights stay in the file's pages) on the GGUF in a cgroup of `limit` bytes:
    its row."""
    from flashllm_ext.harness.llama_cpp import run_llama_cpp

    r = run_llama_cpp(gguf, prompt, tokens, threads, memory_limit_bytes=limit, timeout=timeout)
    error = "OOM-killed" if r.get("oom_killed") else r.get("error")
    keys = ("ms_per_token", "cgroup_limit_mb", "cgroup_peak_mb", "oom_killed")
    return {
        **{k: r.get(k) for k in keys},
        "read_mb_per_token": r.get("proc_read_mb_per_token"),
        "ids": r.get("generated"),
        **({"error": str(error).strip().splitlines()[-1][-300:]} if error else {}),
    }


def add_ratios(medians: list[dict]) -> None:
    """vs_naive and vs_llama_cpp: ms_per_token over naive's / llama.cpp's at the same model, budget (and routing)."""
    for row in medians:
        same = [r for r in medians if r["model"] == row["model"] and r["budget_spec"] == row["budget_spec"]]
        naive = [r["ms_per_token"] for r in same if r["mode"] == "naive" and r["routing"] == row["routing"]]
        peer = [r["ms_per_token"] for r in same if r["mode"] == "llama.cpp"]
        if naive and row.get("ms_per_token"):
            row["vs_naive"] = row["ms_per_token"] / naive[0]
        if peer and row.get("ms_per_token") and row["routing"] == "model":
            row["vs_llama_cpp"] = row["ms_per_token"] / peer[0]


def main(argv: list[str] | None = None) -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--models", default=",".join(MODELS), help="among " + ",".join(MODELS))
    parser.add_argument("--layers", type=int, help="the first that many decoder layers of each model (MODELS)")
    parser.add_argument("--budgets", default="30%,50%", help="shares of the whole model's weight bytes")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--routing", default="model,trace", help="model (its own routers) and/or trace (TRACE)")
    parser.add_argument("--format", choices=["fp16", "q8", "q4"], help="the expert store's format (MODELS)")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (ours: torch's default)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp (it builds once, minutes)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a process may run")
    parser.set_defaults(rounds=3)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))), flush=True)
        return
    if args.smoke:
        args.models, args.layers, args.budgets, args.rounds = "olmoe-1b-7b", 2, "60%", 1
        args.tokens, args.prompt_tokens, args.no_llama_cpp = 3, 4, True
        print("smoke: llama.cpp skipped (it needs its own build)", file=sys.stderr)
    llama_cpp = not args.no_llama_cpp and "model" in args.routing.split(",")

    from bench.e2e_common import budget_of_first_layers, child_argv, probe_peak_bytes, prompt_ids
    from bench.synth_checkpoint import CONFIGS
    from flashllm_ext.flash.store import FlashStore
    from flashllm_ext.harness.cgroup import run_limited_child

    baselines = {}
    if llama_cpp:
        from flashllm_ext.harness.llama_cpp import WORKER, env_python, ensure_env

        argv_probe = [str(env_python(ensure_env())), "-I", str(WORKER), "--baseline"]
        baselines["llama.cpp"] = probe_peak_bytes(argv_probe, "llama-probe")
    rows = []
    for name in args.models.split(","):
        layers, fmt = args.layers or MODELS[name][0], args.format or MODELS[name][1]
        accelerate = "accelerate" in args.modes.split(",") and "model" in args.routing.split(",")
        store, gguf, hf_dir = model_files(name, layers, fmt, args.smoke, llama_cpp, checkpoint=accelerate)
        peer = llama_cpp and gguf is not None
        with FlashStore(store) as opened:
            prompt, note = prompt_ids(args.prompt_tokens, int(opened.config["vocab_size"]), synthesized=True)
        whole = CONFIGS[name]["num_hidden_layers"]
        budgets = [(spec, budget_of_first_layers(store, spec, whole)) for spec in args.budgets.split(",")]
        base = {"store": str(store), "prompt": prompt, "tokens": args.tokens}
        baselines["lean"] = probe_peak_bytes(child_argv(MODULE, {**base, "probe": True}), "moe-probe")
        if accelerate:
            base.update(hf_dir=str(hf_dir), offload_dir=str(hf_dir.with_name(f"{hf_dir.name}-accelerate-offload")))
            probe = {**base, "mode": "accelerate", "probe": True}
            baselines["accelerate"] = probe_peak_bytes(child_argv(MODULE, probe), "moe-accelerate-probe")
        # a replayed trace has no hidden state for a read-ahead to route (+ahead), nor has accelerate's model: both
        # run on the model's own routers
        configurations = [
            (spec, budget, routing, mode)
            for spec, budget in budgets
            for routing in args.routing.split(",")
            for mode in args.modes.split(",")
            if not (routing == "trace" and (mode.endswith("+ahead") or mode == "accelerate"))
        ]
        if peer:  # llama.cpp routes with the model's own routers: one row per budget, first (the reference ids)
            configurations = [(spec, budget, "model", "llama.cpp") for spec, budget in budgets] + configurations
        for round_ in range(args.rounds):
            reference: dict[str, list[int]] = {}
            for spec, budget, routing, mode in configurations:
                system = mode if mode in ("llama.cpp", "accelerate") else "lean"
                limit = baselines[system] + budget
                if system == "llama.cpp":
                    out = run_llama(gguf, limit, prompt, args.tokens, args.threads, args.timeout)
                else:
                    config = {**base, "mode": mode, "routing": routing, "budget_bytes": budget}
                    child, facts = run_limited_child(child_argv(MODULE, config), limit, 0, f"moe-{mode}", args.timeout)
                    out = {**(child[-1] if child else {"error": "the child printed no row"}), **facts}
                    if "error" in out:  # a refused budget ends the child with a traceback: its last line says why
                        out["error"] = out["error"].strip().splitlines()[-1][-300:]
                    if facts["oom_killed"]:
                        out["error"] = "OOM-killed"
                ids = out.pop("ids", None)
                if system == "llama.cpp" and ids:
                    reference[spec] = ids
                elif ids and routing == "model" and reference.get(spec):  # the same weights: the same greedy tokens?
                    agree = next((i for i, (a, b) in enumerate(zip(ids, reference[spec])) if a != b), len(ids))
                    out["agree"] = agree / len(ids)
                row = {
                    "bench": "moe",
                    "model": name,
                    "checkpoint": f"{store.name}: synthesized weights, the first {layers} of {whole} layers",
                    "routing": routing,
                    "budget_spec": spec,
                    "budget_mb": budget / 1e6,
                    "baseline_mb": baselines[system] / 1e6,
                    "mode": mode,
                    "tokens": args.tokens,
                    "round": round_,
                    **({"prompt_note": note} if note else {}),
                    **out,
                }
                rows.append(row)
                emit([row], args.json, COLUMNS)
        if accelerate:  # what accelerate wrote of the offloaded weights (GBs at real shapes): rewritten by each load
            shutil.rmtree(base["offload_dir"], ignore_errors=True)
    medians = median_rows(rows, ("model", "routing", "budget_spec", "mode"), "moe_median")
    add_ratios(medians)
    emit(medians, args.json, COLUMNS)


if __name__ == "__main__":
    main()
