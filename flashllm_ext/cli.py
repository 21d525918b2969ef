"""`flashllm` command line: one subcommand per offline task.

  flashllm convert CHECKPOINT OUT_DIR [--dtype fp16|bf16|fp32|q8|q4] [--down-format q8_0|q4_0|q4_1] [--endor] [--force]
  flashllm calibrate-disk [--dir DIR] [--size-mib N]
  flashllm train-predictors CHECKPOINT [--store DIR] [--method M] [--density D] [--rank R] ...
  flashllm run STORE_DIR --tokenizer PATH [--prompt TEXT] [--chat] [--mode flash] [--budget 50%] [--tokens N]
               [--temperature T --top-k K --top-p P --repeat-penalty R --seed S] [--stop TEXT] [--hf]
               [--device cpu|cuda]
  flashllm offload STORE_DIR --convert CHECKPOINT [--endor] | --tokenizer PATH [--mode endor] [--budget 30%]
                   [--device cuda --device-budget 20%] ...

Each subcommand registers itself with `add_parser` functions below; main() only dispatches. A user's mistake ends
any of them with one line on stderr and a non-zero status, before the long work where it can be known then.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

WINDOW = 512  # tokens per forward pass while calibrating and capturing
INTERRUPTED = 130  # the shell's status for a command ended by SIGINT


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (argparse prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _convert(args: argparse.Namespace) -> int:
    from flashllm_ext.flash.convert import convert, describe_sources
    from flashllm_ext.flash.store import FlashStore

    out = convert(
        args.checkpoint,
        args.out_dir,
        dtype=args.dtype,
        endor=args.endor,
        force=args.force,
        down_format=args.down_format,
    )
    store = FlashStore(out)
    print(store)
    if store.tensor_sources is not None:
        print(f"FFN tensors: {describe_sources(store.tensor_sources)}")
    return 0


def _calibrate_disk(args: argparse.Namespace) -> int:
    from flashllm_ext.flash.calibrate import calibrate_disk
    from flashllm_ext.io.disk import disk_profile_path

    profile = calibrate_disk(args.dir, size=args.size_mib << 20)
    print(
        f"latency {profile.latency_s * 1e6:.0f} us, bandwidth {profile.bandwidth_bps / 1e6:.0f} MB/s, "
        f"coalescing gap {profile.max_gap_bytes(1) >> 10} KiB at 1 thread, {profile.max_gap_bytes(32) >> 10} KiB "
        f"at 32 -> {disk_profile_path()}"
    )
    return 0


def _ranks(text: str) -> int | list[int]:
    ranks = [int(r) for r in text.split(",")]
    if any(r <= 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"ranks must be positive, got {text!r}")
    return ranks[0] if len(ranks) == 1 else ranks


def _group_size(text: str) -> int | str | None:
    if text in ("row", "auto"):
        return None if text == "row" else text
    if not text.isdigit() or int(text) <= 0 or int(text) % 64:
        raise argparse.ArgumentTypeError(f"group size must be 'row', 'auto' or a positive multiple of 64, got {text!r}")
    return int(text)


def _train_predictors(args: argparse.Namespace) -> int:
    from flashllm_ext.hub import corpus_token_ids, fetch_default, load_hf_model, resolve_cache_dir, spread_windows
    from flashllm_ext.predictor import (
        DEFAULT_DENSITY,
        build_predictors,
        default_rounding,
        predictors_recipe_of,
        save_predictors,
        save_predictors_to_store,
        train_predictors,
    )

    gguf_path = fetch_default() if args.source == "default" else Path(args.source)
    if not gguf_path.is_file():
        raise SystemExit(
            f"flashllm train-predictors: {gguf_path} is not a GGUF file (for a store, pass the "
            "checkpoint it was converted from and --store DIR)"
        )
    # Fail before minutes of training, not after.
    if args.store:
        from flashllm_ext.flash.store import FlashStore

        FlashStore(args.store)
    from flashllm_ext.io.checkpoint import gguf_config

    gguf_config(gguf_path)
    out = Path(args.out) if args.out else resolve_cache_dir() / f"{gguf_path.stem}.predictors.safetensors"
    if out.is_dir():
        out = out / "predictors.safetensors"
    model, tokenizer = load_hf_model(gguf_path)
    token_ids = spread_windows(corpus_token_ids(tokenizer, "calibration"), -(-args.tokens // WINDOW), WINDOW)
    recall = None if args.recall <= 0 else args.recall
    density = args.density or DEFAULT_DENSITY
    if args.method == "lowrank" and (args.density is None or args.top_k is not None):  # the classic operating point
        predictors = train_predictors(
            model, token_ids, args.target_sparsity, args.rank, args.epochs, recall, args.top_k, window=WINDOW
        )
        density = None
    else:
        predictors = build_predictors(
            model,
            token_ids,
            args.method,
            density=density,
            target_sparsity=args.target_sparsity,
            rank=args.rank,
            epochs=args.epochs,
            recall=recall,
            gate_bits=args.gate_bits,
            up_bits=args.up_bits,
            rounding=args.rounding,
            group_size=args.group_size,
            allocation=args.allocation,
            base=args.base_method,
            block=args.block,
            window=WINDOW,
        )
    if args.store:  # with the recipe, so a cache of the default ones (DEFAULT_RECIPE) knows these are them
        rounding = default_rounding(args.method) if args.rounding is None else args.rounding
        recipe = predictors_recipe_of(
            args.method, density, args.gate_bits, args.up_bits, rounding, args.allocation, args.group_size
        )
        out = save_predictors_to_store(predictors, args.store, recipe)
    else:
        save_predictors(predictors, out)
    config = {k: v for k, v in predictors.config().items() if k not in ("method", "n_layers", "ranks")}
    if "ranks" in predictors.config():
        config["ranks"] = sorted(set(predictors.config()["ranks"]))
    print(
        f"wrote {predictors.n_layers} {predictors.method} predictors ({config}, "
        f"{predictors.memory_bytes / 1e6:.1f} MB, {token_ids.numel()} calibration tokens) to {out}"
    )
    return 0


def _add_convert(sub: argparse._SubParsersAction) -> None:
    from flashllm_ext.flash.convert import DEFAULT_DOWN_FORMAT, QUANTIZED_DTYPES
    from flashllm_ext.flash.store import DTYPES
    from flashllm_ext.ops.blocks import BLOCK_FORMATS

    p = sub.add_parser("convert", help="convert a HF safetensors dir or GGUF file into a flash store")
    p.add_argument("checkpoint", help="Hugging Face model directory (safetensors, sharded or not) or .gguf file")
    p.add_argument("out_dir", help="store directory to create")
    p.add_argument(
        "--dtype",
        choices=(*DTYPES, *QUANTIZED_DTYPES),
        default="fp16",
        help="fp16, bf16, fp32: float bundles. q8: GGUF's Q8_0 blocks (8.5 bits a weight) for the up/gate rows; "
        "q4: Q4_0 blocks (4.5 bits; Q4_1 from a GGUF whose up/gate tensors are Q4_1); with either, the down rows "
        "in --down-format. A GGUF's up/gate blocks already in that format are kept bit for bit, the other FFN "
        "weights quantized by round to nearest; a quantized store's other tensors are fp16 (default: fp16)",
    )
    p.add_argument(
        "--down-format",
        choices=tuple(BLOCK_FORMATS),
        help=f"with --dtype q8 or q4: the block format of the down rows (default {DEFAULT_DOWN_FORMAT})",
    )
    p.add_argument("--endor", action="store_true", help="Endor-compress the bundles (pruned models; float dtypes)")
    p.add_argument("--force", action="store_true", help="replace the flash store at out_dir if there is one")
    p.set_defaults(func=_convert)


def _add_calibrate_disk(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate-disk", help="measure latency and bandwidth for the reader's coalescing model")
    p.add_argument("--dir", default=".", help="a directory on the disk that will hold the stores")
    p.add_argument("--size-mib", type=_positive_int, default=1024, help="size of the temporary test file")
    p.set_defaults(func=_calibrate_disk)


def _add_train_predictors(sub: argparse._SubParsersAction) -> None:
    from flashllm_ext.predictor import (
        DEFAULT_DENSITY,
        DEFAULT_GATE_BITS,
        DEFAULT_GROUP_SIZE,
        DEFAULT_METHOD,
        DEFAULT_ROUNDING,
        DEFAULT_UP_BITS,
        PREDICTOR_METHODS,
    )
    from flashllm_ext.predictor.allocation import ALLOCATIONS
    from flashllm_ext.predictor.quant import BITS, ROUNDINGS

    train = sub.add_parser("train-predictors", help="build per-layer neuron predictors of one method")
    train.add_argument(
        "source", metavar="CHECKPOINT", help="a Llama GGUF checkpoint, or 'default' for the embedded default model"
    )
    train.add_argument(
        "--out", help="output file, or a directory to write predictors.safetensors into (default: the cache dir)"
    )
    train.add_argument(
        "--store",
        help="write the predictors into this flash store's resident file instead "
        "(a store converted from the same checkpoint)",
    )
    train.add_argument(
        "--method",
        choices=sorted(PREDICTOR_METHODS),
        default=DEFAULT_METHOD,
        help=f"predictor method (default {DEFAULT_METHOD} {DEFAULT_GATE_BITS}/{DEFAULT_UP_BITS} bits at "
        f'density {DEFAULT_DENSITY}: BENCHMARKS.md, "Predictors")',
    )
    train.add_argument(
        "--density",
        type=float,
        default=None,
        help=f"target loaded density per layer, calibrated on the calibration text (default "
        f"{DEFAULT_DENSITY}; lowrank without it: the recall operating point)",
    )
    train.add_argument(
        "--gate-bits",
        type=int,
        choices=BITS,
        default=DEFAULT_GATE_BITS,
        help=f"quant: bits per W_gate weight (default {DEFAULT_GATE_BITS})",
    )
    train.add_argument(
        "--up-bits",
        type=int,
        choices=BITS,
        default=DEFAULT_UP_BITS,
        help=f"quant: bits per W_up weight (default {DEFAULT_UP_BITS})",
    )
    train.add_argument(
        "--rounding",
        choices=ROUNDINGS,
        default=None,
        help=f"quant: codes rounded to the nearest level, or by GPTQ against the calibration inputs "
        f'(same format and speed, closer scores: BENCHMARKS.md, "Predictors"; default '
        f"{DEFAULT_ROUNDING})",
    )
    train.add_argument(
        "--group-size",
        type=_group_size,
        default=DEFAULT_GROUP_SIZE,
        help="quant: columns per scale (a multiple of 64 dividing the hidden size), 'row' for one "
        f"scale per row, or 'auto': the least such multiple >= 192 (default {DEFAULT_GROUP_SIZE}: "
        'BENCHMARKS.md, "Predictors")',
    )
    train.add_argument(
        "--allocation",
        choices=ALLOCATIONS,
        default="uniform",
        help="spread --density over the layers: the same everywhere, or by a greedy search on the "
        "calibration loss (empirical Fisher; the mean stays --density)",
    )
    train.add_argument("--base-method", default="quant", help="context: the method that scores the neurons")
    train.add_argument("--block", type=_positive_int, default=16, help="context: decoded tokens per neuron set")
    train.add_argument(
        "--rank",
        type=_ranks,
        default=None,
        help="lowrank / lowrank-reg: one rank, or one per layer (comma separated); default: from "
        "each layer's density (lowrank), 96 (lowrank-reg)",
    )
    train.add_argument(
        "--target-sparsity",
        type=float,
        default=0.7,
        help="lowrank: the rule's threshold sparsity of the active sets it learns",
    )
    train.add_argument(
        "--tokens",
        type=_positive_int,
        default=4096,
        help=f"calibration tokens (rounded up to windows of {WINDOW} spread over the calibration text)",
    )
    train.add_argument("--epochs", type=_positive_int, default=10)
    train.add_argument(
        "--recall",
        type=float,
        default=0.95,
        help="per-layer probability threshold chosen for this recall (<= 0: fixed 0.5)",
    )
    train.add_argument(
        "--top-k", type=_positive_int, default=None, help="predict the k most likely neurons per token instead"
    )
    train.set_defaults(func=_train_predictors)


def _check_tokenizer(args: argparse.Namespace) -> None:
    """Refuse a --tokenizer that does not exist before the model loads (transformers would say so only after)."""
    if not Path(args.tokenizer).exists():
        raise FileNotFoundError(f"--tokenizer {args.tokenizer} does not exist")


def _load_tokenizer(path: Path, n_embeddings: int):
    """The transformers tokenizer of a .gguf file or a Hugging Face directory, refused (ValueError) when it cannot be
    loaded or has more tokens than the model has embeddings (_check_vocabulary)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging

    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # its warnings about the model config are noise here: only the tokenizer is used
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent if kwargs else path, local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as e:  # transformers' ways of saying there is none
        raise ValueError(f"--tokenizer {path}: no tokenizer loads from it ({type(e).__name__}: {e})") from None
    finally:
        logging.set_verbosity(verbosity)
    _check_vocabulary(path, len(tokenizer), n_embeddings)
    return tokenizer


def _check_vocabulary(path: Path, n_tokens: int, n_embeddings: int) -> None:
    """Refuse a tokenizer with more tokens than the model has embeddings: a tokenizer of another model, whose ids
    index past the embedding or name other tokens."""
    if n_tokens > n_embeddings:
        raise ValueError(
            f"--tokenizer {path} has {n_tokens} tokens, the model {n_embeddings} embeddings: "
            "the tokenizer of another model?"
        )


def _generate(args: argparse.Namespace, model, stats) -> int:
    """Greedy (or sampled) text from `model` for `flashllm run` / `flashllm offload`; prints `stats()` if given."""
    import time

    import torch

    tokenizer = _load_tokenizer(Path(args.tokenizer), model.get_input_embeddings().num_embeddings)
    device = model.get_input_embeddings().weight.device
    prompt = tokenizer(args.prompt, return_tensors="pt").input_ids.to(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            prompt, max_new_tokens=args.tokens, do_sample=args.sample, pad_token_id=tokenizer.eos_token_id
        )
    seconds = time.perf_counter() - start
    print(tokenizer.decode(out[0], skip_special_tokens=True))
    print(
        f"\n{out.shape[1] - prompt.shape[1]} tokens in {seconds:.2f} s ({args.mode} on {device}, prompt "
        f"{prompt.shape[1]} tokens)"
    )
    if stats is not None:
        print(", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in stats().items()))
    return 0


def _sampling(args: argparse.Namespace):
    from flashllm_ext.decoder.generate import Sampling

    temperature = args.temperature if args.temperature is not None else (1.0 if args.sample else 0.0)
    return Sampling(temperature, args.top_k, args.top_p, args.repeat_penalty, args.seed)


def _run(args: argparse.Namespace) -> int:
    if args.hf:
        return _run_transformers(args)
    import time

    from flashllm_ext.decoder import load_decoder
    from flashllm_ext.decoder.generate import TextStream, generate
    from flashllm_ext.flash.engine import check_lookahead
    from flashllm_ext.flash.store import FlashStore
    from flashllm_ext.hub.tokenizer import load_tokenizer
    from flashllm_ext.runtime import cuda_device

    sampling = _sampling(args)
    cuda_device(args.device)  # the mistakes that need no file first
    check_lookahead(args.mode, args.lookahead, "auto")
    _check_tokenizer(args)
    tokenizer = load_tokenizer(args.tokenizer)
    with FlashStore(args.store) as store:
        _check_vocabulary(args.tokenizer, len(tokenizer), int(store.config["vocab_size"]))
    text = tokenizer.chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    prompt = tokenizer.encode(text, add_special_tokens=not args.chat)  # a chat template writes its own
    decoder = load_decoder(
        args.store,
        None if args.mode == "dense" else args.budget,
        mode=args.mode,
        window=args.window,
        device=args.device,
        lookahead=args.lookahead,
        max_len=len(prompt) + args.tokens,
    )
    stream = TextStream(tokenizer.decode, args.stop)

    def show(token: int) -> bool:
        piece, stop = stream.push(token)
        print(piece, end="", flush=True)
        return stop

    if not args.chat:
        print(args.prompt, end="", flush=True)
    start = time.perf_counter()
    new = generate(decoder, prompt, args.tokens, sampling=sampling, stop_ids=tokenizer.eos_ids, on_token=show)
    seconds = time.perf_counter() - start
    print(f"\n\n{len(new)} tokens in {seconds:.2f} s ({args.mode} on {args.device}, prompt {len(prompt)} tokens)")
    stats = decoder.stats()
    print(", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in stats.items()))
    decoder.close()
    return 0


def _run_transformers(args: argparse.Namespace) -> int:
    from flashllm_ext.flash.engine import load_flash
    from flashllm_ext.runtime import cuda_device

    device = cuda_device(args.device)
    _check_tokenizer(args)
    model = load_flash(
        args.store,
        dram_budget=None if args.mode == "dense" else args.budget,
        mode=args.mode,
        window=args.window,
        device=device,
        lookahead=args.lookahead,
    )
    return _generate(args, model, model.flash.stats if model.flash is not None else None)


def _offload(args: argparse.Namespace) -> int:
    from flashllm_ext.offload.store import LayerStore
    from flashllm_ext.offload.convert import convert_offload
    from flashllm_ext.offload import load_offload

    if not args.convert and (args.endor or args.dtype or args.force):
        raise SystemExit("flashllm offload: --endor, --dtype and --force apply to --convert")
    if args.convert:
        print(
            LayerStore(
                convert_offload(
                    args.convert, args.store, dtype=args.dtype or "fp16", endor_compress=args.endor, force=args.force
                )
            )
        )
        return 0
    if not args.tokenizer:
        raise SystemExit("flashllm offload: --tokenizer is needed to generate (or --convert CHECKPOINT to write)")
    _check_tokenizer(args)
    model = load_offload(
        args.store,
        args.budget,
        mode=args.mode,
        compute=args.compute,
        device=args.device,
        device_budget=args.device_budget,
        slots=args.slots,
    )
    return _generate(args, model, model.offload.stats)


def _add_offload(sub: argparse._SubParsersAction) -> None:
    from flashllm_ext.offload.placement import COMPUTES, MODES

    p = sub.add_parser("offload", help="offloaded inference: whole decoder layers in memory or on SSD by a budget")
    p.add_argument("store", help="a layer store directory (written by --convert)")
    p.add_argument("--convert", metavar="CHECKPOINT", help="write the store from this HF directory or .gguf file")
    p.add_argument("--endor", action="store_true", help="with --convert: Endor-compress the matrices (pruned models)")
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), help="with --convert: the stored dtype (default fp16)")
    p.add_argument("--force", action="store_true", help="with --convert: replace the layer store if there is one")
    p.add_argument("--tokenizer", help="the checkpoint's .gguf file or Hugging Face directory")
    p.add_argument("--prompt", default="The three primary colors are")
    p.add_argument("--mode", choices=MODES, default="endor")
    p.add_argument("--compute", choices=COMPUTES, default="auto", help="Endor matrices: endor_linear, decompress+GEMM")
    p.add_argument("--budget", default="30%", help="DRAM budget: bytes, a share of the dense model like 30%%, or 2GB")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: layers in GPU memory by --device-budget, then host memory by --budget, then SSD",
    )
    p.add_argument("--device-budget", default=None, help="with --device cuda: GPU memory, as --budget (default: all)")
    p.add_argument(
        "--slots",
        type=int,
        choices=(1, 2),
        default=None,
        help="buffers SSD and staged layers are fetched into: 2 overlap the next fetch with compute, 1 "
        "leaves a layer's room more (default: 1 on cuda, 2 on cpu)",
    )
    p.add_argument("--tokens", type=_positive_int, default=32, help="tokens to generate")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.set_defaults(func=_offload)


def _add_run(sub: argparse._SubParsersAction) -> None:
    from flashllm_ext.flash.stack import MODES

    run = sub.add_parser("run", help="generate text with a model served from a flash store")
    run.add_argument("store", help="a flash store directory (flashllm convert)")
    run.add_argument("--tokenizer", required=True, help="the checkpoint's .gguf file or Hugging Face directory")
    run.add_argument("--prompt", default="The three primary colors are")
    run.add_argument("--mode", choices=MODES, default="flash")
    run.add_argument("--budget", default="50%", help="DRAM budget: bytes, a share of the model like 50%%, or 200MB")
    run.add_argument("--window", type=_positive_int, default=5, help="tokens whose active neurons stay cached (flash)")
    run.add_argument("--tokens", type=_positive_int, default=32, help="tokens to generate")
    run.add_argument(
        "--lookahead",
        choices=("ahead", "prefetch"),
        help="flash/exact: choose a set for each layer's "
        "FFN before its attention and read it during the attention; ahead: compute that set (faster, "
        "predicted from an earlier input); prefetch: compute the FFN's own set as without look-ahead",
    )
    run.add_argument("--sample", action="store_true", help="sample (temperature 1 unless --temperature is given)")
    run.add_argument("--temperature", type=float, help="sampling temperature (default 0: greedy)")
    run.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    run.add_argument("--top-p", type=float, default=1.0, help="sample among the likeliest tokens of this mass")
    run.add_argument("--repeat-penalty", type=float, default=1.0, help="> 1: tokens already seen less likely")
    run.add_argument("--seed", type=int, help="seed of the sampler (default: a fresh one each run)")
    run.add_argument("--stop", action="append", default=[], help="stop before this text (repeatable)")
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    run.add_argument(
        "--hf",
        action="store_true",
        help="run through transformers (load_flash) instead of the lean decoder: the reference path",
    )
    run.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model and the neuron caches live (cuda: the GPU, reads staged through pinned host memory)",
    )
    run.set_defaults(func=_run)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flashllm", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_convert, _add_calibrate_disk, _add_train_predictors, _add_run, _add_offload):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one subcommand. A user's mistake (OSError: a missing or unreadable file; ValueError, FormatError among
    them: a malformed file or a value out of range) exits with one line on stderr and status 1, Ctrl-C with status
    130; any other exception is a bug and keeps its traceback."""
    command = "flashllm"
    try:
        args = build_parser().parse_args(argv)
        command = f"flashllm {args.command}"
        return args.func(args)
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        raise SystemExit(INTERRUPTED) from None
    except (OSError, ValueError) as e:
        raise SystemExit(f"{command}: {' '.join(str(e).split())}") from None


if __name__ == "__main__":
    sys.exit(main())
