"""What the end-to-end benchmarks share (bench_e2e, bench_e2e_scale, bench_e2e_prefill, bench_e2e_endor): the default
model's stores and prompt, the child processes that run one configuration each inside a memory cgroup of the child's
baseline + the budget (bench/common.py run_limited_child), the budgets, the arguments and the breakdown figure.

A benchmark's children run its own module: `python -m <module> --child CONFIG` (child_argv), which hands the JSON
config to child_main; the probe child that measures the baseline runs the same module, so the baseline holds what
every child of that benchmark imports.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import arg_parser, run_limited_child, stacked_token_bars

from flashllm_ext.errors import FormatError

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MODES = ("dense", "naive", "hybrid", "flash", "flash-oracle", "accelerate")
KEYS = (
    "bench",
    "model",
    "device",
    "mode",
    "budget_mb",
    "cgroup_limit_mb",
    "cgroup_peak_mb",
    "ms_per_token",
    "io_ms",
    "mem_ms",
    "predictor_ms",
    "compute_ms",
    "hidden_io_ms",
    "bytes_per_token",
    "tokens",
    "hit_rate",
)
COLUMNS = [
    "mode",
    "options",
    "cache_layout",
    "hot_fraction",
    "budget_mb",
    "cgroup_limit_mb",
    "cgroup_peak_mb",
    "oom_killed",
    "ms_per_token",
    "io_ms",
    "mem_ms",
    "predictor_ms",
    "compute_ms",
    "bytes_per_token",
    "reads_per_token",
    "hit_rate",
    "error",
]
# What tells one configuration's rows from another's: the summary rows are medians over each one's rounds.
CONFIG_FIELDS = (
    "model",
    "mode",
    "operating_point",
    "predictor",
    "lookahead",
    "options",
    "placement",
    "budget_spec",
    "store_format",
)
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
TARGET_SPARSITY = 0.6  # the default-model predictors' operating point (trained once into the cached store):
# the rule's threshold alone costs ~+5% held-out perplexity there (BENCHMARKS.md)


def prompt_ids(n_prompt: int, vocab_size: int, synthesized: bool = False) -> tuple[list[int], str | None]:
    """The prompt every configuration decodes from: the first n_prompt tokens of the held-out text (the default
    model's tokenizer), and a note when a smaller vocabulary (a tiny test store) forces folding them into it.
    synthesized (a checkpoint of random weights, where the text does not matter): when the default model cannot be
    fetched (a machine with no network), seeded random ids instead, and a note saying so."""
    from transformers import AutoTokenizer

    from flashllm_ext.hub import corpus_token_ids, fetch_default

    try:
        gguf = fetch_default()
    except RuntimeError as e:
        if not synthesized:
            raise
        ids = torch.randint(vocab_size, (n_prompt,), generator=torch.Generator().manual_seed(0)).tolist()
        return ids, f"seeded random token ids: the default model's tokenizer could not be fetched ({str(e)[:80]})"
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    ids = corpus_token_ids(tokenizer, "heldout", max_tokens=n_prompt)
    if int(ids.max()) < vocab_size:
        return ids.tolist(), None
    return (ids % vocab_size).tolist(), f"held-out token ids folded modulo the store's vocabulary of {vocab_size}"


# ------------------------------------------------------------------------------------------------- the stores


def converted_once(
    checkpoint: Path, store: Path, dtype: str = "fp16", neuron_order: torch.Tensor | None = None
) -> Path:
    """`store`, converted from `checkpoint` (flashllm convert, `dtype`, placed by `neuron_order` [L, n] when given)
    unless it opens already, placed that way: the benchmarks' stores of synthesized checkpoints are written once and
    reused (again when one is missing, in an older format or placed otherwise)."""
    from flashllm_ext.flash.convert import convert
    from flashllm_ext.flash.store import FlashStore

    try:
        with FlashStore(store) as opened:
            placed = opened.neuron_order
        ready = (placed is None) == (neuron_order is None) and (
            placed is None or torch.equal(placed, neuron_order.to(placed.dtype))
        )
    except (OSError, FormatError):
        ready = False
    if not ready:
        print(f"converting {checkpoint} to {store} (once)", file=sys.stderr)
        convert(checkpoint, store, dtype=dtype, force=True, neuron_order=neuron_order)
    return store


def default_store(cache: Path, train_predictors: bool = True, dtype: str = "fp16") -> Path:
    """The default model converted to a store in `dtype` (convert's: fp16, or q8 / q4, which keep the GGUF's blocks
    where they can; cached), with trained predictors (trained once: minutes; a quantized store takes the fp16
    store's, trained on the same GGUF model)."""
    import subprocess

    from flashllm_ext.flash.convert import convert
    from flashllm_ext.hub import fetch_default
    from flashllm_ext.predictor import DEFAULT_RECIPE, load_predictors, predictors_recipe, save_predictors_to_store
    from flashllm_ext.flash.store import FlashStore

    path = cache / f"smollm2-135m-{dtype}"
    try:
        FlashStore(path)
    except (OSError, FormatError):  # none yet, or written by an older format: (re)convert
        convert(fetch_default(), path, dtype=dtype, force=True)
    if train_predictors and predictors_recipe(path) != DEFAULT_RECIPE:  # none yet, or an older default's
        if dtype != "fp16":
            trained = default_store(cache, True)
            save_predictors_to_store(load_predictors(trained), path, DEFAULT_RECIPE)
            return path
        subprocess.run(
            [sys.executable, "-m", "flashllm_ext.cli", "train-predictors", "default", "--store", str(path)],
            check=True,
            stdout=sys.stderr,
        )  # the default recipe; stdout: --json rows
    return path


def hf_checkpoint(cache: Path, wanda_sparsity: float | None = None) -> Path:
    """The default model as a Hugging Face fp16 safetensors directory (accelerate's input), saved once; with
    wanda_sparsity, its FFN weights Wanda-pruned first (flashllm_ext.demos.endor.wanda_prune_ffn, 512 calibration
    tokens)."""
    from flashllm_ext.hub import load_hf_model, save_hf_checkpoint

    pruned = "" if wanda_sparsity is None else f"-wanda{round(wanda_sparsity * 100)}"
    path = cache / f"smollm2-135m-hf-fp16{pruned}"
    if not (path / "config.json").is_file():
        gguf_model, tokenizer = load_hf_model()
        if wanda_sparsity is not None:
            from flashllm_ext.demos.endor import wanda_prune_ffn
            from flashllm_ext.hub import corpus_token_ids, replace_weights

            calibration = corpus_token_ids(tokenizer, "calibration", 512)
            replace_weights(gguf_model, wanda_prune_ffn(gguf_model, calibration, wanda_sparsity))
        save_hf_checkpoint(gguf_model, tokenizer, path)
    return path


# ------------------------------------------------------------------------------------------ the child processes


def child_argv(module: str, config: dict) -> list[str]:
    """The command of a child of the benchmark `module` (e.g. "bench.bench_e2e") that runs `config`."""
    return [sys.executable, "-m", module, "--child", json.dumps(config)]  # cwd and env inherited


def child_main(config_json: str, run: Callable[[dict], dict]) -> None:
    """A child's part (its benchmark's --child): print the row of run(config) as JSON, or the probe's."""
    config = json.loads(config_json)
    if config["mode"] == "probe":
        import flashllm_ext  # noqa: F401  (what every child imports before loading its model)
        import transformers  # noqa: F401

        if config.get("device") == "cuda":  # the CUDA context's host memory is every GPU child's
            torch.zeros(1, device="cuda")
        if "store" in config:
            from flashllm_ext.hub.hf import empty_model
            from flashllm_ext.flash.store import FlashStore

            store = FlashStore(config["store"])
            empty_model(store.config, store.dtype, store.path)
        print(json.dumps({"probe": True}))
        return
    print(json.dumps(run(config)), flush=True)


def measure_baseline(module: str, device: str = "cpu", store: Path | None = None, timeout_s: float = 600) -> int:
    """Bytes a child of `module` holds before loading a model: python + torch + transformers + flashllm_ext imported
    (page cache of their files counted; on CUDA, the CUDA context too) and, given the store, its model's modules
    built on the meta device (the modeling code every child imports: ~120 MB for the default model); the peak of an
    unlimited probe child's cgroup."""
    probe = {"mode": "probe", "device": device, **({"store": str(store)} if store is not None else {})}
    return probe_peak_bytes(child_argv(module, probe), "e2e-probe", timeout_s)


def probe_peak_bytes(argv: list[str], name: str, timeout_s: float = 600) -> int:
    """The peak of an unlimited memory cgroup around a run of `argv` that stops after its imports: a process's
    baseline, the same way for every system compared (page cache of the files it reads counted)."""
    _, facts = run_limited_child(argv, None, None, name, timeout_s)
    if facts["cgroup_peak_mb"] is None:
        raise RuntimeError(f"no cgroup to measure the baseline: {facts['cgroup_note']}")
    return int(facts["cgroup_peak_mb"] * 1e6)


def oracle_bytes(store_path: Path) -> int:
    """What OraclePredictors (bench/e2e_decode.py) holds outside the budget: [up | gate] (or up) of every layer."""
    from flashllm_ext.flash.store import FlashStore

    store = FlashStore(store_path)
    return store.n_layers * store.n_neurons * (2 if store.glu else 1) * store.hidden_size * store.dtype.itemsize


def run_configuration(module: str, config: dict, baseline: int | None) -> dict:
    """One configuration in a child of `module` (its run_child) limited to baseline + the budget (+ the oracle's
    rows for flash-oracle): the child's row with the cgroup facts."""
    budget = config["budget_bytes"]
    extra = oracle_bytes(Path(config["store"])) if config["mode"] == "flash-oracle" else 0
    rows, facts = run_limited_child(
        child_argv(module, config),
        None if budget is None else budget + extra,
        baseline,
        f"e2e-{config['mode']}",
        config.get("timeout_s", 1800),
    )
    if extra:
        facts["oracle_mb"] = extra / 1e6
    # A killed child prints no row of its own: the harness's error row then stands for it.
    row = {
        "bench": "e2e",
        "model": config["model"],
        "mode": config["mode"],
        "budget_mb": None if config["budget_bytes"] is None else config["budget_bytes"] / 1e6,
        **(rows[0] if rows else {"error": "the child printed no row"}),
    }
    if len(rows) > 1 and not row.get("error"):
        row["error"] = rows[-1].get("error")
    row.update(facts)
    if config["budget_bytes"] is None and facts["cgroup_note"] is None:
        row["cgroup_note"] = "no budget (dense reference): peak measured, no limit"
    return row


def e2e_parser(description: str, tokens: bool = True, device: bool = False, plot: bool = False):
    """bench.common's parser with what the end-to-end benchmarks take: --child (a child's config), --budget,
    --tokens (unless not `tokens`), --prompt-tokens, --child-timeout, --quick, and --device and --no-plot when asked;
    three rounds by default."""
    parser = arg_parser(description)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--budget", default="50%", help="DRAM budget (of the model's bytes, or a size)")
    if tokens:
        parser.add_argument("--tokens", type=int, default=32, help="greedy decode tokens after the prompt")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--child-timeout", type=float, default=900, help="seconds before a child is killed")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 tokens, 16-token prompt")
    if plot:
        parser.add_argument("--no-plot", action="store_true")
    if device:
        parser.add_argument(
            "--device",
            choices=("cpu", "cuda"),
            default="cpu",
            help="where the model and its neuron caches live (cuda: the GPU)",
        )
    parser.set_defaults(rounds=3)
    return parser


def check_device(parser: argparse.ArgumentParser, device: str) -> None:
    """Refuse --device cuda where there is no CUDA (flashllm_ext.runtime.cuda_device says why)."""
    from flashllm_ext.runtime import cuda_device

    try:
        cuda_device(device)
    except ValueError as e:
        parser.error(str(e))


# --------------------------------------------------------------------------------------------------- budgets


def model_bytes_of(store_path: Path, ffn: bool = True) -> int:
    """Resident tensors as stored (without predictors) + every FFN bundle of the store (ffn=False: without the
    bundles): what '50%' is a share of."""
    from flashllm_ext.flash.stack import store_ffn_bytes
    from flashllm_ext.flash.store import FlashStore

    with FlashStore(store_path) as store:
        return store.resident_nbytes() + (store_ffn_bytes(store) if ffn else 0)


def budget_of_first_layers(store_path: Path, spec: str, whole_layers: int) -> int:
    """The model budget for a store of the first layers of a model of `whole_layers` identical layers, at a budget
    `spec` of the whole model: the store's resident tensors and the share of its FFN bytes that `spec` leaves the
    whole model's FFNs after its resident tensors. (`spec` of the store itself would leave its FFNs less: the
    embeddings are as large in a store of 8 layers as in one of 32.) A layer then runs as in the whole model."""
    from flashllm_ext.io.safetensors import read_header
    from flashllm_ext.runtime import parse_budget
    from flashllm_ext.flash.store import FlashStore

    store = FlashStore(store_path)
    entries = read_header(store.resident_path).tensors  # their bytes as stored (a quantized store's blocks too)
    per_layer = sum(e.end - e.begin for n, e in entries.items() if re.search(r"\.layers\.\d+\.", n)) / store.n_layers
    resident = model_bytes_of(store_path, ffn=False)
    ffn = model_bytes_of(store_path) - resident
    scale = whole_layers / store.n_layers
    whole_resident = resident + per_layer * (whole_layers - store.n_layers)
    ffn_share = (parse_budget(spec, int(whole_resident + ffn * scale)) - whole_resident) / (ffn * scale)
    return resident + max(0, int(ffn_share * ffn))


# ---------------------------------------------------------------------------------------------------- figure


def bar_label(row: dict) -> str:
    """A bar's name: the mode, the scale run's operating point and predictor method where it has them, look-ahead,
    the budget."""
    name = row["mode"]
    if row.get("operating_point") and row["operating_point"] != "dense compute":
        method = row["predictor"].split()[1] if row.get("predictor") else None
        name += f" ({row['operating_point'][0]}{', ' + method if method else ''})"
    if row.get("lookahead"):
        name += f" +{row['lookahead']}"
    if row.get("options"):
        name += f" {row['options']}"
    return f"{name}\n{row['budget_mb']:.0f} MB" if row.get("budget_mb") else name


def plot_breakdown(rows: list[dict], path: Path) -> None:
    """Stacked per-token bars (io / mem / predictor / compute) per mode; rows without parts show their total."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("ms_per_token") is not None]
    labels = [bar_label(r) for r in rows]
    fig, ax = plt.subplots(figsize=(1.3 * len(rows) + 2, 4))
    stacked_token_bars(
        ax,
        labels,
        rows,
        [(part, part.removesuffix("_ms")) for part in ("io_ms", "mem_ms", "predictor_ms", "compute_ms")],
        has_breakdown="io_ms",
    )
    ax.set_title(f"{rows[0]['model'] if rows else ''}: per-token breakdown")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
