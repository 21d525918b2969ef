"""`make demo` (flashllm_ext.demos.flash): one mode in a child process's code path on a tiny Llama store, and the
parent's cgroup harness (flashllm_ext.harness.cgroup) running such a child. The real default model's run is `make demo`."""

import json
import sys

import pytest
import torch

from flashllm_ext.harness.cgroup import run_limited_child
from flashllm_ext.flash.convert import convert
from flashllm_ext.demos.flash import run_mode
from flashllm_ext.predictor import DEFAULT_RECIPE, build_predictors, predictors_recipe, save_predictors_to_store
from tests.helpers.models import tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, fp32 store with the default recipe's predictors, q4 store with the same predictors)."""
    model = tiny_model("llama", max_position_embeddings=128)
    root = tmp_path_factory.mktemp("demo")
    model.save_pretrained(root / "hf")
    store = convert(root / "hf", root / "store", dtype="fp32", progress=False)
    quantized = convert(root / "hf", root / "store-q4", dtype="q4", progress=False)
    ids = torch.randint(0, 128, (256,), generator=torch.Generator().manual_seed(1))
    predictors = build_predictors(model, ids, window=128, progress=False)  # the default recipe
    for path in (store, quantized):
        save_predictors_to_store(predictors, path, DEFAULT_RECIPE)
    assert predictors_recipe(store) == DEFAULT_RECIPE  # what prepare_store checks before reusing them
    return model, store, quantized


def _config(store, mode: str, budget: int | None = None) -> dict:
    return {"store": str(store), "mode": mode, "budget_bytes": budget, "window": 3, "prompt": [5, 9, 17], "tokens": 6}


@pytest.mark.parametrize("mode", ["dense", "naive", "exact"])
def test_a_mode_generates_the_tokens_of_transformers(tiny, mode):
    model, store, _ = tiny
    row = run_mode(_config(store, mode))
    expected = model.generate(torch.tensor([[5, 9, 17]]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert row["ids"] == expected[0, 3:].tolist()
    assert row["ms/token"] > 0 and (mode == "dense") == ("io ms" not in row)


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "q4"])
def test_flash_mode_reports_its_breakdown_within_the_budget(tiny, quantized):
    _, store, q4_store = tiny
    row = run_mode(_config(q4_store if quantized else store, "flash", 2_000_000))
    assert len(row["ids"]) == 6 and row["accounted MB"] <= row["budget MB"] == 2.0
    assert row["MB read/token"] > 0 and row["reads/token"] > 0 and 0 <= row["hit rate"] <= 1
    assert row["predictor ms"] > 0


def test_a_child_runs_under_the_cgroup_harness(tiny):
    """The parent's path: the child prints its row as JSON; the harness reports the peak (or why it cannot)."""
    _, store, _ = tiny
    argv = [sys.executable, "-m", "flashllm_ext.demos.flash", "--child", json.dumps(_config(store, "naive"))]
    rows, facts = run_limited_child(argv, None, None, "demo-test", timeout_s=300)
    assert facts["exit_status"] == 0 and len(rows) == 1 and len(rows[0]["ids"]) == 6
    assert (facts["cgroup_peak_mb"] is None) == (facts["cgroup_note"] is not None)
