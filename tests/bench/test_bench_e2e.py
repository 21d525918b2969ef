"""The end-to-end benchmarks cannot rot: a quick run of bench/bench_e2e.py on a tiny random Llama store and one of
bench/bench_e2e_scale.py on tiny checkpoints, each mode in its own memory cgroup, give rows with the keys every row
carries (or an error row that says why)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashllm_ext.flash.convert import convert
from flashllm_ext.predictor import LowRankPredictor, PredictorSet, save_predictors_to_store
from tests.helpers.models import tiny_model

ROOT = Path(__file__).resolve().parents[2]
BENCH = [sys.executable, "-m", "bench.bench_e2e"]  # run from ROOT, as a user does
SCALE_BENCH = [sys.executable, "-m", "bench.bench_e2e_scale"]
KEYS = {
    "bench",
    "model",
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
    "oom_killed",
}


@pytest.mark.slow
def test_quick_run_reports_every_mode_with_its_keys(tmp_path):
    tiny_model("llama", max_position_embeddings=128).save_pretrained(tmp_path / "hf")
    path = convert(tmp_path / "hf", tmp_path / "store", dtype="fp16", progress=False)
    save_predictors_to_store(
        PredictorSet([LowRankPredictor(64, 160, 8) for _ in range(2)], torch.full((2,), 0.05)), path
    )
    modes = ["dense", "naive", "hybrid", "flash", "flash-oracle"]
    out = subprocess.run(
        [*BENCH, "--quick", "--json", "--no-plot", "--store", str(path), "--budget", "95%", "--modes", ",".join(modes)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    medians = [r for r in rows if r["bench"] == "e2e_median"]
    rows = [r for r in rows if r["bench"] == "e2e"]
    assert [r["mode"] for r in rows] == modes and [r["mode"] for r in medians] == modes
    for row in rows:
        assert KEYS <= row.keys(), KEYS - row.keys()
        assert row.get("error") is None, row["error"]
        assert row["tokens"] == 4 and row["ms_per_token"] > 0 and row["oom_killed"] is False
        assert row["proc_read_mb_per_token"] >= 0 and row["major_faults_per_token"] >= 0  # the kernel's count
        if row["cgroup_note"] is None and row["cgroup_limit_mb"] is not None:
            assert row["cgroup_peak_mb"] <= row["cgroup_limit_mb"]
    dense = rows[0]["generated"]
    assert all(r["generated"] == dense for r in rows if r["mode"] in ("naive", "hybrid"))  # same greedy tokens


@pytest.mark.slow
def test_scale_run_on_tiny_checkpoints_at_the_shared_paths(tmp_path):
    """bench_e2e_scale end to end (checkpoint -> store -> FFN-stack and whole-model rows in cgroups) on tiny
    checkpoints put where the shared 7B ones live, in a private cache; naive only (each row is a child process; the
    flash rows need the default model's trained predictors)."""
    from bench.synth_checkpoint import SHARED_DIRS, SMOKE_OVERRIDES, synthesize_checkpoint
    from flashllm_ext.flash.stack import store_ffn_bytes
    from flashllm_ext.flash.store import FlashStore

    for name, (directory, prune) in SHARED_DIRS.items():
        synthesize_checkpoint(
            name, tmp_path / "scale" / directory, prune=prune, overrides=SMOKE_OVERRIDES[name], progress=False
        )
    out = subprocess.run(
        [
            *SCALE_BENCH,
            "--json",
            "--no-plot",
            "--modes",
            "naive",
            "--tokens",
            "2",
            "--rounds",
            "1",
            "--full",
            "--full-tokens",
            "2",
            "--prompt-tokens",
            "4",
            "--budget",
            "300MB",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env={**os.environ, "FLASHLLM_CACHE": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    runs = [r for r in rows if r["bench"] == "e2e"]
    assert len(runs) == 2 * 2  # models x (FFN stack, whole model)
    for row in runs:
        assert KEYS <= row.keys() and row.get("error") is None, row.get("error")
        assert row["tokens"] == 2 and row["operating_point"] == "dense compute"
        if row["cgroup_note"] is None:
            assert row["cgroup_peak_mb"] <= row["cgroup_limit_mb"] and not row["oom_killed"]
        store = FlashStore(tmp_path / "scale" / f"{row['model'].split()[0]}-store")
        resident = sum(t.nbytes for t in store.resident().values())
        assert row["resident_mb"] * 1e6 == pytest.approx(resident) and row["model_budget_mb"] == 300
        if "FFN stack" in row["model"]:  # the FFNs get what the resident tensors leave of the model's budget
            assert row["budget_mb"] == pytest.approx(300 - resident / 1e6)
        assert row["bytes_per_token"] >= store_ffn_bytes(store)  # naive: every bundle, every token
    assert {r["model"].split(" (")[1] for r in runs} == {
        "synthesized checkpoint, FFN stack)",
        "synthesized checkpoint, whole model)",
    }


def test_scale_rows_pay_for_a_predictor_of_the_large_shapes(tmp_path, monkeypatch):
    """The scale rows replay the default model's sets but charge and run a predictor of the same method at the large
    store's shapes (scale_cost_predictor): its memory is the replayed predictor's, its scoring runs every call."""
    from flashllm_ext.predictor import QuantPredictor, load_predictors, save_predictors
    from flashllm_ext.flash.store import FlashStore

    from bench.e2e_replay import ReplayedSets, scale_cost_predictor

    small = tiny_model(
        "llama", hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_key_value_heads=4, vocab_size=64
    )
    tiny_model("opt", seed=None, hidden_size=64, ffn_dim=256, vocab_size=64).save_pretrained(tmp_path / "opt")
    store = FlashStore(convert(tmp_path / "opt", tmp_path / "store", dtype="fp16", progress=False))
    for trained in (
        QuantPredictor.from_model(small, gate_bits=4, up_bits=4),
        PredictorSet([LowRankPredictor(32, 48, r) for r in (2, 3, 4)], torch.zeros(3)),
    ):
        path = tmp_path / f"{trained.method}.safetensors"
        save_predictors(trained, path)
        cost = scale_cost_predictor(str(path), store)
        assert (cost.method, cost.n_layers, cost.hidden_size, cost.n_neurons) == (trained.method, 2, 64, 256)
        if cost.method == "quant":  # OPT: no gate, ReLU, an fc1 bias; the bits as trained
            assert (cost.glu, cost.activation, cost.up_bias, cost.up_bits) == (False, "relu", True, 4)
            assert cost.layers[0].up_codes.any()  # filled: resident pages, as trained codes would be
        else:
            assert cost.config()["ranks"] == [2, 3]
        assert cost.memory_bytes == type(cost).from_config(cost.config()).memory_bytes > 0
        masks = torch.rand(4, 2, 256) < 0.1
        frequency = masks.float().mean(dim=0)
        replayed = ReplayedSets(masks, [1], 64, cost, frequency=frequency)
        assert torch.equal(replayed.frequency, frequency)  # what the hot-cold layout pins by
        calls, scores = [], cost.scores  # recorded, and still run at the large shapes
        monkeypatch.setattr(cost, "scores", lambda layer, x: calls.append((layer, x.shape)) or scores(layer, x))
        assert torch.equal(replayed.predict(1, torch.randn(2, 64)), masks[1:3, 1])
        assert calls == [(1, (2, 64))] and replayed.memory_bytes == cost.memory_bytes
        assert load_predictors(path).memory_bytes < cost.memory_bytes
    assert ReplayedSets(masks, [0], 64).memory_bytes == 0  # the oracle's sets: nothing to pay


def test_scale_configs_expand_the_quant_family_at_point_a_only(monkeypatch):
    from bench.bench_e2e_scale import SCALE_CONFIGS, scale_configs

    flash = [
        (point, method) for mode, point, method in scale_configs(["quant", "quant:4/2", "lowrank"]) if mode == "flash"
    ]
    assert flash == [("a", "lowrank"), ("a", "quant"), ("a", "quant:4/2"), ("b", "quant")]
    assert [c for c in scale_configs([]) if c[2] is not None] == []
    assert [c for c in scale_configs([]) if c[0] != "flash"] == [c for c in SCALE_CONFIGS if c[0] != "flash"]


def test_prompt_of_a_synthesized_checkpoint_without_the_default_model(monkeypatch):
    # A machine with no network (the GPU image) cannot fetch the default model's tokenizer: a synthesized
    # checkpoint's benchmark decodes from seeded random ids and says so; every other caller still fails loudly.
    from bench import e2e_common

    import flashllm_ext.hub

    def offline(*args, **kwargs):
        raise RuntimeError("could not fetch the default model: no network")

    monkeypatch.setattr(flashllm_ext.hub, "fetch_default", offline)
    ids, note = e2e_common.prompt_ids(6, 50, synthesized=True)
    assert ids == e2e_common.prompt_ids(6, 50, synthesized=True)[0] and len(ids) == 6 and max(ids) < 50
    assert "seeded random token ids" in note and "no network" in note
    with pytest.raises(RuntimeError, match="could not fetch the default model"):
        e2e_common.prompt_ids(6, 50)


def test_decode_warms_up_untimed_and_counts_the_timed_tokens():
    """_decode(warmup=k): k decode tokens before the stats reset and the timing, then n timed ones; every token is
    generated greedily, as model.generate would."""
    from bench.e2e_decode import _decode

    model = tiny_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
    )
    forwards, reset_at = [], []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    prompt = torch.tensor([[3, 5, 7]])
    with torch.no_grad():
        times, tokens, storage = _decode(model, prompt, 3, lambda: reset_at.append(len(forwards)), warmup=2)
        assert len(times) == 3 and reset_at == [1 + 2] and len(forwards) == 1 + 2 + 3  # prefill, warm-up, timed
        want = model.generate(prompt, max_new_tokens=6, do_sample=False)[0, 3:].tolist()
    assert tokens == want and "proc_read_mb_per_token" in storage


def test_placed_scale_store_orders_each_layer_by_the_tiled_frequencies(tmp_path):
    """--placement frequency: the scale checkpoint converted once more, each layer's rows by descending frequency of
    the (small model's) predictors tiled onto its layers as their sets are; converted once, then reused."""
    from bench.bench_e2e_scale import placed_scale_store
    from bench.e2e_replay import scale_frequency
    from flashllm_ext.flash.store import FlashStore
    from flashllm_ext.predictor import QuantPredictor, save_predictors

    small = tiny_model(
        "llama", hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_key_value_heads=4, vocab_size=64
    )
    tiny_model("opt", seed=None, hidden_size=64, ffn_dim=256, vocab_size=64).save_pretrained(tmp_path / "tiny-hf")
    plain = Path(convert(tmp_path / "tiny-hf", tmp_path / "tiny-store", dtype="fp16", progress=False))
    predictors = QuantPredictor.from_model(small, gate_bits=4, up_bits=4)
    predictors.frequency.copy_(torch.rand(predictors.frequency.shape, generator=torch.Generator().manual_seed(0)))
    save_predictors(predictors, tmp_path / "predictors.safetensors")
    placed = placed_scale_store(plain, str(tmp_path / "predictors.safetensors"))
    assert placed == tmp_path / "tiny-placed-frequency-store"
    frequency = scale_frequency({"predictors": str(tmp_path / "predictors.safetensors")}, 2, 256)
    with FlashStore(placed) as store:
        assert store.neuron_order is not None
        for layer in range(2):
            in_rows = frequency[layer][store.neuron_order[layer]]
            assert bool((in_rows[1:] <= in_rows[:-1]).all())
    written = (placed / "bundles.safetensors").stat().st_mtime_ns
    assert placed_scale_store(plain, str(tmp_path / "predictors.safetensors")) == placed
    assert (placed / "bundles.safetensors").stat().st_mtime_ns == written  # reused, not converted again
