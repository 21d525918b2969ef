"""`flashllm convert`, `flashllm calibrate-disk` and `flashllm train-predictors`: the offline steps that make a store
and its predictors."""

from __future__ import annotations

import argparse
from pathlib import Path

from flashllm_ext.cli.arguments import group_size, positive_int, ranks

WINDOW = 512  # tokens per forward pass while calibrating and capturing


def _convert(args: argparse.Namespace) -> int:
    from flashllm_ext.flash.convert import convert
    from flashllm_ext.flash.quantized_rows import describe_sources
    from flashllm_ext.flash.store import FlashStore

    neuron_order = predictors = None
    if (args.placement is None) != (args.predictors is None):
        raise ValueError("--placement and --predictors go together: the order comes from the predictors' statistics")
    if args.placement is not None:
        from flashllm_ext.predictor import load_predictors, neuron_orders

        predictors = load_predictors(args.predictors)
        neuron_order = neuron_orders(predictors, args.placement)
    out = convert(
        args.checkpoint,
        args.out_dir,
        dtype=args.dtype,
        endor=args.endor,
        force=args.force,
        down_format=args.down_format,
        neuron_order=neuron_order,
        rounding=args.rounding,
    )
    store = FlashStore(out)
    print(store)
    if predictors is not None:  # they answer in the model's order: the engine maps their sets onto the rows
        from flashllm_ext.predictor import save_predictors_to_store

        predictors.check_shape(store.n_layers, store.hidden_size, store.n_neurons, f"the store {out}")
        save_predictors_to_store(predictors, out)
        print(f"neurons placed by {args.placement}; the predictors of {args.predictors} written into the store")
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

        if FlashStore(args.store).experts is not None:
            raise SystemExit(
                f"flashllm train-predictors: {args.store} is a mixture-of-experts store; it needs no predictors "
                "(its routers name each token's experts)"
            )
    from flashllm_ext.io.gguf_layout import gguf_config

    if gguf_config(gguf_path).get("num_experts"):
        raise SystemExit(
            f"flashllm train-predictors: {gguf_path} is a mixture-of-experts model; it needs no predictors"
        )
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


def add_convert(sub: argparse._SubParsersAction) -> None:
    from flashllm_ext.flash.quantized_rows import CALIBRATION_WINDOW, CALIBRATION_WINDOWS, DEFAULT_DOWN_FORMAT
    from flashllm_ext.flash.quantized_rows import QUANTIZED_DTYPES, ROUNDINGS
    from flashllm_ext.flash.store import DTYPES
    from flashllm_ext.ops.blocks import BLOCK_FORMATS
    from flashllm_ext.predictor.placement import PLACEMENTS

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
        "weights quantized (--rounding); a quantized store holds its attention, embedding and LM head as blocks too, "
        "its other tensors in fp16 (default: fp16)",
    )
    p.add_argument(
        "--rounding",
        choices=ROUNDINGS,
        default="nearest",
        help="with --dtype q8 or q4: how the FFN rows and attention projections the store quantizes are rounded. "
        "nearest: each weight to its nearest code. gptq: the codes chosen against the layer's inputs (GPTQ), "
        "captured by running the model "
        f"(transformers, float32, in memory) on {CALIBRATION_WINDOWS} windows of {CALIBRATION_WINDOW} tokens of "
        "calibration text; the same format and size, a lower error (default: nearest)",
    )
    p.add_argument(
        "--down-format",
        choices=tuple(BLOCK_FORMATS),
        help=f"with --dtype q8 or q4: the block format of the down rows (default {DEFAULT_DOWN_FORMAT})",
    )
    p.add_argument("--endor", action="store_true", help="Endor-compress the bundles (pruned models; float dtypes)")
    p.add_argument(
        "--placement",
        choices=PLACEMENTS,
        help="place each layer's neurons on flash by the calibration statistics of --predictors: frequency (the most "
        "often active first: the hot-cold caches' pinned neurons become one block, never read through) or "
        "coactivation (neurons that fire together adjacent); the predictors keep working on the placed store",
    )
    p.add_argument(
        "--predictors",
        help="with --placement: predictors trained on this checkpoint (flashllm train-predictors: a file, or a store "
        "holding them), written into the new store too",
    )
    p.add_argument("--force", action="store_true", help="replace the flash store at out_dir if there is one")
    p.set_defaults(func=_convert)


def add_calibrate_disk(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate-disk", help="measure latency and bandwidth for the reader's coalescing model")
    p.add_argument("--dir", default=".", help="a directory on the disk that will hold the stores")
    p.add_argument("--size-mib", type=positive_int, default=1024, help="size of the temporary test file")
    p.set_defaults(func=_calibrate_disk)


def add_train_predictors(sub: argparse._SubParsersAction) -> None:
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
        type=group_size,
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
    train.add_argument("--block", type=positive_int, default=16, help="context: decoded tokens per neuron set")
    train.add_argument(
        "--rank",
        type=ranks,
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
        type=positive_int,
        default=4096,
        help=f"calibration tokens (rounded up to windows of {WINDOW} spread over the calibration text)",
    )
    train.add_argument("--epochs", type=positive_int, default=10)
    train.add_argument(
        "--recall",
        type=float,
        default=0.95,
        help="per-layer probability threshold chosen for this recall (<= 0: fixed 0.5)",
    )
    train.add_argument(
        "--top-k", type=positive_int, default=None, help="predict the k most likely neurons per token instead"
    )
    train.set_defaults(func=_train_predictors)
