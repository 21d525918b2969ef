"""`make demo`: prune the default model's FFN to 50% with Wanda, compress it with Endor, and measure it.

Steps: fetch SmolLM2-135M-Instruct (GGUF), load it with `transformers`, collect every FFN Linear's inputs on a
few hundred calibration tokens, Wanda-prune gate/up/down of all layers (fp16), compress with Endor, save the
compressed FFN and load it back, then print sizes, decompression throughput against memcpy and the held-out
perplexity of the dense model vs the model with the pruned weights (read back from the file) swapped in.

Calibration is one-shot: every layer's inputs come from the dense model (Wanda's reference code feeds each
layer the output of the already pruned layers before it).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from flashllm_ext import endor
from flashllm_ext.ops.bits import BITS_VIEW
from flashllm_ext.harness.report import print_table
from flashllm_ext.harness.timing import time_interleaved
from flashllm_ext.hub import (
    FFN_KINDS,
    collect_linear_inputs,
    corpus_token_ids,
    fetch_default,
    ffn_linear_names,
    load_hf_model,
    perplexity,
    replace_weights,
    resolve_cache_dir,
)


def wanda_prune_ffn(
    model: torch.nn.Module,
    calibration_ids: torch.Tensor,
    sparsity: float = 0.5,
    dtype: torch.dtype = torch.float16,
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Wanda-pruned copies (cast to `dtype`) of every FFN weight, keyed by parameter name `...mlp.*_proj.weight`.

    calibration_ids: int64 [T]; each Linear's Wanda score uses its inputs over these T tokens.
    """
    return wanda_prune(
        model, calibration_ids, ffn_linear_names(model.config.num_hidden_layers), sparsity, dtype, progress
    )


def decoder_linear_names(model: torch.nn.Module) -> list[str]:
    """Module names of every Linear inside the decoder layers (attention and FFN), in module order."""
    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in name]


def wanda_prune(
    model: torch.nn.Module,
    calibration_ids: torch.Tensor,
    names: list[str],
    sparsity: float = 0.5,
    dtype: torch.dtype = torch.float16,
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Wanda-pruned copies (cast to `dtype`) of the weights of the Linear modules `names`, keyed `<name>.weight`
    (one-shot: every input comes from the dense model)."""
    inputs = collect_linear_inputs(model, calibration_ids, names)
    pruned = {}
    for name in tqdm(names, desc=f"wanda {sparsity:.0%}", disable=not progress):
        weight = model.get_submodule(name).weight.detach().to(dtype)
        pruned[f"{name}.weight"] = endor.prune(weight, sparsity, method="wanda", activations=inputs.pop(name))
    return pruned


def _native_cpu_kernel() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("flashllm::endor_decompress", "CPU")


def _size_rows(compressed: dict[str, endor.EndorTensor], per_matrix: bool) -> list[dict]:
    groups: dict[str, list[endor.EndorTensor]] = {}
    for name, t in compressed.items():
        key = name if per_matrix else next(k for k in FFN_KINDS if f".{k}." in name)
        groups.setdefault(key, []).append(t)
    rows = []
    for key, ts in groups.items():
        dense = sum(t.dense_nbytes for t in ts)
        comp = sum(t.nbytes for t in ts)
        density = sum(t.values.numel() for t in ts) / sum(t.shape[0] * t.shape[1] for t in ts)
        rows.append(
            {
                "matrix" if per_matrix else "kind": key,
                "count": len(ts),
                "shape": "x".join(map(str, ts[0].shape)),
                "dense_bytes": dense,
                "endor_bytes": comp,
                "ratio": comp / dense,
                "density": density,
            }
        )
    return rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m flashllm_ext.demos.endor", description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", help="default: $FLASHLLM_CACHE or ~/.cache/flashllm_ext")
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--calibration-tokens", type=int, default=512)
    parser.add_argument("--window", type=int, default=512, help="perplexity window (tokens)")
    parser.add_argument("--windows", type=int, default=4, help="number of held-out perplexity windows")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds for the throughput medians")
    parser.add_argument("--per-matrix", action="store_true", help="one size row per matrix instead of per kind")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    gguf_path = fetch_default(args.cache_dir)
    print(f"model: {gguf_path}")
    model, tokenizer = load_hf_model(gguf_path)
    run(model, tokenizer, args)


def run(model: torch.nn.Module, tokenizer, args: argparse.Namespace) -> None:
    """The demo on an already loaded `transformers` model; leaves the pruned FFN weights in `model`."""
    calibration = corpus_token_ids(tokenizer, "calibration", args.calibration_tokens)
    heldout = corpus_token_ids(tokenizer, "heldout")
    print(f"text: pydoc topics, {calibration.numel()} calibration tokens, {args.windows}x{args.window} held-out tokens")

    pruned = wanda_prune_ffn(model, calibration, args.sparsity)
    compressed = {name: endor.compress(w) for name, w in tqdm(pruned.items(), desc="endor compress")}

    store = resolve_cache_dir(args.cache_dir) / f"smollm2-135m-ffn-wanda{round(args.sparsity * 100)}.endor.safetensors"
    endor.save(store, compressed)
    loaded = endor.load(store)
    restored = {name: loaded[name].decompress() for name in compressed}
    if set(loaded) != set(compressed) or not all(
        torch.equal(restored[n].view(BITS_VIEW[restored[n].dtype]), pruned[n].view(BITS_VIEW[pruned[n].dtype]))
        for n in pruned
    ):
        raise RuntimeError(f"{store}: Endor save/load round trip changed the pruned weights")
    print(
        f"saved and reloaded {len(loaded)} Endor tensors: {store} ({store.stat().st_size / 2**20:.1f} MiB), "
        "bitwise equal to the pruned weights"
    )

    print()
    rows = _size_rows(compressed, args.per_matrix)
    print_table(rows)
    dense_total, comp_total = sum(r["dense_bytes"] for r in rows), sum(r["endor_bytes"] for r in rows)
    print(
        f"total: {dense_total / 2**20:.1f} MiB fp16 dense -> {comp_total / 2**20:.1f} MiB Endor, "
        f"ratio {comp_total / dense_total:.3f} (compressed / dense)"
    )

    # Both sides write the same preallocated buffers, so neither pays page faults inside the timed region.
    sources = list(loaded.values())
    dense = [restored[n] for n in loaded]
    outs = [torch.empty_like(d) for d in dense]

    def decompress_all() -> None:
        for src, out in zip(sources, outs):
            src.decompress(out=out)

    def memcpy_all() -> None:
        for src, out in zip(dense, outs):
            out.copy_(src)

    medians = time_interleaved({"decompress": decompress_all, "memcpy": memcpy_all}, rounds=args.repeats)
    t_dec, t_copy = medians["decompress"], medians["memcpy"]
    kernel = "native CPU kernel" if _native_cpu_kernel() else "pure-torch reference kernel (no native CPU kernel)"
    print(
        f"\ndecompress all FFN matrices ({dense_total / 1e6:.1f} MB dense fp16 output, {kernel}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}):"
    )
    print_table(
        [
            {"op": "endor_decompress", "median_ms": t_dec * 1e3, "GB/s": dense_total / t_dec / 1e9},
            {"op": "memcpy (out.copy_)", "median_ms": t_copy * 1e3, "GB/s": dense_total / t_copy / 1e9},
        ]
    )
    print(f"decompress / memcpy throughput: {t_copy / t_dec:.3f}")

    ppl_dense = perplexity(model, heldout, args.window, args.windows)
    replace_weights(model, restored)
    ppl_pruned = perplexity(model, heldout, args.window, args.windows)
    print(f"\nheld-out perplexity ({args.windows}x{args.window} tokens, transformers on the same GGUF):")
    print_table(
        [
            {"model": "dense (fp32 dequantized Q4_1)", "perplexity": ppl_dense},
            {"model": f"FFN Wanda {args.sparsity:.0%} (fp16, from the Endor file)", "perplexity": ppl_pruned},
        ]
    )


if __name__ == "__main__":
    main()
