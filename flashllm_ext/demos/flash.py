"""`make demo`, part 1: generate text with the default model while its FFN weights stay on flash.

Steps (each cached in the cache dir after the first run): convert SmolLM2-135M-Instruct (GGUF, Q4_1) into a flash
store per format of --formats (fp16; q4: the file's Q4_1 blocks of up and gate kept bit for bit, down in Q8_0, the
resident tensors fp16); build the default neuron predictors (flashllm_ext.predictor.DEFAULT_RECIPE) into each store,
again whenever the store's were built by another recipe; then generate the same greedy continuation of one prompt in
each engine mode of --modes (dense, naive, hybrid and flash by default) on the lean decoder (flashllm_ext.decoder), per
format, with the same DRAM budget in bytes (--budget of the fp16 store's model), each mode in its own
process inside a memory cgroup of that
process's baseline + the DRAM budget (page cache counted, dropped first: flashllm_ext/harness/cgroup.py; dense, the reference,
has no limit). Prints the text, the decode time per token with its I/O / memory-management / predictor / compute
breakdown, bytes and reads per token, the cache hit rate, the cgroup's limit and peak, and how many tokens equal
`transformers`' own greedy output (the GGUF model in fp32; the stores round it, so a late tie can differ).

    python -m flashllm_ext.demos.flash [--budget 60%] [--tokens 64] [--window 5] [--prompt TEXT] [--modes ...]
                                       [--formats fp16,q4]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from flashllm_ext.flash.convert import convert
from flashllm_ext.harness.cgroup import run_limited_child
from flashllm_ext.decoder import LeanDecoder, load_decoder
from flashllm_ext.runtime import parse_budget
from flashllm_ext.errors import FormatError
from flashllm_ext.hub import corpus_token_ids, fetch_default, load_hf_model, resolve_cache_dir, spread_windows
from flashllm_ext.predictor import (
    DEFAULT_RECIPE,
    build_predictors,
    load_predictors,
    predictors_recipe,
    save_predictors_to_store,
)
from flashllm_ext.harness.report import print_table
from flashllm_ext.flash.store import FlashStore


COLUMNS = [
    "format",
    "mode",
    "ms/token",
    "io ms",
    "mem ms",
    "predictor ms",
    "ffn compute ms",
    "MB read/token",
    "reads/token",
    "hit rate",
    "budget MB",
    "accounted MB",
    "cgroup limit MB",
    "peak MB",
    "OOM",
    "tokens = transformers",
    "s (with load)",
]


def prepare_store(gguf: Path, cache_dir: Path, dtype: str = "fp16") -> Path:
    """The default model's flash store in `dtype` (convert's) with the default predictors (DEFAULT_RECIPE), each
    built once: the predictors again whenever the store's were built by another recipe (a quantized store takes the
    fp16 store's, built from the same GGUF model)."""
    store_dir = cache_dir / f"{gguf.stem}.store-{dtype}"
    try:
        FlashStore(store_dir).close()
    except FormatError:  # no store yet, or one in an older format: (re)convert
        print(f"converting {gguf.name} into a {dtype} flash store at {store_dir}")
        convert(gguf, store_dir, dtype=dtype, force=True)
    if predictors_recipe(store_dir) != DEFAULT_RECIPE and dtype != "fp16":  # the same model's: the fp16 store's
        save_predictors_to_store(load_predictors(prepare_store(gguf, cache_dir)), store_dir, DEFAULT_RECIPE)
    if predictors_recipe(store_dir) != DEFAULT_RECIPE:  # none yet, or another recipe's (an older default)
        print(f"building the default neuron predictors ({DEFAULT_RECIPE}) into {store_dir}")
        model, tokenizer = load_hf_model(gguf)
        ids = spread_windows(corpus_token_ids(tokenizer, "calibration"), 4, 512)
        save_predictors_to_store(build_predictors(model, ids, window=512), store_dir, DEFAULT_RECIPE)
    return store_dir


def greedy_decode(decoder: LeanDecoder, prompt: list[int], n_tokens: int) -> tuple[list[int], float]:
    """(n_tokens generated ids, decode seconds per token) of a fresh sequence. The decoder's stats are reset after
    the prompt, so decoder.stats() then covers the decode tokens only."""
    decoder.reset()
    token = int(decoder.prefill(prompt).argmax())
    decoder.reset_stats()
    generated = [token]
    start = time.perf_counter()
    for _ in range(n_tokens - 1):
        token = int(decoder.forward([token]).argmax())
        generated.append(token)
    return generated, (time.perf_counter() - start) / max(1, n_tokens - 1)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # 60%: the least round share at which flash mode runs on this 135M model. Its resident tensors take 41% and the
    # predictors 9%, and the decoder's KV cache is charged too, so half the weight bytes (the paper's setting) leaves
    # the FFNs less than one bundle per layer. At 60% one cache shared by the layers reads each token's set of ~690
    # neurons in parts with no hits; 85% is the least budget whose per-layer caches hold a token's set
    # (docs/benchmarks/bench_e2e.md, "Default model: budgets and the shared cache").
    parser.add_argument("--budget", default="60%", help="DRAM budget: bytes, a share of the model, or a size")
    parser.add_argument("--tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--window", type=int, default=5, help="flash: the neuron cache's window in tokens")
    parser.add_argument("--prompt", default="The three primary colors are")
    parser.add_argument("--modes", default="dense,naive,hybrid,flash")
    parser.add_argument("--formats", default="fp16,q4", help="store formats (convert --dtype) to run the modes on")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one mode, in this process (the parent's JSON)
    return parser.parse_args(argv)


def run_mode(config: dict) -> dict:
    """One mode in this process (a child): load from the store, decode, and the row the parent prints."""
    if config["mode"] == "probe":  # what every child holds before loading: its imports
        return {}
    decoder = load_decoder(
        config["store"],
        config["budget_bytes"],
        mode=config["mode"],
        window=config["window"],
        max_len=len(config["prompt"]) + config["tokens"],
    )
    ids, seconds = greedy_decode(decoder, config["prompt"], config["tokens"])
    row = {"ids": ids, "ms/token": seconds * 1e3}
    if decoder.runtime is not None:
        s = decoder.stats()
        row.update(
            {
                "io ms": s["io_ms"],
                "mem ms": s["mem_ms"],
                "predictor ms": s["predictor_ms"],
                "ffn compute ms": s["compute_ms"],
                "MB read/token": s["bytes_per_token"] / 1e6,
                "reads/token": s["reads_per_token"],
                "hit rate": s["hit_rate"],
                "budget MB": None if s["budget_bytes"] is None else s["budget_bytes"] / 1e6,
                "accounted MB": s["accounted_bytes"] / 1e6,
            }
        )
    decoder.close()
    return row


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(run_mode(json.loads(args.child))), flush=True)
        return
    from transformers import AutoTokenizer

    gguf = fetch_default()
    stores = {dtype: prepare_store(gguf, resolve_cache_dir(), dtype) for dtype in args.formats.split(",")}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    prompt = tokenizer(args.prompt, return_tensors="pt").input_ids
    reference, _ = load_hf_model(gguf)
    with torch.inference_mode():
        expected = reference.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)[
            0, prompt.shape[1] :
        ]
    del reference
    # "60%" is of what the decoder counts of the fp16 store's model: every format gets the same bytes.
    sizing = load_decoder(prepare_store(gguf, resolve_cache_dir()), None, mode="naive", max_len=1)
    total = sizing.model_bytes
    sizing.close()
    del sizing
    base = {"prompt": prompt[0].tolist(), "tokens": args.tokens, "window": args.window}

    def child(config: dict, budget: int | None) -> tuple[list[dict], dict]:
        argv = [sys.executable, "-m", "flashllm_ext.demos.flash", "--child", json.dumps(config)]
        return run_limited_child(argv, budget, baseline, f"demo-{config['mode']}")

    baseline = None  # the probe runs unlimited: its peak is every child's baseline
    _, probe = child({**base, "mode": "probe"}, None)
    baseline = None if probe["cgroup_peak_mb"] is None else int(probe["cgroup_peak_mb"] * 1e6)
    print(
        f"\nprompt: {args.prompt!r} ({prompt.shape[1]} tokens), {args.tokens} greedy tokens, budget {args.budget} "
        f"({parse_budget(args.budget, total) / 1e6:.1f} MB of {total / 1e6:.1f} MB), window {args.window}, "
        f"{torch.get_num_threads()} CPU threads; each mode in a memory cgroup of its baseline "
        f"({'none: ' + str(probe['cgroup_note']) if baseline is None else f'{baseline / 1e6:.0f} MB'}) + budget\n"
    )
    rows = []
    for (dtype, store_dir), mode in itertools.product(stores.items(), args.modes.split(",")):
        budget = None if mode == "dense" else parse_budget(args.budget, total)
        start = time.perf_counter()
        out, facts = child({**base, "store": str(store_dir), "mode": mode, "budget_bytes": budget}, budget)
        row = {"format": dtype, "mode": mode, **(out[0] if out else {"error": "the child printed no row"})}
        if "error" in row:
            print(f"[{dtype} {mode}] failed: {row['error']}")
            continue
        ids = torch.tensor(row.pop("ids"))
        same = int((ids == expected).long().cumprod(0).sum())  # leading tokens equal to transformers'
        print(f"[{dtype} {mode}] {args.prompt}{tokenizer.decode(ids)}")
        rows.append(
            {
                **row,
                "cgroup limit MB": facts["cgroup_limit_mb"],
                "peak MB": facts["cgroup_peak_mb"],
                "OOM": facts["oom_killed"],
                "tokens = transformers": f"{same}/{args.tokens}",
                "s (with load)": time.perf_counter() - start,
            }
        )
    print()
    print_table(rows, [c for c in COLUMNS if any(c in row for row in rows)])
    print(
        "\nOne sequential run of each mode on a shared machine: compare modes within a run, and repeat it; "
        "bench/bench_e2e.py interleaves rounds and takes medians."
    )


if __name__ == "__main__":
    main()
