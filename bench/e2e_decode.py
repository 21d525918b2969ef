"""What a child of an end-to-end benchmark runs for one configuration of the whole model: load it (load_flash in a
mode, with the oracle's sets for flash-oracle, or the accelerate disk-offload peer), prefill the prompt, decode
greedily; the row of its time, its parts and its reads (run_child). bench_offload decodes with the same _decode.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import device_name, error_fields, process_memory

from flashllm_ext.predictor import NeuronPredictor
from flashllm_ext.flash.reader import FlashReader


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
        # In the model's neuron order, as every predictor answers (a placed store's rows are mapped by the engine)
        placed = store.neuron_order is not None
        row_of = torch.argsort(store.neuron_order, dim=1) if placed else None
        self.scoring_rows = [torch.empty((store.n_neurons, width), dtype=store.dtype) for _ in range(store.n_layers)]
        with FlashReader(store, threads=4) as reader:
            for i, rows in enumerate(self.scoring_rows):
                for part in torch.arange(store.n_neurons).split(256):
                    rows[part] = reader.read(i, row_of[i][part] if placed else part).data[:, :width]
        biases = [layer_input_bias(store, i) for i in range(store.n_layers)]
        self.biases = [b if b is None or not placed else b[row_of[i]] for i, b in enumerate(biases)]
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
    """timed_decode of a transformers model: the prompt [1, T] through its forward with a dynamic KV cache."""
    past = None

    def forward(ids: torch.Tensor) -> int:
        nonlocal past
        out = model(ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        return int(out.logits[0, -1].argmax())

    return timed_decode(
        lambda: forward(prompt), lambda token: forward(prompt.new_tensor([[token]])), n_tokens, reset_stats, warmup
    )


def timed_decode(
    prefill: Callable[[], int], step: Callable[[int], int], n_tokens: int, reset_stats, warmup: int = 0
) -> tuple[list[float], list[int], dict]:
    """Greedy decoding: prefill() -> the first token, then `warmup` untimed and n_tokens timed step(token) -> next
    token: (seconds per decode token, the tokens, the decode tokens' storage reads per token as the kernel counts
    them). reset_stats runs after the prefill and the warm-up so the engine's stats cover the timed decode tokens
    only. A token's time ends when its id is on the host (on a GPU, once its kernels have run). The kernel's count
    includes what the engine does not see: a file-backed page (a memory-mapped weight, accelerate's offloaded
    tensors) read again after the cgroup limit evicted it is a major fault and its bytes are storage reads."""
    tokens = [prefill()]
    for _ in range(warmup):
        tokens.append(step(tokens[-1]))
    reset_stats()
    read_before, faults_before = _storage_reads()
    times = []
    for _ in range(n_tokens):
        start = time.perf_counter()
        tokens.append(step(tokens[-1]))
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


def run_child(config: dict, load: Callable[[dict], tuple] = _load) -> dict:
    """One configuration, in this process: load (by `load`: (model, the reset function of its stats)), prefill,
    decode; the row (without the cgroup facts)."""
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
        model, reset_stats = load(config)
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
                    "hot_fraction",
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
