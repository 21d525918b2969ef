"""bench_moe's accelerate peer: the checkpoint kept for it computes the model the expert store holds (the same greedy
tokens as the lean decoder's naive mode, with its own routers), offloading to disk what the budget does not hold."""

import pytest
import torch

from bench import bench_moe
from bench.e2e_common import prompt_ids


@pytest.fixture
def tiny_olmoe(tmp_path, monkeypatch):
    """(store, checkpoint) of a 2-layer smoke-shape OLMoE in a private cache, the checkpoint kept."""
    monkeypatch.setenv("FLASHLLM_CACHE", str(tmp_path))
    store, gguf, checkpoint = bench_moe.model_files("olmoe-1b-7b", 2, "fp16", smoke=True, gguf=False, checkpoint=True)
    assert gguf is None and (checkpoint / "config.json").is_file()
    return store, checkpoint


def test_accelerate_decodes_the_tokens_of_the_expert_store(tiny_olmoe, tmp_path):
    store, checkpoint = tiny_olmoe
    weights = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
    prompt, _ = prompt_ids(4, 100, synthesized=True)
    base = {"store": str(store), "prompt": prompt, "tokens": 6, "routing": "model"}
    naive = bench_moe.run_child({**base, "mode": "naive", "budget_bytes": None})
    offload = tmp_path / "offload"
    peer = bench_moe.run_child(
        {
            **base,
            "mode": "accelerate",
            "budget_bytes": weights // 2,
            "hf_dir": str(checkpoint),
            "offload_dir": str(offload),
        }
    )
    assert "error" not in peer, peer.get("error")
    assert peer["ids"] == naive["ids"] and len(peer["ids"]) == 7
    assert peer["ms_per_token"] > 0 and any(offload.iterdir())  # half the weights went to disk


def test_the_checkpoint_is_deleted_unless_kept(tiny_olmoe):
    store, checkpoint = tiny_olmoe
    again, _, none = bench_moe.model_files("olmoe-1b-7b", 2, "fp16", smoke=True, gguf=False)
    assert again == store and none is None and not checkpoint.exists()


def test_the_accelerate_probe_stops_after_the_imports(tiny_olmoe):
    _, checkpoint = tiny_olmoe
    assert bench_moe.run_child({"mode": "accelerate", "probe": True, "hf_dir": str(checkpoint)}) == {}
    assert torch.get_default_dtype() == torch.float32
