"""Store formats of the default model (SmolLM2-135M, a Q4_1 GGUF): what each costs in bytes and in accuracy.

Per format (`flashllm convert --dtype`): the bundle bytes per neuron and per layer, the resident bytes (in the store,
and as load_flash's model holds them), held-out perplexity with every neuron computed through the store's own kernel
(exact mode: quantized_sparse_ffn over a quantized store's bundles and quantized_linear over its resident blocks, x
rounded to int8 per block; sparse_ffn and float linears over a float store's) against the GGUF's own
perplexity under `transformers` (its blocks dequantized to fp32), the perplexity of the store's weights alone
(dequantized into that `transformers` model: what the format costs without the kernels' rounding of x), and how
many of `--tokens` greedy tokens equal
`transformers`' before the first difference. The q4 stores keep the GGUF's Q4_1 blocks of up and gate bit for bit;
down is requantized along the hidden dimension in the format named. Rows named "gptq" round the FFN rows and attention
projections the store quantizes by GPTQ against their inputs on calibration text (`flashllm convert --rounding
gptq`), the others to nearest. Rows "from fp16 safetensors" convert the same weights as a Hugging Face checkpoint would hold them (the
GGUF's values in fp16, written once under --store-dir): nothing is kept, every weight is quantized.

    python -m bench.bench_formats [--json] [--windows N] [--window W] [--tokens N] [--store-dir DIR] [--format NAME ...]
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from bench.common import arg_parser, emit
from flashllm_ext.flash.convert import convert
from flashllm_ext.flash.engine import load_flash, resident_bytes_of
from flashllm_ext.flash.store import FlashStore
from flashllm_ext.hub import corpus_token_ids, fetch_default
from flashllm_ext.hub.hf import load_hf_model, replace_weights, save_hf_checkpoint
from flashllm_ext.hub.text import perplexity

# name -> convert's arguments (FROM_SAFETENSORS: of the fp16 Hugging Face checkpoint, not the GGUF)
FROM_SAFETENSORS = "from fp16 safetensors"
FORMATS = {
    "fp16": {"dtype": "fp16"},
    "q8": {"dtype": "q8"},
    "q4, down q8_0": {"dtype": "q4", "down_format": "q8_0"},
    "q4, down q4_1": {"dtype": "q4", "down_format": "q4_1"},
    "q4, down q4_0": {"dtype": "q4", "down_format": "q4_0"},
    "q8, gptq": {"dtype": "q8", "rounding": "gptq"},
    "q4, gptq": {"dtype": "q4", "down_format": "q8_0", "rounding": "gptq"},
    "q4, down q4_1, gptq": {"dtype": "q4", "down_format": "q4_1", "rounding": "gptq"},
    f"q4 {FROM_SAFETENSORS}": {"dtype": "q4"},
    f"q4 {FROM_SAFETENSORS}, gptq": {"dtype": "q4", "rounding": "gptq"},
}


def store_for(name: str, gguf: Path, store_dir: Path, reference, tokenizer) -> FlashStore:
    """The default model converted to format `name` (kept under store_dir between runs), from the GGUF or from its
    fp16 Hugging Face checkpoint (`reference` and `tokenizer` written under store_dir, once)."""
    path = store_dir / name.replace(", ", "-").replace(" ", "-")
    try:
        return FlashStore(path)
    except (OSError, ValueError):
        checkpoint = gguf
        if FROM_SAFETENSORS in name:
            checkpoint = store_dir / "hf-fp16"
            if not (checkpoint / "config.json").is_file():
                save_hf_checkpoint(reference, tokenizer, checkpoint)
        convert(checkpoint, path, force=path.exists(), progress=False, **FORMATS[name])
        return FlashStore(path)


def weights_of(store: FlashStore, reference) -> dict[str, torch.Tensor]:
    """The store's weights dequantized, by `reference`'s parameter names: its resident tensors and every FFN
    layer's matrices."""
    params = dict(reference.named_parameters(remove_duplicate=False))
    named = {n: store.resident_tensor(n) for n in store.resident_names()}
    for layer in range(store.n_layers):
        named.update(store.ffn_weights(layer))
    return {key: t for n, t in named.items() for key in (n, f"model.{n}") if key in params}


def greedy_agreement(model, reference: list[int], prompt: torch.Tensor) -> int:
    """Tokens of `reference` (greedy continuation of prompt) model's greedy continuation repeats before it differs."""
    out = model.generate(prompt.unsqueeze(0), max_new_tokens=len(reference), do_sample=False)[0, prompt.numel() :]
    same = 0
    for a, b in zip(out.tolist(), reference):
        if a != b:
            break
        same += 1
    return same


def main() -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=8, help="held-out windows for perplexity")
    parser.add_argument("--window", type=int, default=256, help="tokens per window")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens compared with transformers")
    parser.add_argument("--store-dir", type=Path, default=Path.home() / ".cache" / "flashllm_ext" / "bench-formats")
    parser.add_argument(
        "--format",
        action="append",
        choices=list(FORMATS),
        metavar="NAME",
        help=f"a format to measure, repeated for more (default: all of {list(FORMATS)})",
    )
    args = parser.parse_args()
    names = args.format or list(FORMATS)
    if args.smoke:
        args.windows, args.window, args.tokens = 1, 32, 4
    gguf = fetch_default()
    reference, tokenizer = load_hf_model(gguf)
    ids = corpus_token_ids(tokenizer, "heldout", max_tokens=args.window * args.windows)
    prompt = ids[: min(64, ids.numel())]
    with torch.inference_mode():
        want = reference.generate(prompt.unsqueeze(0), max_new_tokens=args.tokens, do_sample=False)[0, prompt.numel() :]
    ppl_gguf = perplexity(reference, ids, args.window, args.windows, progress=False)
    rows = []
    for name in names[:2] if args.smoke else names:
        store = store_for(name, gguf, args.store_dir, reference, tokenizer)
        with store:
            neuron_bytes = store.row_bytes
            resident_bytes = store.resident_nbytes()
            bundle_format = store.bundle_format.name if store.quantized else store.dtype_name
            twin = copy.deepcopy(reference)  # the store's weights alone: transformers on them, x as it is
            replace_weights(twin, weights_of(store, reference))
        with torch.inference_mode():
            ppl_weights = perplexity(twin, ids, args.window, args.windows, progress=False)
        del twin
        model = load_flash(store.path, None, mode="exact")
        held = resident_bytes_of(model)  # what the loaded model holds of them (a quantized store's: as blocks)
        try:
            with torch.inference_mode():
                ppl = perplexity(model, ids, args.window, args.windows, progress=False)
                same = greedy_agreement(model, want.tolist(), prompt)
        finally:
            model.flash.close()
        rows.append(
            {
                "bench": "formats",
                "format": name,
                "bundle_format": bundle_format,
                "bytes_per_neuron": neuron_bytes,
                "ffn_mb": store.n_layers * store.n_neurons * neuron_bytes / 1e6,
                "resident_mb": resident_bytes / 1e6,
                "held_resident_mb": held / 1e6,
                "ppl": ppl,
                "ppl_vs_gguf": ppl / ppl_gguf,
                "weights_ppl_vs_gguf": ppl_weights / ppl_gguf,
                "ppl_gguf": ppl_gguf,
                "greedy_same": same,
                "greedy_tokens": args.tokens,
                "heldout_tokens": args.window * args.windows,
            }
        )
    fp16 = next((r["ppl"] for r in rows if r["format"] == "fp16"), None)
    for row in rows:
        row["ppl_vs_fp16"] = row["ppl"] / fp16 if fp16 else None
    emit(
        rows,
        args.json,
        [
            "format",
            "bundle_format",
            "bytes_per_neuron",
            "ffn_mb",
            "resident_mb",
            "held_resident_mb",
            "ppl",
            "ppl_vs_fp16",
            "ppl_vs_gguf",
            "weights_ppl_vs_gguf",
        ]
        + ["greedy_same", "greedy_tokens"],
    )


if __name__ == "__main__":
    main()
