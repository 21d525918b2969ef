"""The 7B-scale rows' active sets (bench_e2e_scale): the default model's sets on held-out text, true (flash-oracle)
or chosen by its predictors (flash), tiled onto the large layers and replayed by a predictor that pays for one of
the same method at the large shapes; and what a scale child runs with them: an FFN-stack row (run_scale_child) or a
whole-model row's load_flash (load_replayed, for bench/e2e_decode.py run_child).
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from pathlib import Path

import torch

from bench.common import device_name, error_fields
from bench.e2e_decode import _load

from flashllm_ext.predictor import NeuronPredictor


class ReplayedSets(NeuronPredictor):
    """A predictor that replays precomputed active sets (bool [tokens, layers, neurons]) for the token `at[0]`:
    the default model's sets on held-out text, tiled onto the larger layers.

    cost: a predictor of the method that chose the sets, at the large model's shapes (`scale_cost_predictor`): its
    memory is what this one holds (charged to the budget by the engine) and it scores every input (its answer
    discarded), so a row pays what a real predictor would at that size. Without one (the oracle), nothing.
    ahead_masks: the sets the predictors choose from the look-ahead input, replayed by predict_ahead (the engine's
    prefetch, load_flash(lookahead=...)); without them, predict's. frequency: the predictors' calibration
    frequencies tiled the same way ([layers, neurons]; the hot-cold layout pins by them), zeros without."""

    def __init__(
        self,
        masks: torch.Tensor,
        at: list[int],
        hidden_size: int,
        cost: NeuronPredictor | None = None,
        ahead_masks: torch.Tensor | None = None,
        frequency: torch.Tensor | None = None,
    ):
        super().__init__(masks.shape[1], hidden_size, masks.shape[2])  # thresholds 0 (ReLU: exact zeros only)
        self.masks, self.at, self.cost = masks, at, cost
        if frequency is not None:
            self.frequency.copy_(frequency)
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
    Low-rank ranks repeat the small model's per-layer ranks; quant takes the store's gate / activation / biases and,
    when the small one had column groups, the default group of the store's hidden size."""
    from flashllm_ext.flash.ffn import store_activation
    from flashllm_ext.predictor import load_predictors, predictor_class
    from flashllm_ext.predictor.quant import default_group_size

    small = load_predictors(predictors_path).config()
    config = {**small, "n_layers": store.n_layers, "hidden_size": store.hidden_size, "n_neurons": store.n_neurons}
    if "ranks" in small:
        config["ranks"] = [small["ranks"][i % len(small["ranks"])] for i in range(store.n_layers)]
    if small["method"] == "quant":
        if small.get("group_size") is not None:  # the default's "auto" group, chosen again for the large rows
            config["group_size"] = default_group_size(store.hidden_size)
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


def scale_frequency(config: dict, n_layers: int, n_neurons: int) -> torch.Tensor | None:
    """float [n_layers, n_neurons]: the default model's predictors' calibration frequencies (a flash row's
    config["predictors"]), tiled as their sets are; None without predictors (flash-oracle)."""
    from bench.traces import tile_layers
    from flashllm_ext.predictor import load_predictors

    if not config.get("predictors"):
        return None
    return tile_layers(load_predictors(config["predictors"]).frequency[None], n_layers, n_neurons)[0]


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


def replayed_predictors(config: dict, store, at: list[int], prompt_tokens: int) -> ReplayedSets:
    """The predictors of a flash row at scale (config: the row's mode, sparsity, predictors, tokens, lookahead): the
    tiled sets of the prompt and config["tokens"] decode tokens (and their look-ahead sets when the row reads ahead),
    paying for scale_cost_predictor of its predictors (none: the oracle), their frequencies tiled; `at`: the
    position whose sets the next call replays (the caller moves it)."""
    n_tokens = prompt_tokens + config["tokens"] + 1
    masks = scale_masks(config, n_tokens, store.n_layers, store.n_neurons, ahead=False)
    ahead = (
        scale_masks(config, n_tokens, store.n_layers, store.n_neurons, ahead=True) if config.get("lookahead") else None
    )
    cost = scale_cost_predictor(config["predictors"], store) if config.get("predictors") else None
    frequency = scale_frequency(config, store.n_layers, store.n_neurons)
    return ReplayedSets(masks, at, store.hidden_size, cost, ahead, frequency)


def load_replayed(config: dict):
    """(model, the reset function of its stats) of a whole-model scale row: the flash modes replay the tiled sets of
    the default model (ReplayedSets, paying for scale_cost_predictor); the other modes load as every row does."""
    import flashllm_ext
    from flashllm_ext.flash.store import FlashStore

    if not config["mode"].startswith("flash"):
        return _load(config)
    at = [0]
    predictors = replayed_predictors(config, FlashStore(config["store"]), at, len(config["prompt_ids"]))
    model = flashllm_ext.load_flash(
        config["store"],
        config["budget_bytes"],
        mode="flash",
        predictors=predictors,
        lookahead=config.get("lookahead"),
        **config.get("options", {}),
    )
    # The sets of the tokens at the positions this forward computes: after the cached ones.
    model.register_forward_pre_hook(partial(_track_position, at), with_kwargs=True)
    return model, model.flash.counters.reset


def _track_position(at: list[int], _module, _args, kwargs) -> None:
    past = kwargs.get("past_key_values")
    at[0] = 0 if past is None else past.get_seq_length()


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
        frequency = scale_frequency(config, store.n_layers, store.n_neurons)
        predictors = None if masks is None else ReplayedSets(masks, at, store.hidden_size, cost, frequency=frequency)
        runtime = ffn_stack(
            store,
            "flash" if predictors is not None else config["mode"],
            config["budget_bytes"],
            predictors=predictors,
            device=device,
            **config.get("options", {}),
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
            cache_layout=stats["cache_layout"],
            hot_fraction=stats["hot_fraction"],
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
