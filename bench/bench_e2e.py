"""End-to-end flash inference: greedy decoding of the default model from a flash store under a DRAM
budget, each mode and the accelerate disk-offload peer in its own process inside a memory cgroup of that process's
baseline + the budget (page cache counted, dropped first; bench/common.py run_limited_child).

Modes: dense (reference, all in DRAM, no budget), naive, hybrid, flash (trained predictors), flash-oracle (the true
active sets of the one rule as the predictor: an upper bound), accelerate (transformers + accelerate device_map disk
offload, max_memory = the budget). Same prompt (held-out text), same number of greedy decode tokens; ms_per_token is
the median decode token after the prompt, the parts (io/mem/predictor/compute) are the engine's per-token means over
the decode tokens (stats reset after prefill); hidden_io_ms is the read time the engine overlapped with compute.
The configurations run round-robin for --rounds rounds (each in a fresh process); the summary rows
(bench:"e2e_median") are per-mode medians over the rounds, and ratios are taken between those medians.

--device cuda runs every mode on the GPU: the model and the neuron caches in GPU memory, reads staged
through pinned host memory (flashllm_ext/flash/transfer.py); the cgroup still limits host memory (its baseline includes the
CUDA context), and the budget still sizes the caches; accelerate's peer then offloads from the GPU.

With --endor: flash mode on two stores of the same Wanda-50%-pruned default model, dense bundles and
Endor rows (store_format "dense" / "endor"), same budget, prompt and tokens, each in its own limited process,
interleaved: bytes read per token and ms/token of the Endor store against the dense one. Both run flash-oracle
(the true active sets of the rule, thresholds calibrated on the pruned model at TARGET_SPARSITY): the same sets on
both stores, so the comparison is of the formats alone, with no predictor to train.

    python -m bench.bench_e2e [--json] [--budget 50%] [--tokens 32] [--rounds 3] [--quick] [--store DIR]
                              [--device cpu|cuda] [--scale] [--endor]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import resource
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from bench.common import (
    arg_parser,
    device_name,
    emit,
    error_fields,
    median_rows,
    process_memory,
    run_limited_child,
    stacked_token_bars,
)

from flashllm_ext.errors import FormatError
from flashllm_ext.io.paths import resolve_cache_dir
from flashllm_ext.predictor import DEFAULT_RECIPE, NeuronPredictor
from flashllm_ext.flash.reader import FlashReader
from bench.traces import LOWRANK_TRAINING, predictor_training, trained_predictors

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
ENDOR_COLUMNS = ["store_format", "decompress_ms", "requested_bytes_per_token"] + COLUMNS
SCALE_COLUMNS = ["model", "operating_point", "predictor", "lookahead", *COLUMNS]
# What tells one configuration's rows from another's: the summary rows are medians over each one's rounds.
CONFIG_FIELDS = ("model", "mode", "operating_point", "predictor", "lookahead", "options", "budget_spec", "store_format")
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
TARGET_SPARSITY = 0.6  # the default-model predictors' operating point (trained once into the cached store):
# the rule's threshold alone costs ~+5% held-out perplexity there (BENCHMARKS.md)
# The scale run's predictors per operating point and method: `flashllm train-predictors` arguments. At (a), those of
# bench/traces.py for the true sets at 0.97 (quant: gate and up at 4 bits, loaded density 0.06; held-out recall of
# the true sets ~0.98, BENCHMARKS.md); at (b): the library default (DEFAULT_RECIPE, spelled out so that the cached
# predictors file names it and an older default's file is not reused; the low-rank ones load 0.92 there).
SCALE_PREDICTORS = {
    "a": {method: predictor_training(method, 0.97) for method in ("lowrank", "quant")},
    "b": {
        "quant": (
            "--method",
            DEFAULT_RECIPE["method"],
            "--gate-bits",
            str(DEFAULT_RECIPE["gate_bits"]),
            "--up-bits",
            str(DEFAULT_RECIPE["up_bits"]),
            "--density",
            str(DEFAULT_RECIPE["density"]),
            "--rounding",
            DEFAULT_RECIPE["rounding"],
            "--group-size",
            str(DEFAULT_RECIPE["group_size"]),
        )
    },
}


# ------------------------------------------------------------------------------------------------ the oracle


class OraclePredictors(NeuronPredictor):
    """A predictor whose prediction is the true active set of the one rule (flashllm_ext.predictor):
    |h| > threshold, h = act(x . gate + b) * (x . up) (act(x . up + b) for non-GLU stores), x the FFN's input.

    An oracle is hypothetical: the rows it scores with ([up | gate] of every layer, read from the store's bundles)
    are held as plain attributes and memory_bytes is 0, so the engine does not charge them to the budget;
    the harness raises the cgroup limit by `nbytes` instead and the row reports it (oracle_mb). Its predictor_ms
    is the cost of that dense scoring, not of a real predictor."""

    def __init__(self, store, thresholds: torch.Tensor):
        super().__init__(store.n_layers, store.hidden_size, store.n_neurons, thresholds, thresholds)
        from flashllm_ext.ops import ACTIVATIONS
        from flashllm_ext.flash.cache import layer_input_bias
        from flashllm_ext.flash.ffn import store_activation

        width = (2 if store.glu else 1) * store.hidden_size  # a bundle is [up | gate | down] or [up | down]
        # Read in small parts into the kept rows, through a reader closed afterwards: no whole-layer transient and
        # no idle reader threads with their bounce buffers outlive the construction (they would count in the cgroup).
        self.scoring_rows = [torch.empty((store.n_neurons, width), dtype=store.dtype) for _ in range(store.n_layers)]
        with FlashReader(store, threads=4) as reader:
            for i, rows in enumerate(self.scoring_rows):
                for part in torch.arange(store.n_neurons).split(256):
                    rows[part] = reader.read(i, part).data[:, :width]
        self.biases = [layer_input_bias(store, i) for i in range(store.n_layers)]
        self.glu, self.d = store.glu, store.hidden_size
        self.activation = ACTIVATIONS[store_activation(store)].fn

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.scoring_rows)

    @property
    def memory_bytes(self) -> int:  # hypothetical: see the class doc
        return 0

    @torch.no_grad()
    def scores(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        if self.scoring_rows[layer].device != x.device:  # plain attributes: Module.to does not move them
            self.scoring_rows[layer] = self.scoring_rows[layer].to(x.device)
        rows, d, xf = self.scoring_rows[layer].float(), self.d, x.float()
        pre = xf @ rows[:, d : 2 * d].t() if self.glu else xf @ rows[:, :d].t()
        if self.biases[layer] is not None:
            pre += self.biases[layer].to(x.device).float()
        h = self.activation(pre)
        if self.glu:
            h = h * (xf @ rows[:, :d].t())
        return h.abs()


# ------------------------------------------------------------------------------------------- the child runs


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


@torch.inference_mode()
def _storage_reads() -> tuple[int, int]:
    """(bytes this process has caused to be read from storage, its major page faults): /proc/self/io read_bytes
    (page-cache hits excluded; direct reads and page faults included) and getrusage's ru_majflt."""
    with open("/proc/self/io") as f:
        read_bytes = next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    return read_bytes, resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def _decode(
    model, prompt: torch.Tensor, n_tokens: int, reset_stats, warmup: int = 0
) -> tuple[list[float], list[int], dict]:
    """Greedy decoding after a prefill of `prompt` and `warmup` untimed decode tokens: (seconds per decode token,
    the tokens, the decode tokens' storage reads per token as the kernel counts them). reset_stats runs after the
    prefill and the warm-up so the engine's stats cover the timed decode tokens only. A token's time ends when its
    id is on the host (on a GPU, once its kernels have run). The kernel's count includes what the engine does not
    see: a file-backed page (a memory-mapped weight, accelerate's offloaded tensors) read again after the cgroup
    limit evicted it is a major fault and its bytes are storage reads."""
    out = model(prompt, use_cache=True)
    past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    tokens = [int(token)]

    def step() -> None:
        nonlocal past, token
        out = model(token, past_key_values=past, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        tokens.append(int(token))

    for _ in range(warmup):
        step()
    reset_stats()
    read_before, faults_before = _storage_reads()
    times = []
    for _ in range(n_tokens):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    read_after, faults_after = _storage_reads()
    n = max(1, len(times))
    return (
        times,
        tokens,
        {
            "proc_read_mb_per_token": (read_after - read_before) / n / 1e6,
            "major_faults_per_token": (faults_after - faults_before) / n,
        },
    )


def _load(config: dict):
    """(model, the reset function of its stats) for one configuration of the child."""
    import flashllm_ext
    from flashllm_ext.predictor import load_predictors
    from flashllm_ext.flash.store import FlashStore

    mode, budget, device = config["mode"], config["budget_bytes"], config.get("device", "cpu")
    if mode == "accelerate":
        from transformers import AutoModelForCausalLM

        offload = Path(config["offload_dir"])
        offload.mkdir(parents=True, exist_ok=True)
        # on the GPU: GPU, then disk; or a given map ({"0": GPU bytes, "cpu": host bytes}: GPU, host, then disk)
        memory = {0: budget} if device == "cuda" else {"cpu": budget}
        if config.get("max_memory"):
            memory = {int(k) if k.isdigit() else k: v for k, v in config["max_memory"].items()}
        model = AutoModelForCausalLM.from_pretrained(
            config["hf_dir"],
            dtype=torch.float16,
            device_map="auto",
            max_memory=memory,
            offload_folder=str(offload),
            offload_state_dict=True,
        ).eval()
        return model, lambda: None
    if mode == "dense":
        return flashllm_ext.load_flash(config["store"], None, mode="dense", device=device), lambda: None
    predictors = None
    if config.get("scale") and mode.startswith("flash"):  # the tiled sets of the default model, replayed
        store, at = FlashStore(config["store"]), [0]
        n_tokens = len(config["prompt_ids"]) + config["tokens"] + 1
        masks = scale_masks(config, n_tokens, store.n_layers, store.n_neurons, ahead=False)
        ahead = (
            scale_masks(config, n_tokens, store.n_layers, store.n_neurons, ahead=True)
            if config.get("lookahead")
            else None
        )
        cost = scale_cost_predictor(config["predictors"], store) if config.get("predictors") else None
        predictors = ReplayedSets(masks, at, store.hidden_size, cost, ahead)
        model = flashllm_ext.load_flash(
            config["store"],
            budget,
            mode="flash",
            predictors=predictors,
            lookahead=config.get("lookahead"),
            **config.get("options", {}),
        )
        # The sets of the tokens at the positions this forward computes: after the cached ones.
        model.register_forward_pre_hook(partial(_track_position, at), with_kwargs=True)
        return model, model.flash.counters.reset
    if mode == "flash-oracle":
        store = FlashStore(config["store"])
        if "thresholds" in config:
            thresholds = torch.tensor(config["thresholds"])
        else:  # the oracle at the trained predictors' loaded density
            trained = load_predictors(store.path)
            thresholds = trained.true_thresholds if trained.true_thresholds.any() else trained.thresholds
        predictors = OraclePredictors(store, thresholds)
    model = flashllm_ext.load_flash(
        config["store"],
        budget,
        mode="flash" if mode == "flash-oracle" else mode,
        predictors=predictors,
        device=device,
        reader_options=config.get("reader_options"),
        **config.get("options", {}),
    )
    return model, model.flash.counters.reset


def _track_position(at: list[int], _module, _args, kwargs) -> None:
    past = kwargs.get("past_key_values")
    at[0] = 0 if past is None else past.get_seq_length()


def run_child(config: dict) -> dict:
    """One configuration, in this process: load, prefill, decode; the row (without the cgroup facts)."""
    device = config.get("device", "cpu")
    row = {
        "bench": "e2e",
        "model": config["model"],
        "device": device_name(device),
        "mode": config["mode"],
        "budget_mb": None if config["budget_bytes"] is None else config["budget_bytes"] / 1e6,
        **({"store_format": config["store_format"]} if "store_format" in config else {}),
    }
    before = process_memory()
    try:
        model, reset_stats = _load(config)
        prompt = torch.tensor([config["prompt_ids"]], device=device)
        times, tokens, storage = _decode(model, prompt, config["tokens"], reset_stats)
    except Exception as e:  # the row says why this configuration could not run
        return {**row, **error_fields(e)}
    after = process_memory()
    row.update(
        ms_per_token=statistics.median(times) * 1e3,
        mean_ms_per_token=statistics.mean(times) * 1e3,
        tokens=len(times),
        token_ms=[round(t * 1e3, 1) for t in times],
        generated=tokens,
        **storage,
    )
    if before and after:  # what loading and decoding added to the process, against what the engine accounts
        row.update(
            rss_peak_growth_mb=(after["VmHWM"] - before["VmRSS"]) / 1e6,
            rss_anon_growth_mb=(after["RssAnon"] - before["RssAnon"]) / 1e6,
            rss_file_growth_mb=(after["RssFile"] - before["RssFile"]) / 1e6,
        )
    stats = model.flash.stats() if getattr(model, "flash", None) is not None else None
    if stats is not None:
        row.update(
            {
                k: stats[k]
                for k in (
                    "io_ms",
                    "hidden_io_ms",
                    "decompress_ms",
                    "mem_ms",
                    "predictor_ms",
                    "compute_ms",
                    "bytes_per_token",
                    "requested_bytes_per_token",
                    "reads_per_token",
                    "mean_read_bytes",
                    "hit_rate",
                    "accounted_bytes",
                    "reader_bounce_bytes",
                    "cache_layout",
                )
            }
        )
    else:  # dense / accelerate: no engine stats; the whole decode time is compute (accelerate's reads included)
        row.update(
            io_ms=None,
            mem_ms=None,
            predictor_ms=None,
            compute_ms=None,
            bytes_per_token=0 if config["mode"] == "dense" else None,
            hit_rate=None,
        )
    return row


# ------------------------------------------------------------------------------------------------- the parent


def default_store(cache: Path, train_predictors: bool = True) -> Path:
    """The default model converted to an fp16 store (cached), with trained predictors (trained once: minutes)."""
    import subprocess

    from flashllm_ext.flash.convert import convert
    from flashllm_ext.hub import fetch_default
    from flashllm_ext.predictor import DEFAULT_RECIPE, predictors_recipe
    from flashllm_ext.flash.store import FlashStore

    path = cache / "smollm2-135m-fp16"
    try:
        FlashStore(path)
    except (OSError, FormatError):  # none yet, or written by an older format: (re)convert
        convert(fetch_default(), path, dtype="fp16", force=True)
    if train_predictors and predictors_recipe(path) != DEFAULT_RECIPE:  # none yet, or an older default's
        subprocess.run(
            [sys.executable, "-m", "flashllm_ext.cli", "train-predictors", "default", "--store", str(path)],
            check=True,
            stdout=sys.stderr,
        )  # the default recipe; stdout: --json rows
    return path


def hf_checkpoint(cache: Path, wanda_sparsity: float | None = None) -> Path:
    """The default model as a Hugging Face fp16 safetensors directory (accelerate's input), saved once; with
    wanda_sparsity, its FFN weights Wanda-pruned first (flashllm_ext.demos.endor.wanda_prune_ffn, 512 calibration tokens)."""
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


def _child_argv(config: dict) -> list[str]:
    return [sys.executable, "-m", "bench.bench_e2e", "--child", json.dumps(config)]  # cwd and env inherited


def measure_baseline(device: str = "cpu", store: Path | None = None, timeout_s: float = 600) -> int:
    """Bytes a child holds before loading a model: python + torch + transformers + flashllm_ext imported (page cache
    of their files counted; on CUDA, the CUDA context too) and, given the store, its model's modules built on the
    meta device (the modeling code every child imports: ~120 MB for the default model); the peak of an unlimited
    probe child's cgroup."""
    probe = {"mode": "probe", "device": device, **({"store": str(store)} if store is not None else {})}
    rows, facts = run_limited_child(_child_argv(probe), None, None, "e2e-probe", timeout_s)
    if facts["cgroup_peak_mb"] is None:
        raise RuntimeError(f"no cgroup to measure the baseline: {facts['cgroup_note']}")
    return int(facts["cgroup_peak_mb"] * 1e6)


def oracle_bytes(store_path: Path) -> int:
    """What OraclePredictors holds outside the budget: [up | gate] (or up) of every layer."""
    from flashllm_ext.flash.store import FlashStore

    store = FlashStore(store_path)
    return store.n_layers * store.n_neurons * (2 if store.glu else 1) * store.hidden_size * store.dtype.itemsize


def run_configuration(config: dict, baseline: int | None) -> dict:
    budget = config["budget_bytes"]
    extra = oracle_bytes(Path(config["store"])) if config["mode"] == "flash-oracle" else 0
    rows, facts = run_limited_child(
        _child_argv(config),
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


def model_bytes_of(store_path: Path, ffn: bool = True) -> int:
    """Resident tensors (without predictors) + every FFN bundle of the store (ffn=False: without the bundles): what
    '50%' is a share of."""
    from safetensors import safe_open

    from flashllm_ext.flash.stack import store_ffn_bytes
    from flashllm_ext.flash.store import FlashStore

    store = FlashStore(store_path)
    with safe_open(store.resident_path, framework="pt") as f:
        resident = sum(
            math.prod(f.get_slice(n).get_shape()) * store.dtype.itemsize
            for n in f.keys()
            if not n.startswith("predictor.")
        )
    return resident + (store_ffn_bytes(store) if ffn else 0)


def budget_of_first_layers(store_path: Path, spec: str, whole_layers: int) -> int:
    """The model budget for a store of the first layers of a model of `whole_layers` identical layers, at a budget
    `spec` of the whole model: the store's resident tensors and the share of its FFN bytes that `spec` leaves the
    whole model's FFNs after its resident tensors. (`spec` of the store itself would leave its FFNs less: the
    embeddings are as large in a store of 8 layers as in one of 32.) A layer then runs as in the whole model."""
    from safetensors import safe_open

    from flashllm_ext.runtime import parse_budget
    from flashllm_ext.flash.store import FlashStore

    store = FlashStore(store_path)
    with safe_open(store.resident_path, framework="pt") as f:
        per_layer = (
            sum(
                math.prod(f.get_slice(n).get_shape()) * store.dtype.itemsize
                for n in f.keys()
                if re.search(r"\.layers\.\d+\.", n)
            )
            / store.n_layers
        )
    resident = model_bytes_of(store_path, ffn=False)
    ffn = model_bytes_of(store_path) - resident
    scale = whole_layers / store.n_layers
    whole_resident = resident + per_layer * (whole_layers - store.n_layers)
    ffn_share = (parse_budget(spec, int(whole_resident + ffn * scale)) - whole_resident) / (ffn * scale)
    return resident + max(0, int(ffn_share * ffn))


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


# ------------------------------------------------------------------------------------------- the scale run

SCALE_MODELS = ("opt-6.7b", "llama-2-7b")  # bench/synth_checkpoint.py's checkpoints, converted once
# The operating points of the scale run: (a) OPT-like, the rule's threshold sparsity 0.97 (what the paper measured for
# OPT's ReLU FFNs); (b) SwiGLU-real, TARGET_SPARSITY, where the default model's held-out perplexity stays within ~5%
# of dense. Per point: the sparsity the predictors are trained for and the one the true sets are thresholded at.
POINTS = {
    "a": ("a (OPT-like): threshold sparsity 0.97", 0.97),
    "b": (f"b (SwiGLU-real): target sparsity {TARGET_SPARSITY:g}", TARGET_SPARSITY),
}
# (mode, operating point, predictor method of SCALE_PREDICTORS)
SCALE_CONFIGS = (
    ("naive", None, None),
    ("hybrid", None, None),
    ("flash-oracle", "a", None),
    ("flash", "a", "lowrank"),
    ("flash", "a", "quant"),
    ("flash", "b", "quant"),
    ("accelerate", None, None),
)  # accelerate: --full


def scale_configs(methods: list[str]) -> list[tuple[str, str | None, str | None]]:
    """SCALE_CONFIGS with the flash rows of the predictor `methods` asked for: at point (a) a method spelled
    "quant:G/U" is a quant row at those bits (traces.predictor_training); point (b) is the default recipe's."""
    configs = []
    for mode, point, method in SCALE_CONFIGS:
        if method is None:
            configs.append((mode, point, method))
        elif point == "a":
            configs += [(mode, point, m) for m in methods if m.partition(":")[0] == method]
        elif method in methods:
            configs.append((mode, point, method))
    return configs


class ReplayedSets(NeuronPredictor):
    """A predictor that replays precomputed active sets (bool [tokens, layers, neurons]) for the token `at[0]`:
    the default model's sets on held-out text, tiled onto the larger layers.

    cost: a predictor of the method that chose the sets, at the large model's shapes (`scale_cost_predictor`): its
    memory is what this one holds (charged to the budget by the engine) and it scores every input (its answer
    discarded), so a row pays what a real predictor would at that size. Without one (the oracle), nothing.
    ahead_masks: the sets the predictors choose from the look-ahead input, replayed by predict_ahead (the engine's
    prefetch, load_flash(lookahead=...)); without them, predict's."""

    def __init__(
        self,
        masks: torch.Tensor,
        at: list[int],
        hidden_size: int,
        cost: NeuronPredictor | None = None,
        ahead_masks: torch.Tensor | None = None,
    ):
        super().__init__(masks.shape[1], hidden_size, masks.shape[2])  # thresholds 0 (ReLU: exact zeros only)
        self.masks, self.at, self.cost = masks, at, cost
        self.ahead_masks = masks if ahead_masks is None else ahead_masks

    @property
    def memory_bytes(self) -> int:
        return 0 if self.cost is None else self.cost.memory_bytes

    def predict(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self._replay(self.masks, layer, x)

    def predict_ahead(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self._replay(self.ahead_masks, layer, x)

    def _replay(self, masks: torch.Tensor, layer: int, x: torch.Tensor) -> torch.Tensor:
        if self.cost is not None:
            self.cost.scores(layer, x)
        # On x's device, as a predictor's answer is (the engine copies it to the host to plan on)
        return masks[self.at[0] : self.at[0] + x.shape[0], layer].to(x.device)


def scale_cost_predictor(predictors_path: str, store) -> NeuronPredictor:
    """The predictors' method and settings at the store's shapes, every buffer filled with random values (so its
    pages are resident, as trained weights' would be): what that predictor costs a layer of the large model.
    Low-rank ranks repeat the small model's per-layer ranks; quant takes the store's gate / activation / biases."""
    from flashllm_ext.flash.ffn import store_activation
    from flashllm_ext.predictor import load_predictors, predictor_class

    small = load_predictors(predictors_path).config()
    config = {**small, "n_layers": store.n_layers, "hidden_size": store.hidden_size, "n_neurons": store.n_neurons}
    if "ranks" in small:
        config["ranks"] = [small["ranks"][i % len(small["ranks"])] for i in range(store.n_layers)]
    if small["method"] == "quant":
        config.update(
            glu=store.glu,
            activation=store_activation(store),
            **{role: store.layer_bias(0, role) is not None for role in ("gate_bias", "up_bias")},
        )
    cost = predictor_class(small["method"]).from_config(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in list(cost.parameters()) + list(cost.buffers()):
            if t.dtype == torch.uint8:
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=generator))
            else:
                t.copy_(torch.randn(t.shape, generator=generator).mul_(0.02))
    return cost.eval()


def scale_masks(config: dict, n_tokens: int, n_layers: int, n_neurons: int, ahead: bool | None = None) -> torch.Tensor:
    """bool [n_tokens, n_layers, n_neurons]: `default_model_sets` tiled onto the large layers (bench/traces.py)."""
    from bench.traces import tile_masks

    return tile_masks(default_model_sets(config, n_tokens, ahead), n_layers, n_neurons)


def default_model_sets(config: dict, n_tokens: int, ahead: bool | None = None) -> torch.Tensor:
    """bool [n_tokens, 30, 1536]: the true sets of the default model at the threshold sparsity (flash-oracle), or
    the sets its predictors choose on the same held-out tokens (flash): from the FFN inputs, or from the look-ahead
    inputs if `ahead` (default: whether the configuration computes those, lookahead "ahead"). Computed by the
    parent (it loads the default model, which a limited child has no room for), cached by bench/traces.py for at
    least 64 tokens, so that runs of a few tokens share one cached trace (a prefix of it)."""
    from bench.traces import default_model_masks, predicted_masks

    ahead = config.get("lookahead") == "ahead" if ahead is None else ahead
    n = max(n_tokens, 64)
    small = (
        default_model_masks(n, config["sparsity"], progress=False)
        if config["mode"] == "flash-oracle"
        else predicted_masks(Path(config["predictors"]), n, lookahead=ahead)
    )
    return small[:n_tokens]


def run_scale_child(config: dict) -> dict:
    """FFN-only decoding of a scale store: per token, every layer's FFN on a fresh random hidden state, within the
    FFN's share of the model's budget."""
    from flashllm_ext.flash.stack import ffn_stack
    from flashllm_ext.flash.store import FlashStore

    device = config.get("device", "cpu")
    row = {
        "bench": "e2e",
        "model": config["model"],
        "device": device_name(device),
        "mode": config["mode"],
        "operating_point": config["operating_point"],
        "budget_mb": config["budget_bytes"] / 1e6,
    }
    try:
        store, at = FlashStore(config["store"]), [0]
        masks = (
            scale_masks(config, config["tokens"] + 1, store.n_layers, store.n_neurons)
            if config["mode"].startswith("flash")
            else None
        )
        cost = scale_cost_predictor(config["predictors"], store) if config.get("predictors") else None
        predictors = None if masks is None else ReplayedSets(masks, at, store.hidden_size, cost)
        runtime = ffn_stack(
            store,
            "flash" if predictors is not None else config["mode"],
            config["budget_bytes"],
            predictors=predictors,
            device=device,
        )
        generator = torch.Generator().manual_seed(0)
        times = []
        with torch.inference_mode():
            for token in range(config["tokens"] + 1):  # token 0 warms the cache up: not timed
                at[0] = token
                xs = [
                    torch.randn(1, store.hidden_size, generator=generator).to(device, store.dtype)
                    for _ in runtime.modules
                ]
                if token == 1:
                    runtime.counters.reset()
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                for module, x in zip(runtime.modules, xs):
                    module(x)
                if device == "cuda":  # the token is done when its last kernel is
                    torch.cuda.synchronize()
                if token:
                    times.append(time.perf_counter() - start)
        stats = runtime.stats()
        per = 1e3 / len(times)  # the stats cover the timed tokens: per-token milliseconds
        row.update(
            ms_per_token=statistics.median(times) * 1e3,
            tokens=len(times),
            bytes_per_token=stats["bytes_read"] / len(times),
            hit_rate=stats["hit_rate"],
            accounted_bytes=stats["accounted_bytes"],
            reads_per_token=runtime.counters.n_reads / len(times),
            mean_read_bytes=stats["mean_read_bytes"],
            **{
                k: getattr(runtime.counters, k.removesuffix("_ms") + "_s") * per
                for k in ("io_ms", "hidden_io_ms", "mem_ms", "predictor_ms", "compute_ms")
            },
        )
        if masks is not None:
            row["loaded_density"] = masks[1:].float().mean().item()
        runtime.close()
    except Exception as e:  # the row says why
        row.update(error_fields(e))
    return row


def scale_store(name: str, layers: int | None = None, smoke: bool = False) -> Path:
    """The flash store converted (once) from the shared synthesized checkpoint of `name` (synth_checkpoint's
    shared_checkpoint: its first `layers` layers, or its smoke shapes)."""
    from bench.synth_checkpoint import shared_checkpoint

    from flashllm_ext.flash.convert import convert
    from flashllm_ext.flash.store import FlashStore

    checkpoint = shared_checkpoint(name, layers=layers, smoke=smoke)
    path = checkpoint.with_name(checkpoint.name.removesuffix("-hf") + "-store")
    try:
        FlashStore(path)
    except (OSError, FormatError):
        print(f"converting {checkpoint} to {path} (once)", file=sys.stderr)
        convert(checkpoint, path, dtype="fp16", force=True)
    return path


def run_scale(args) -> list[dict]:
    """The scale rows: per model of --scale-models, its synthesized checkpoint converted to a store. FFN-stack rows:
    the FFNs decoded within the FFN's share of --budget (of the whole model's weight bytes, the resident tensors
    taken first as load_flash takes them). With --full, whole-model rows too: load_flash at --budget, a prompt of
    --prompt-tokens held-out tokens, then --full-tokens greedy tokens."""
    from bench.synth_checkpoint import CONFIGS as SYNTH_CONFIGS

    from flashllm_ext.runtime import parse_budget
    from flashllm_ext.flash.store import FlashStore

    cache = resolve_cache_dir() / "e2e"
    wanted = [m for m in args.modes.split(",") if m]
    configs = []
    for name in [m for m in args.scale_models.split(",") if m]:
        store = scale_store(name, args.scale_layers, args.smoke)
        shapes = ", smoke shapes" if args.smoke else ""
        shapes += f", {args.scale_layers} layers" if args.scale_layers else ""
        total = model_bytes_of(store)
        resident = model_bytes_of(store, ffn=False)
        model_budget = (
            parse_budget(args.budget, total)
            if not args.scale_layers
            else budget_of_first_layers(store, args.budget, SYNTH_CONFIGS[name]["num_hidden_layers"])
        )
        if model_budget <= resident:
            raise SystemExit(
                f"{name}: a budget of {args.budget} does not cover the {resident / 1e6:.0f} MB of resident tensors"
            )
        # Random weights: where the default model's tokenizer cannot be fetched (a lent GPU has no network), any
        # prompt does.
        ids, prompt_note = prompt_ids(args.prompt_tokens, FlashStore(store).config["vocab_size"], synthesized=True)
        baseline = measure_baseline(args.device, store)  # this model's modules on the meta device included
        for mode, point, method in scale_configs(args.scale_predictors.split(",")):
            if mode not in wanted or (point is not None and point not in args.points.split(",")):
                continue
            label, sparsity = POINTS[point] if point else ("dense compute", None)
            train_args = (SCALE_PREDICTORS[point].get(method) or predictor_training(method, 0.97)) if method else None
            common = {
                "scale": True,
                "store": str(store),
                "mode": mode,
                "device": args.device,
                "operating_point": label,
                "sparsity": sparsity,
                "model_budget_mb": model_budget / 1e6,
                "resident_mb": resident / 1e6,
                "baseline": baseline,
                "predictor": " ".join(train_args) if method else None,
                "predictors": str(trained_predictors(cache, train_args)) if method else None,
            }
            whole = {
                **common,
                "model": f"{name} (synthesized checkpoint{shapes}, whole model)",
                "full": True,
                "budget_bytes": model_budget,
                "tokens": args.full_tokens,
                "prompt_ids": ids,
                "prompt_note": prompt_note,
                "timeout_s": args.child_timeout,
            }
            if mode == "accelerate":  # the peer runs the Hugging Face checkpoint itself: whole-model rows only
                if args.full or args.full_only:
                    from bench.synth_checkpoint import shared_checkpoint

                    hf_dir = shared_checkpoint(name, layers=args.scale_layers, smoke=args.smoke)
                    configs.append(
                        {**whole, "hf_dir": str(hf_dir), "offload_dir": str(cache / f"accelerate-offload-{name}")}
                    )
                continue
            if not args.full_only:
                configs.append(
                    {
                        **common,
                        "model": f"{name} (synthesized checkpoint{shapes}, FFN stack)",
                        "budget_bytes": model_budget - resident,
                        "tokens": args.tokens,
                    }
                )
            if args.full or args.full_only:
                configs.append(whole)
                if mode == "flash":
                    configs += [{**whole, "lookahead": how} for how in args.lookahead.split(",") if how]
                    configs += [{**whole, "options": json.loads(options)} for options in args.flash_options]
    for config in configs:  # the sets, computed here: the children are limited to the budget
        if config["mode"].startswith("flash"):
            n_tokens = len(config.get("prompt_ids", ())) + config["tokens"] + 1
            chosen = default_model_sets(config, n_tokens)
            true = default_model_sets({"mode": "flash-oracle", "sparsity": config["sparsity"]}, n_tokens)
            config["recall"] = ((chosen & true).sum() / true.sum()).item()  # of the true sets, on these tokens
    rows = []
    for round_index, config in [(r, c) for r in range(args.rounds) for c in configs]:
        child_rows, facts = run_limited_child(
            _child_argv(config),
            config["budget_bytes"],
            config["baseline"],
            f"e2e-scale-{config['mode']}",
            args.child_timeout,
        )
        row = {
            "model": config["model"],
            "mode": config["mode"],
            "budget_mb": config["budget_bytes"] / 1e6,
            **(child_rows[0] if child_rows else {"error": "the child printed no row"}),
            **facts,
            "operating_point": config["operating_point"],
            "predictor": config["predictor"],
            "recall": config.get("recall"),
            "lookahead": config.get("lookahead"),
            "options": json.dumps(config["options"]) if "options" in config else None,
            "round": round_index,
            "budget_spec": args.budget,
            "model_budget_mb": config["model_budget_mb"],
            "resident_mb": config["resident_mb"],
            "baseline_mb": config["baseline"] / 1e6,
            "prompt_tokens": len(config.get("prompt_ids", ())),
            "prompt_note": config.get("prompt_note"),
        }
        if len(child_rows) > 1 and not row.get("error"):
            row["error"] = child_rows[-1].get("error")
        row = {**{k: row.get(k) for k in KEYS}, **row, "bench": "e2e"}
        rows.append(row)
        emit([row], args.json, SCALE_COLUMNS)
    return rows


# ------------------------------------------------------------------------------------------------ prefill

PREFILL_COLUMNS = [
    "prefill",
    "round",
    "cgroup_limit_mb",
    "cgroup_peak_mb",
    "prefill_ms",
    "io_ms",
    "compute_ms",
    "bytes_read",
    "reads",
    "mean_read_kib",
    "paths",
    "error",
]


def run_prefill_child(config: dict) -> dict:
    """One prompt forward (prefill) of the default model in flash mode with the FFNs' prefill path forced or auto:
    its time and reads."""
    import flashllm_ext
    from flashllm_ext.predictor import load_predictors

    row = {
        "bench": "e2e_prefill",
        "model": DEFAULT_MODEL,
        "prefill": config["prefill"],
        "prompt_tokens": len(config["prompt_ids"]),
        "budget_mb": config["budget_bytes"] / 1e6,
    }
    try:
        model = flashllm_ext.load_flash(
            config["store"], config["budget_bytes"], mode="flash", predictors=load_predictors(config["predictors"])
        )
        for module in model.flash.modules:
            module.prefill = config["prefill"]
        with torch.inference_mode():
            start = time.perf_counter()
            model(torch.tensor([config["prompt_ids"]]), use_cache=True)
            elapsed = time.perf_counter() - start
    except Exception as e:  # the row says why
        return {**row, **error_fields(e)}
    s = model.flash.counters
    paths = {p: sum(m.prefill_paths[p] for m in model.flash.modules) for p in ("union", "sequential")}
    return {
        **row,
        "prefill_ms": elapsed * 1e3,
        "io_ms": s.io_s * 1e3,
        "compute_ms": s.compute_s * 1e3,
        "mem_ms": s.mem_s * 1e3,
        "bytes_read": s.bytes_read,
        "reads": s.n_reads,
        "mean_read_kib": s.bytes_read / max(1, s.n_reads) / 1024,
        "paths": paths,
    }


def run_prefill(args, baseline: int) -> list[dict]:
    """Union-of-active-sets prefill vs whole-layer sequential prefill vs the engine's auto choice, on the default
    model (flash mode, operating point (b) predictors, --budget), a prompt of --prompt-tokens held-out tokens; each in
    its own cgroup-limited process, rounds interleaved. The auto rows use the disk profile of $FLASHLLM_DISK_PROFILE
    (or the cache's disk.json), which --calibrate measures into a file of this benchmark's own."""
    from flashllm_ext.runtime import parse_budget
    from flashllm_ext.flash.store import FlashStore

    cache = resolve_cache_dir() / "e2e"
    store = default_store(cache, train_predictors=False)
    if args.calibrate:
        import os

        from flashllm_ext.flash.calibrate import calibrate_disk

        profile = calibrate_disk(cache, save=False)
        path = cache / "prefill-disk.json"
        path.write_text(
            json.dumps({"latency_s": profile.latency_s, "bandwidth_bps": profile.bandwidth_bps, "path": profile.path})
        )
        os.environ["FLASHLLM_DISK_PROFILE"] = str(path)  # the children inherit it
    ids, _ = prompt_ids(args.prompt_tokens, FlashStore(store).config["vocab_size"])
    base = {
        "prefill_bench": True,
        "mode": "flash",
        "store": str(store),
        "prompt_ids": ids,
        "budget_bytes": parse_budget(args.budget, model_bytes_of(store)),
        "predictors": str(trained_predictors(cache, (*LOWRANK_TRAINING, "--target-sparsity", str(TARGET_SPARSITY)))),
    }
    rows = []
    for round_index, path in [(r, p) for r in range(args.rounds) for p in ("union", "sequential", "auto")]:
        child_rows, facts = run_limited_child(
            _child_argv({**base, "prefill": path}),
            base["budget_bytes"],
            baseline,
            f"e2e-prefill-{path}",
            args.child_timeout,
        )
        row = {
            "prefill": path,
            **(child_rows[0] if child_rows else {"error": "the child printed no row"}),
            **facts,
            "round": round_index,
        }
        rows.append(row)
        emit([row], args.json, PREFILL_COLUMNS)
    return rows


# ----------------------------------------------------------------------------------------- the Endor store run


def endor_stores(cache: Path) -> tuple[dict[str, Path], list[float]]:
    """(store_format -> fp16 store of the Wanda-50%-pruned default model, the pruned model's per-layer thresholds at
    TARGET_SPARSITY on the calibration text); all cached."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flashllm_ext.flash.convert import convert
    from flashllm_ext.hub import corpus_token_ids
    from flashllm_ext.predictor import calibrate_thresholds
    from flashllm_ext.flash.store import FlashStore

    checkpoint = hf_checkpoint(cache, wanda_sparsity=0.5)
    stores = {}
    for fmt in ("dense", "endor"):
        path = cache / f"smollm2-135m-wanda50-{fmt}-fp16"
        try:
            FlashStore(path)
        except (OSError, FormatError):  # none yet, or written by an older format: (re)convert
            convert(checkpoint, path, dtype="fp16", endor=fmt == "endor", force=True)
        stores[fmt] = path
    cached = cache / f"smollm2-135m-wanda50-thresholds-{TARGET_SPARSITY:g}.pt"
    if not cached.is_file():
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        ids = corpus_token_ids(AutoTokenizer.from_pretrained(checkpoint), "calibration", max_tokens=2048)
        torch.save(calibrate_thresholds(model, ids, TARGET_SPARSITY), cached)
    return stores, torch.load(cached).tolist()


def run_endor(args, cache: Path) -> list[dict]:
    """Flash mode (true active sets) on the dense and the Endor store of the pruned model, round-robin, each in its
    own process."""
    from flashllm_ext.runtime import parse_budget
    from flashllm_ext.flash.store import FlashStore

    stores, thresholds = endor_stores(cache)
    baseline = measure_baseline(store=stores["dense"])  # the same model class for both
    total = model_bytes_of(stores["dense"])  # the same for both: an Endor model decompresses to the same bundles
    budget = parse_budget(args.budget, total)
    ids, prompt_note = prompt_ids(args.prompt_tokens, FlashStore(stores["dense"]).config["vocab_size"])
    rows = []
    for round_index, fmt in [(r, f) for r in range(args.rounds) for f in stores]:
        config = {
            "model": f"{DEFAULT_MODEL} Wanda 50%",
            "store": str(stores[fmt]),
            "store_format": fmt,
            "mode": "flash-oracle",
            "thresholds": thresholds,
            "budget_bytes": budget,
            "tokens": args.tokens,
            "prompt_ids": ids,
            "timeout_s": args.child_timeout,
            "reader_options": None if args.max_gap is None else {"max_gap": args.max_gap, "min_read": 0},
        }
        row = run_configuration(config, None if args.no_limit else baseline)
        if args.no_limit:
            row["cgroup_note"] = "--no-limit: the engine's budget applies, the cgroup only measures the peak"
        row.update(
            model_bytes_mb=total / 1e6,
            baseline_mb=baseline / 1e6,
            budget_spec=args.budget,
            prompt_tokens=len(ids),
            prompt_note=prompt_note,
            round=round_index,
            store_format=fmt,
            max_gap=args.max_gap,
        )
        row = {**{k: row.get(k) for k in KEYS}, **row}
        rows.append(row)
        emit([row], args.json, ENDOR_COLUMNS)
    medians = median_rows(rows, CONFIG_FIELDS, "e2e_median")
    by_format = {m["store_format"]: m for m in medians}
    if set(by_format) == {"dense", "endor"}:
        dense, comp = by_format["dense"], by_format["endor"]
        same = [r["generated"] for r in rows if r.get("generated")]
        medians.append(
            {
                "bench": "e2e_endor_ratio",
                "model": dense["model"],
                "budget_mb": budget / 1e6,
                "bytes_per_token_ratio": comp["bytes_per_token"] / dense["bytes_per_token"],
                "requested_bytes_ratio": comp["requested_bytes_per_token"] / dense["requested_bytes_per_token"],
                "ms_per_token_ratio": comp["ms_per_token"] / dense["ms_per_token"],
                "same_tokens": all(g == same[0] for g in same),
                "rounds": args.rounds,
            }
        )
    return medians


def main(argv: list[str] | None = None) -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--budget", default="50%", help="DRAM budget (of the model's bytes, or a size)")
    parser.add_argument(
        "--fallback-budget",
        default="75%",
        help="also run a mode at this budget when it fails in --budget (below the engine's minimum, or "
        "OOM-killed by the cgroup)",
    )
    parser.add_argument("--tokens", type=int, default=32, help="greedy decode tokens after the prompt")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--store",
        help="a flash store to run instead of the default model (its predictors, if any; accelerate needs --hf-dir)",
    )
    parser.add_argument("--hf-dir", help="Hugging Face checkpoint of --store for the accelerate peer")
    parser.add_argument("--child-timeout", type=float, default=900, help="seconds before a child is killed")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 tokens, 16-token prompt")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--scale", action="store_true", help="the 7B-scale FFN-stack rows instead (see run_scale)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model and its neuron caches live (cuda: the GPU)",
    )
    parser.add_argument(
        "--endor",
        action="store_true",
        help="flash mode on the Wanda-50%%-pruned default model's dense and Endor stores instead",
    )
    parser.add_argument(
        "--max-gap",
        type=int,
        help="--endor: the reader's coalescing gap in bytes, with no minimum "
        "read size (default: the reader's defaults)",
    )
    parser.add_argument(
        "--no-limit",
        action="store_true",
        help="--endor: measure each child's cgroup peak without enforcing baseline + budget",
    )
    parser.add_argument(
        "--scale-models", default=",".join(SCALE_MODELS), help="--scale: among " + ",".join(SCALE_MODELS)
    )
    parser.add_argument(
        "--scale-layers",
        type=int,
        help="--scale: the first that many layers of each model (a checkpoint of its own, written once): a shorter run",
    )
    parser.add_argument("--points", default=",".join(POINTS), help="--scale: operating points of the flash rows")
    parser.add_argument(
        "--scale-predictors",
        default=",".join(SCALE_PREDICTORS["a"]),
        help="--scale: predictor methods of the flash rows (SCALE_PREDICTORS)",
    )
    parser.add_argument("--prefill", action="store_true", help="union vs sequential vs auto prefill (default model)")
    parser.add_argument("--calibrate", action="store_true", help="--prefill: measure the disk profile auto uses")
    parser.add_argument("--full", action="store_true", help="--scale: whole-model rows too (load_flash)")
    parser.add_argument(
        "--full-only",
        action="store_true",
        help="--scale: whole-model rows only (load_flash; the accelerate peer on the checkpoint)",
    )
    parser.add_argument("--full-tokens", type=int, default=4, help="--scale --full: greedy decode tokens")
    parser.add_argument(
        "--flash-options",
        action="append",
        default=[],
        metavar="JSON",
        help="a flash row also with these load_flash keyword arguments (the default model's, or "
        "--scale --full's whole-model row), e.g. '{\"window\": 20}' or '{\"cache_layout\": "
        '"per-layer"}\' (repeatable)',
    )
    parser.add_argument(
        "--lookahead",
        default="",
        help="--scale --full: each whole-model flash row also with "
        "these look-ahead modes (ahead,prefetch: load_flash(lookahead=...))",
    )
    parser.set_defaults(rounds=3)
    args = parser.parse_args(argv)
    if args.child:
        config = json.loads(args.child)
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
        scale_ffn = config.get("scale") and not config.get("full")
        child = run_prefill_child if config.get("prefill_bench") else run_scale_child if scale_ffn else run_child
        print(json.dumps(child(config)), flush=True)
        return
    if args.quick:
        args.tokens, args.prompt_tokens, args.rounds = 4, 16, 1
    if args.smoke:  # the --scale rows at the smoke shapes (the default model has no smaller ones: --quick)
        args.scale, args.tokens, args.full_tokens, args.prompt_tokens = True, 2, 2, 4
        args.rounds, args.no_plot = 1, True
        if args.scale_predictors == parser.get_default("scale_predictors"):
            args.scale_predictors = "quant"  # calibrated, not trained: seconds
    from flashllm_ext.runtime import cuda_device

    try:
        cuda_device(args.device)
    except ValueError as e:
        parser.error(str(e))
    if args.prefill:
        rows = run_prefill(args, measure_baseline())
        if not args.json:
            print("\nmedians:")
        emit(
            [
                {
                    "prefill": p,
                    **{
                        k: statistics.median(r[k] for r in rows if r["prefill"] == p and not r.get("error"))
                        for k in ("prefill_ms", "io_ms", "compute_ms", "bytes_read", "reads", "mean_read_kib")
                    },
                }
                for p in ("union", "sequential", "auto")
                if any(r["prefill"] == p and not r.get("error") for r in rows)
            ],
            args.json,
            PREFILL_COLUMNS,
        )
        return
    if args.scale:
        medians = median_rows(run_scale(args), CONFIG_FIELDS, "e2e_median")
        emit(medians, args.json, SCALE_COLUMNS)
        if not args.no_plot:
            RESULTS.mkdir(exist_ok=True)
            for model in dict.fromkeys(r["model"] for r in medians):
                plot_breakdown(
                    [r for r in medians if r["model"] == model], RESULTS / f"e2e_scale_{model.split()[0]}_breakdown.png"
                )
        return
    from flashllm_ext.runtime import parse_budget

    cache = resolve_cache_dir() / "e2e"
    if args.endor:
        medians = run_endor(args, cache)
        if not args.json:
            print(f"\nmedians over {args.rounds} round(s):")
        emit(
            medians,
            args.json,
            ["bytes_per_token_ratio", "requested_bytes_ratio", "ms_per_token_ratio", "same_tokens"] + ENDOR_COLUMNS,
        )
        return
    modes = [m for m in args.modes.split(",") if m]
    store = Path(args.store) if args.store else default_store(cache, any(m.startswith("flash") for m in modes))
    hf_dir = (
        Path(args.hf_dir)
        if args.hf_dir
        else (hf_checkpoint(cache) if "accelerate" in modes and not args.store else None)
    )
    total = model_bytes_of(store)
    baseline = measure_baseline(args.device, store)
    from flashllm_ext.flash.store import FlashStore

    ids, prompt_note = prompt_ids(args.prompt_tokens, FlashStore(store).config["vocab_size"])
    base = {
        "model": DEFAULT_MODEL if not args.store else store.name,
        "device": args.device,
        "store": str(store),
        "tokens": args.tokens,
        "prompt_ids": ids,
        "timeout_s": args.child_timeout,
        "offload_dir": str(cache / "accelerate-offload"),
        "hf_dir": None if hf_dir is None else str(hf_dir),
    }
    rows = []
    jobs = [(m, {}) for m in modes] + [("flash", json.loads(o)) for o in args.flash_options if "flash" in modes]
    for round_index, (mode, options) in [(r, j) for r in range(args.rounds) for j in jobs]:  # round-robin
        budgets = [None] if mode == "dense" else [parse_budget(args.budget, total)]
        while budgets:
            budget = budgets.pop(0)
            if mode == "accelerate" and hf_dir is None:
                row = {
                    "bench": "e2e",
                    "model": base["model"],
                    "mode": mode,
                    "error": "no Hugging Face checkpoint of this store (--hf-dir): the accelerate peer cannot run",
                }
            else:
                row = run_configuration({**base, "mode": mode, "budget_bytes": budget, "options": options}, baseline)
            spec = (
                None
                if budget is None
                else args.budget
                if budget == parse_budget(args.budget, total)
                else args.fallback_budget
            )
            row.update(
                model_bytes_mb=total / 1e6,
                baseline_mb=baseline / 1e6,
                budget_spec=spec,
                prompt_tokens=len(ids),
                prompt_note=prompt_note,
                round=round_index,
                options=json.dumps(options) if options else None,
            )
            row = {**{k: row.get(k) for k in KEYS}, **row}
            rows.append(row)
            emit([row], args.json, COLUMNS)
            fallback = parse_budget(args.fallback_budget, total)
            if row.get("error") and budget is not None and budget < fallback:  # below the minimum, or OOM
                budgets.append(fallback)
    medians = median_rows(rows, CONFIG_FIELDS, "e2e_median")
    if not args.json:
        print(f"\nmedians over {args.rounds} round(s):")
    emit(medians, args.json, COLUMNS)
    if not args.no_plot:
        RESULTS.mkdir(exist_ok=True)
        plot_breakdown(medians, RESULTS / "e2e_breakdown.png")


if __name__ == "__main__":
    main()
