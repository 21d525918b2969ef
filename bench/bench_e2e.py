"""End-to-end flash inference (issue 9): greedy decoding of the default model from a flash store under a DRAM
budget, each mode and the accelerate disk-offload peer in its own process inside a memory cgroup of that process's
baseline + the budget (page cache counted, dropped first; bench/common.py run_limited_child).

Modes: dense (reference, all in DRAM, no budget), naive, hybrid, flash (trained predictors), flash-oracle (the true
active sets of the one rule as the predictor: an upper bound), accelerate (transformers + accelerate device_map disk
offload, max_memory = the budget). Same prompt (held-out text), same number of greedy decode tokens; ms_per_token is
the median decode token after the prompt, the parts (io/mem/predictor/compute) are the engine's per-token means over
the decode tokens (stats reset after prefill); hidden_io_ms is the read time the engine overlapped with compute.
The configurations run round-robin for --rounds rounds (each in a fresh process); the summary rows
(bench:"e2e_median") are per-mode medians over the rounds, and ratios are taken between those medians.

    python bench/bench_e2e.py [--json] [--budget 50%] [--tokens 32] [--rounds 3] [--quick] [--store DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from common import arg_parser, emit, run_limited_child

from flashllm_ext.errors import FormatError
from flashllm_ext.paths import resolve_cache_dir
from flashllm_ext.predictor import DEFAULT_DENSITY, DEFAULT_METHOD, NeuronPredictor

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MODES = ("dense", "naive", "hybrid", "flash", "flash-oracle", "accelerate")
KEYS = ("bench", "model", "mode", "budget_mb", "cgroup_limit_mb", "cgroup_peak_mb", "ms_per_token", "io_ms", "mem_ms",
        "predictor_ms", "compute_ms", "hidden_io_ms", "bytes_per_token", "tokens", "hit_rate")
COLUMNS = ["mode", "budget_mb", "cgroup_limit_mb", "cgroup_peak_mb", "oom_killed", "ms_per_token", "io_ms", "mem_ms",
           "predictor_ms", "compute_ms", "bytes_per_token", "hit_rate", "error"]
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


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
        from flashllm_ext._ops import ACTIVATIONS
        from flashllm_ext.cache import layer_input_bias
        from flashllm_ext.ffn import store_activation

        width = (2 if store.glu else 1) * store.hidden_size  # a bundle is [up | gate | down] or [up | down]
        self.scoring_rows = [store.reader().read(i, torch.arange(store.n_neurons)).data[:, :width].contiguous()
                             for i in range(store.n_layers)]
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
        rows, d, xf = self.scoring_rows[layer].float(), self.d, x.float()
        pre = xf @ rows[:, d:2 * d].t() if self.glu else xf @ rows[:, :d].t()
        if self.biases[layer] is not None:
            pre += self.biases[layer].float()
        h = self.activation(pre)
        if self.glu:
            h = h * (xf @ rows[:, :d].t())
        return h.abs()


# ------------------------------------------------------------------------------------------- the child runs

def prompt_ids(n_prompt: int, vocab_size: int) -> tuple[list[int], str | None]:
    """The prompt every configuration decodes from: the first n_prompt tokens of the held-out text (the default
    model's tokenizer), and a note when a smaller vocabulary (a tiny test store) forces folding them into it."""
    from transformers import AutoTokenizer

    from flashllm_ext.models import corpus_token_ids, fetch_default

    gguf = fetch_default()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    ids = corpus_token_ids(tokenizer, "heldout", max_tokens=n_prompt)
    if int(ids.max()) < vocab_size:
        return ids.tolist(), None
    return (ids % vocab_size).tolist(), f"held-out token ids folded modulo the store's vocabulary of {vocab_size}"


@torch.inference_mode()
def _decode(model, prompt: torch.Tensor, n_tokens: int, reset_stats) -> tuple[list[float], list[int]]:
    """Greedy decoding after a prefill of `prompt`: (seconds per decode token, the tokens). reset_stats runs after
    the prefill so the engine's stats cover the decode tokens only."""
    out = model(prompt, use_cache=True)
    past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    reset_stats()
    times, tokens = [], [int(token)]
    for _ in range(n_tokens):
        start = time.perf_counter()
        out = model(token, past_key_values=past, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - start)
        tokens.append(int(token))
    return times, tokens


def _load(config: dict):
    """(model, the reset function of its stats) for one configuration of the child."""
    import flashllm_ext
    from flashllm_ext.predictor import load_predictors
    from flashllm_ext.store import FlashStore

    mode, budget = config["mode"], config["budget_bytes"]
    if mode == "accelerate":
        from transformers import AutoModelForCausalLM

        offload = Path(config["offload_dir"])
        offload.mkdir(parents=True, exist_ok=True)
        model = AutoModelForCausalLM.from_pretrained(config["hf_dir"], dtype=torch.float16, device_map="auto",
                                                     max_memory={"cpu": budget}, offload_folder=str(offload),
                                                     offload_state_dict=True).eval()
        return model, lambda: None
    if mode == "dense":
        return flashllm_ext.load_flash(config["store"], None, mode="dense"), lambda: None
    predictors = None
    if mode == "flash-oracle":
        store = FlashStore(config["store"])
        trained = load_predictors(store.path)  # the oracle at the trained predictors' loaded density
        predictors = OraclePredictors(store, trained.true_thresholds if trained.true_thresholds.any() else
                                      trained.thresholds)
    model = flashllm_ext.load_flash(config["store"], budget, mode="flash" if mode == "flash-oracle" else mode,
                                    predictors=predictors)
    return model, model.flash.stats.reset


def run_child(config: dict) -> dict:
    """One configuration, in this process: load, prefill, decode; the row (without the cgroup facts)."""
    row = {"bench": "e2e", "model": config["model"], "mode": config["mode"],
           "budget_mb": None if config["budget_bytes"] is None else config["budget_bytes"] / 1e6}
    try:
        model, reset_stats = _load(config)
        times, tokens = _decode(model, torch.tensor([config["prompt_ids"]]), config["tokens"], reset_stats)
    except Exception as e:  # the row says why this configuration could not run
        return {**row, "error": f"{type(e).__name__}: {e}"}
    row.update(ms_per_token=statistics.median(times) * 1e3, mean_ms_per_token=statistics.mean(times) * 1e3,
               tokens=len(times), generated=tokens)
    stats = model.flash_stats() if getattr(model, "flash", None) is not None else None
    if stats is not None:
        row.update({k: stats[k] for k in ("io_ms", "hidden_io_ms", "mem_ms", "predictor_ms", "compute_ms",
                                          "bytes_per_token", "hit_rate", "accounted_bytes")})
    else:  # dense / accelerate: no engine stats; the whole decode time is compute (accelerate's reads included)
        row.update(io_ms=None, mem_ms=None, predictor_ms=None, compute_ms=None, bytes_per_token=0 if
                   config["mode"] == "dense" else None, hit_rate=None)
    return row


# ------------------------------------------------------------------------------------------------- the parent

def default_store(cache: Path, train_predictors: bool = True) -> Path:
    """The default model converted to an fp16 store (cached), with trained predictors (trained once: minutes)."""
    import subprocess

    from flashllm_ext.convert import convert
    from flashllm_ext.models import fetch_default
    from flashllm_ext.predictor import load_predictors
    from flashllm_ext.store import FlashStore

    path = cache / "smollm2-135m-fp16"
    try:
        FlashStore(path)
    except (OSError, FormatError):  # none yet, or written by an older format: (re)convert
        convert(fetch_default(), path, dtype="fp16", force=True)
    if train_predictors:
        try:
            load_predictors(path)
        except Exception:  # none yet: `flashllm train-predictors` writes them into the store
            subprocess.run([sys.executable, "-m", "flashllm_ext.cli", "train-predictors", "default", "--store",
                            str(path)], check=True)  # the default method and density (BENCHMARKS.md, issue 10)
    return path


def hf_checkpoint(cache: Path) -> Path:
    """The default model as a Hugging Face fp16 safetensors directory (accelerate's input), saved once."""
    from flashllm_ext.models import load_hf_model

    path = cache / "smollm2-135m-hf-fp16"
    if not (path / "config.json").is_file():
        from transformers import AutoModelForCausalLM

        gguf_model, tokenizer = load_hf_model()
        # transformers refuses to serialise a model loaded from GGUF: copy its weights into a plain one.
        config = gguf_model.config
        config.__dict__.pop("quantization_config", None)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
        model.load_state_dict(gguf_model.state_dict())
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


def _child_argv(config: dict) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(config)]


def measure_baseline(timeout_s: float = 600) -> int:
    """Bytes a child holds before loading a model: python + torch + transformers + flashllm_ext imported (page cache
    of their files counted), the peak of an unlimited probe child's cgroup."""
    rows, facts = run_limited_child(_child_argv({"mode": "probe"}), None, None, "e2e-probe", timeout_s)
    if facts["cgroup_peak_mb"] is None:
        raise RuntimeError(f"no cgroup to measure the baseline: {facts['cgroup_note']}")
    return int(facts["cgroup_peak_mb"] * 1e6)


def oracle_bytes(store_path: Path) -> int:
    """What OraclePredictors holds outside the budget: [up | gate] (or up) of every layer."""
    from flashllm_ext.store import FlashStore

    store = FlashStore(store_path)
    return store.n_layers * store.n_neurons * (2 if store.glu else 1) * store.hidden_size * store.dtype.itemsize


def run_configuration(config: dict, baseline: int | None) -> dict:
    budget = config["budget_bytes"]
    extra = oracle_bytes(Path(config["store"])) if config["mode"] == "flash-oracle" else 0
    rows, facts = run_limited_child(_child_argv(config), None if budget is None else budget + extra, baseline,
                                    f"e2e-{config['mode']}", config.get("timeout_s", 1800))
    if extra:
        facts["oracle_mb"] = extra / 1e6
    # A killed child prints no row of its own: the harness's error row then stands for it.
    row = {"bench": "e2e", "model": config["model"], "mode": config["mode"],
           "budget_mb": None if config["budget_bytes"] is None else config["budget_bytes"] / 1e6,
           **(rows[0] if rows else {"error": "the child printed no row"})}
    if len(rows) > 1 and not row.get("error"):
        row["error"] = rows[-1].get("error")
    row.update(facts)
    if config["budget_bytes"] is None and facts["cgroup_note"] is None:
        row["cgroup_note"] = "no budget (dense reference): peak measured, no limit"
    return row


def model_bytes_of(store_path: Path) -> int:
    """Resident tensors (without predictors) + every FFN bundle of the store: what '50%' is a share of."""
    from safetensors import safe_open

    from flashllm_ext.engine import store_ffn_bytes
    from flashllm_ext.store import FlashStore

    store = FlashStore(store_path)
    with safe_open(store.resident_path, framework="pt") as f:
        resident = sum(math.prod(f.get_slice(n).get_shape()) * store.dtype.itemsize
                       for n in f.keys() if not n.startswith("predictor."))
    return resident + store_ffn_bytes(store)


def plot_breakdown(rows: list[dict], path: Path) -> None:
    """Stacked per-token bars (io / mem / predictor / compute) per mode; rows without parts show their total."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("ms_per_token") is not None]
    labels = [f"{r['mode']}\n{r['budget_mb']:.0f} MB" if r.get("budget_mb") else r["mode"] for r in rows]
    fig, ax = plt.subplots(figsize=(1.3 * len(rows) + 2, 4))
    bottom = [0.0] * len(rows)
    for part in ("io_ms", "mem_ms", "predictor_ms", "compute_ms"):
        values = [r.get(part) or 0.0 for r in rows]
        if part == "compute_ms":  # no engine stats (dense, accelerate): the whole decode time
            values = [r.get(part) if r.get("io_ms") is not None else r["ms_per_token"] for r in rows]
        ax.bar(labels, values, bottom=bottom, label=part.removesuffix("_ms"))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.plot(labels, [r["ms_per_token"] for r in rows], "k_", markersize=20, label="measured ms/token (median)")
    ax.set_ylabel("ms per decode token")
    ax.set_title(f"{rows[0]['model'] if rows else ''}: per-token breakdown")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------- the scale run

SCALE_SHAPE = {"name": "opt-6.7b-ffn", "layers": 32, "hidden": 4096, "neurons": 16384}  # OPT-6.7B's FFN stack
SCALE_MODES = ("naive", "hybrid", "flash-oracle", "flash")


class ReplayedSets(NeuronPredictor):
    """A predictor that replays precomputed active sets (bool [tokens, layers, neurons]) for the token `at[0]`:
    the default model's sets on held-out text, tiled onto the larger layers. Holds no weights (masks are counted
    by nobody: a real predictor's memory is not part of these rows)."""

    def __init__(self, masks: torch.Tensor, at: list[int], hidden_size: int):
        super().__init__(masks.shape[1], hidden_size, masks.shape[2])  # thresholds 0 (ReLU: exact zeros only)
        self.masks, self.at = masks, at

    @property
    def memory_bytes(self) -> int:
        return 0

    def predict(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.masks[self.at[0]:self.at[0] + x.shape[0], layer]


def scale_masks(config: dict, n_layers: int, n_neurons: int) -> torch.Tensor:
    """bool [tokens, layers, neurons] for the scale run: the true sets of the default model at the threshold
    sparsity (flash-oracle), or the sets its trained predictors choose on the same tokens (flash), tiled. Computed
    by the parent (it loads the default model, which a limited child has no room for), cached in a file."""
    from traces import default_model_masks, tile_masks

    n_tokens, sparsity = config["tokens"] + 1, config["sparsity"]
    cached = resolve_cache_dir() / "e2e" / f"scale-sets-{config['mode']}-{sparsity:g}-{n_tokens}tok.pt"
    if cached.is_file():
        return tile_masks(torch.load(cached), n_layers, n_neurons)
    if config["mode"] == "flash-oracle":
        small = default_model_masks(max(n_tokens, 64), sparsity, progress=False)[:n_tokens]
    else:  # the trained predictors' choices on the held-out tokens
        from flashllm_ext.models import corpus_token_ids, load_hf_model
        from flashllm_ext.predictor import capture_activations, load_predictors

        predictors = load_predictors(config["predictor_store"])
        model, tokenizer = load_hf_model()
        ids = corpus_token_ids(tokenizer, "heldout", max_tokens=n_tokens)
        capture = capture_activations(model, ids, predictors.thresholds, progress=False)
        small = torch.stack([predictors.predict(i, capture.inputs[i].float()) for i in range(len(capture.inputs))],
                            dim=1)
        del model
    torch.save(small, cached)
    return tile_masks(small, n_layers, n_neurons)


def run_scale_child(config: dict) -> dict:
    """FFN-only decoding of the scale store: per token, every layer's FFN on a fresh random hidden state."""
    from flashllm_ext.engine import ffn_stack
    from flashllm_ext.store import FlashStore

    row = {"bench": "e2e", "model": SCALE_SHAPE["name"] + " (synthetic weights, FFN only)", "mode": config["mode"],
           "operating_point": config["operating_point"], "budget_mb": config["budget_bytes"] / 1e6}
    try:
        store, at = FlashStore(config["store"]), [0]
        masks = scale_masks(config, store.n_layers, store.n_neurons) if config["mode"].startswith("flash") else None
        predictors = None if masks is None else ReplayedSets(masks, at, store.hidden_size)
        runtime = ffn_stack(store, "flash" if predictors is not None else config["mode"], config["budget_bytes"],
                            predictors=predictors)
        generator = torch.Generator().manual_seed(0)
        times = []
        with torch.inference_mode():
            for token in range(config["tokens"] + 1):  # token 0 warms the cache up: not timed
                at[0] = token
                xs = [torch.randn(1, store.hidden_size, generator=generator).to(store.dtype)
                      for _ in runtime.modules]
                if token == 1:
                    runtime.stats.reset()
                start = time.perf_counter()
                for module, x in zip(runtime.modules, xs):
                    module(x)
                if token:
                    times.append(time.perf_counter() - start)
        stats = runtime.flash_stats()
        per = 1e3 / len(times)  # the stats cover the timed tokens: per-token milliseconds
        row.update(ms_per_token=statistics.median(times) * 1e3, tokens=len(times),
                   bytes_per_token=stats["bytes_read"] / len(times), hit_rate=stats["hit_rate"],
                   accounted_bytes=stats["accounted_bytes"],
                   **{k: getattr(runtime.stats, k.removesuffix("_ms") + "_s") * per
                      for k in ("io_ms", "hidden_io_ms", "mem_ms", "predictor_ms", "compute_ms")})
        if masks is not None:
            row["loaded_density"] = masks[1:].float().mean().item()
        runtime.close()
    except Exception as e:  # the row says why
        row["error"] = f"{type(e).__name__}: {e}"
    return row


def run_scale(args, baseline: int) -> list[dict]:
    """The scale rows: OPT-6.7B's FFN shapes (synthetic weights, a store written once), 50% of the FFN bytes."""
    from flashllm_ext.convert import synthesize
    from flashllm_ext.engine import parse_budget, store_ffn_bytes
    from flashllm_ext.store import FlashStore

    path = resolve_cache_dir() / "e2e" / SCALE_SHAPE["name"]
    try:
        FlashStore(path)
    except (OSError, FormatError):
        print(f"writing the synthetic {SCALE_SHAPE['name']} store at {path} (once)", file=sys.stderr)
        synthesize(path, SCALE_SHAPE["layers"], SCALE_SHAPE["hidden"], SCALE_SHAPE["neurons"], glu=False)
    budget = parse_budget(args.budget, store_ffn_bytes(FlashStore(path)))
    points = [("a: threshold sparsity 0.97 (OPT-like), true sets", "flash-oracle", 0.97),
              (f"b: trained predictors ({DEFAULT_METHOD}, loaded density {DEFAULT_DENSITY})", "flash",
               1.0 - DEFAULT_DENSITY)]
    configs = [{"mode": m, "operating_point": "dense compute", "sparsity": None} for m in ("naive", "hybrid")]
    configs += [{"mode": m, "operating_point": point, "sparsity": s} for point, m, s in points]
    configs = [c for c in configs if c["mode"] in args.modes.split(",")]
    base = {"scale": True, "store": str(path), "budget_bytes": budget, "tokens": args.tokens,
            "predictor_store": str(default_store(resolve_cache_dir() / "e2e"))}
    for config in configs:  # the sets, computed here: the children are limited to the budget
        if config["mode"].startswith("flash"):
            scale_masks({**base, **config}, 1, 1)
    rows = []
    for round_index, config in [(r, c) for r in range(args.rounds) for c in configs]:
        config = {**base, **config}
        child_rows, facts = run_limited_child(_child_argv(config), budget, baseline, f"e2e-scale-{config['mode']}",
                                              args.child_timeout)
        row = {**(child_rows[0] if child_rows else {"mode": config["mode"], "error": "the child printed no row"}),
               **facts, "round": round_index, "budget_spec": args.budget}
        row = {**{k: row.get(k) for k in KEYS}, **row}
        rows.append(row)
        emit([row], args.json, COLUMNS)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--budget", default="50%", help="DRAM budget (of the model's bytes, or a size)")
    parser.add_argument("--fallback-budget", default="75%",
                        help="also run a mode at this budget when it fails in --budget (below the engine's minimum, or "
                             "OOM-killed by the cgroup)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy decode tokens after the prompt")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--store", help="a flash store to run instead of the default model (its predictors, if "
                                        "any; accelerate needs --hf-dir)")
    parser.add_argument("--hf-dir", help="Hugging Face checkpoint of --store for the accelerate peer")
    parser.add_argument("--child-timeout", type=float, default=900, help="seconds before a child is killed")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 tokens, 16-token prompt")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--scale", action="store_true", help="the OPT-6.7B-shaped FFN-only rows instead (FFN budget)")
    parser.set_defaults(rounds=3)
    args = parser.parse_args(argv)
    if args.child:
        config = json.loads(args.child)
        if config["mode"] == "probe":
            import flashllm_ext  # noqa: F401  (what every child imports before loading its model)
            import transformers  # noqa: F401
            print(json.dumps({"probe": True}))
            return
        print(json.dumps(run_scale_child(config) if config.get("scale") else run_child(config)), flush=True)
        return
    if args.quick:
        args.tokens, args.prompt_tokens, args.rounds = 4, 16, 1
    if args.scale:
        medians = median_rows(run_scale(args, measure_baseline()))
        emit(medians, args.json, COLUMNS)
        if not args.no_plot:
            RESULTS.mkdir(exist_ok=True)
            plot_breakdown(medians, RESULTS / "e2e_scale_breakdown.png")
        return
    from flashllm_ext.engine import parse_budget

    cache = resolve_cache_dir() / "e2e"
    modes = [m for m in args.modes.split(",") if m]
    store = Path(args.store) if args.store else default_store(cache, any(m.startswith("flash") for m in modes))
    hf_dir = Path(args.hf_dir) if args.hf_dir else (hf_checkpoint(cache) if "accelerate" in modes and
                                                    not args.store else None)
    total = model_bytes_of(store)
    baseline = measure_baseline()
    from flashllm_ext.store import FlashStore

    ids, prompt_note = prompt_ids(args.prompt_tokens, FlashStore(store).config["vocab_size"])
    base = {"model": DEFAULT_MODEL if not args.store else store.name, "store": str(store), "tokens": args.tokens,
            "prompt_ids": ids, "timeout_s": args.child_timeout, "offload_dir": str(cache / "accelerate-offload"),
            "hf_dir": None if hf_dir is None else str(hf_dir)}
    rows = []
    for round_index, mode in [(r, m) for r in range(args.rounds) for m in modes]:  # round-robin over processes
        budgets = [None] if mode == "dense" else [parse_budget(args.budget, total)]
        while budgets:
            budget = budgets.pop(0)
            if mode == "accelerate" and hf_dir is None:
                row = {"bench": "e2e", "model": base["model"], "mode": mode, "error": "no Hugging Face checkpoint "
                       "of this store (--hf-dir): the accelerate peer cannot run"}
            else:
                row = run_configuration({**base, "mode": mode, "budget_bytes": budget}, baseline)
            spec = None if budget is None else args.budget if budget == parse_budget(args.budget, total) else \
                args.fallback_budget
            row.update(model_bytes_mb=total / 1e6, baseline_mb=baseline / 1e6, budget_spec=spec,
                       prompt_tokens=len(ids), prompt_note=prompt_note, round=round_index)
            row = {**{k: row.get(k) for k in KEYS}, **row}
            rows.append(row)
            emit([row], args.json, COLUMNS)
            fallback = parse_budget(args.fallback_budget, total)
            if row.get("error") and budget is not None and budget < fallback:  # below the minimum, or OOM
                budgets.append(fallback)
    medians = median_rows(rows)
    if not args.json:
        print(f"\nmedians over {args.rounds} round(s):")
    emit(medians, args.json, COLUMNS)
    if not args.no_plot:
        RESULTS.mkdir(exist_ok=True)
        plot_breakdown(medians, RESULTS / "e2e_breakdown.png")


def median_rows(rows: list[dict]) -> list[dict]:
    """One bench:"e2e_median" row per (mode, budget) that ran without error: the median of every number."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if not row.get("error"):
            groups.setdefault((row["mode"], row.get("budget_spec")), []).append(row)
    out = []
    for (mode, spec), group in groups.items():
        numbers = {k for r in group for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        median = {k: statistics.median(r[k] for r in group if r.get(k) is not None) for k in numbers
                  if any(r.get(k) is not None for r in group)}
        out.append({**group[0], **median, "bench": "e2e_median", "rounds": len(group),
                    "oom_killed": any(r.get("oom_killed") for r in group)})
    return out


if __name__ == "__main__":
    main()
