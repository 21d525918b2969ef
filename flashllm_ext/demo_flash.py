"""`make demo`, part 1: generate text with the default model while its FFN weights stay on flash.

Steps (each cached in the cache dir after the first run): convert SmolLM2-135M-Instruct (GGUF) into an fp16 flash
store; build its neuron predictors (the default method of flashllm_ext.predictor) into the store; then
generate the same greedy continuation of one prompt in every engine mode, each model built from the store by
`load_flash` within the same DRAM budget (dense, the reference, holds everything), and print the text, the decode
time per token with its I/O / memory-management / predictor / compute breakdown, bytes read per token and the
cache hit rate. The budget here is what the engine accounts; bench/bench_e2e.py enforces it with a cgroup.

    python -m flashllm_ext.demo_flash [--budget 65%] [--tokens 32] [--prompt TEXT]
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .convert import convert
from .engine import load_flash
from .errors import FormatError
from .models import corpus_token_ids, fetch_default, load_hf_model, resolve_cache_dir, spread_windows
from .predictor import DEFAULT_DENSITY, DEFAULT_METHOD, build_predictors, load_predictors, save_predictors_to_store
from .report import print_table
from .store import FlashStore



def prepare_store(gguf: Path, cache_dir: Path) -> Path:
    """The default model's fp16 flash store with predictors, built once."""
    store_dir = cache_dir / f"{gguf.stem}.store-fp16"
    try:
        FlashStore(store_dir).close()
    except FormatError:  # no store yet, or one in an older format: (re)convert
        print(f"converting {gguf.name} into a flash store at {store_dir}")
        convert(gguf, store_dir, dtype="fp16", force=True)
    try:
        load_predictors(store_dir)
    except Exception:  # noqa: BLE001  (no predictors yet, or from an older format: train them)
        print(f"building {DEFAULT_METHOD} neuron predictors (loaded density {DEFAULT_DENSITY}) into {store_dir}")
        model, tokenizer = load_hf_model(gguf)
        ids = spread_windows(corpus_token_ids(tokenizer, "calibration"), 4, 512)
        save_predictors_to_store(build_predictors(model, ids, window=512), store_dir)
    return store_dir


@torch.inference_mode()
def greedy_decode(model: torch.nn.Module, prompt: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, float]:
    """(generated ids [n_tokens], decode seconds per token). The engine's stats are reset after the prompt, so
    model.flash_stats() then covers the decode tokens only."""
    out = model(prompt, use_cache=True)
    past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    if getattr(model, "flash", None) is not None:
        model.flash.stats.reset()
    generated = [token]
    start = time.perf_counter()
    for _ in range(n_tokens - 1):
        out = model(token, past_key_values=past, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        generated.append(token)
    return torch.cat(generated, dim=1)[0], (time.perf_counter() - start) / max(1, n_tokens - 1)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", default="65%", help="DRAM budget: bytes, a share of the model, or a size")
    parser.add_argument("--tokens", type=int, default=32, help="tokens to generate")
    parser.add_argument("--prompt", default="The three primary colors are")
    parser.add_argument("--modes", default="dense,naive,hybrid,flash")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    from transformers import AutoTokenizer

    args = parse_args(argv)
    gguf = fetch_default()
    store_dir = prepare_store(gguf, resolve_cache_dir())
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    prompt = tokenizer(args.prompt, return_tensors="pt").input_ids
    print(f"\nprompt: {args.prompt!r} ({prompt.shape[1]} tokens), {args.tokens} greedy tokens, budget {args.budget}, "
          f"{torch.get_num_threads()} CPU threads\n")
    rows, reference = [], None
    for mode in args.modes.split(","):
        model = load_flash(store_dir, dram_budget=None if mode == "dense" else args.budget, mode=mode)
        ids, seconds = greedy_decode(model, prompt, args.tokens)
        reference = ids if reference is None else reference
        print(f"[{mode}] {args.prompt}{tokenizer.decode(ids)}")
        row = {"mode": mode, "ms/token": seconds * 1e3, "same tokens as dense": bool(torch.equal(ids, reference))}
        if model.flash is not None:
            s = model.flash_stats()
            row.update({"budget MB": s["budget_bytes"] / 1e6, "held MB": s["accounted_bytes"] / 1e6,
                        "io ms": s["io_ms"], "mem ms": s["mem_ms"], "predictor ms": s["predictor_ms"],
                        "ffn compute ms": s["compute_ms"], "MB read/token": s["bytes_per_token"] / 1e6,
                        "hit rate": s["hit_rate"]})
            model.flash.close()
        rows.append(row)
        del model
    print()
    print_table(rows, list(dict.fromkeys(key for row in rows for key in row)))
    print("\nTimes are one sequential run each on a shared machine; bench/bench_e2e.py interleaves, repeats and "
          "enforces the budget with a cgroup.")


if __name__ == "__main__":
    main()
