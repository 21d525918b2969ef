"""bench/bench_offload.py cannot rot: a quick run on a tiny pruned OPT checkpoint, each mode (accelerate included) in
its own memory cgroup, gives rows with the documented keys, the ratio row and the figure."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashllm_ext import endor
from tests.helpers.models import tiny_model

ROOT = Path(__file__).resolve().parents[2]
BENCH = [sys.executable, "-m", "bench.bench_offload"]  # run from ROOT, as a user does
KEYS = {
    "bench",
    "model",
    "mode",
    "device",
    "budget_mb",
    "cgroup_peak_mb",
    "ms_per_token",
    "read_ms",
    "decompress_ms",
    "compute_ms",
    "bytes_read_per_token",
    "layers_in_memory",
    "layers_on_ssd",
}


@pytest.mark.slow
def test_quick_run_reports_every_mode_with_its_keys(tmp_path):
    model = tiny_model(
        "opt", hidden_size=128, ffn_dim=512, num_hidden_layers=4, vocab_size=128, max_position_embeddings=128
    ).to(torch.float16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." in name and name.endswith(".weight") and p.dim() == 2:
                p.copy_(endor.prune(p, 0.5))
    model.save_pretrained(tmp_path / "hf")
    figure = tmp_path / "offload.png"
    out = subprocess.run(
        [
            *BENCH,
            "--hf-dir",
            str(tmp_path / "hf"),
            "--json",
            "--rounds",
            "1",
            "--tokens",
            "2",
            "--prompt-tokens",
            "4",
            "--budget",
            "80%",
            "--modes",
            "accelerate,dense,endor,endor+more-resident,q8,q4",
            "--figure",
            str(figure),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env={**os.environ, "FLASHLLM_CACHE": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    runs = {r["mode"]: r for r in rows if r["bench"] == "offload"}
    assert set(runs) == {"accelerate", "dense", "endor", "endor+more-resident", "q8", "q4"}
    for row in runs.values():
        assert KEYS <= row.keys() and row.get("error") is None, row.get("error")
        assert row["tokens"] == 2 and row["layers_in_memory"] + row["layers_on_ssd"] == 4
    # endor runs on dense's placement and reads its SSD layers compressed
    assert runs["endor"]["layers_in_memory"] == runs["dense"]["layers_in_memory"] < 4
    assert 0 < runs["endor"]["bytes_read_per_token"] < runs["dense"]["bytes_read_per_token"]
    assert runs["endor"]["generated"] == runs["dense"]["generated"]
    assert [runs[m]["slots"] for m in ("dense", "endor", "endor+more-resident")] == [2, 2, 2]  # --slots' default
    # the quantized stores: the same budget holds more of their layers, and a token reads fewer bytes
    assert runs["dense"]["layers_in_memory"] <= runs["q8"]["layers_in_memory"] <= runs["q4"]["layers_in_memory"]
    assert (
        runs["q4"]["bytes_read_per_token"] <= runs["q8"]["bytes_read_per_token"] < runs["dense"]["bytes_read_per_token"]
    )
    ratios = next(r for r in rows if r["bench"] == "offload_ratios")
    assert {"endor_vs_accelerate", "endor_vs_dense", "endor_bytes_vs_dense", "q4_bytes_vs_dense"} <= ratios.keys()
    assert figure.stat().st_size > 0


def test_an_unknown_mode_is_refused_naming_the_known_ones(tmp_path, capsys):
    from bench import bench_offload

    with pytest.raises(SystemExit) as e:
        bench_offload.main(["--hf-dir", str(tmp_path), "--modes", "dense,q5"])
    assert e.value.code == 2
    assert (
        "--modes: unknown ['q5'] (known: accelerate, dense, endor, endor+more-resident, q8, q4)"
        in capsys.readouterr().err
    )
