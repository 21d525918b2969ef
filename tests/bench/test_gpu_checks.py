""".ci/gpu-checks, what a lent GPU runs in its few minutes, proven here first: its dry run takes every step on the
CPU at smoke shapes, so a step broken since the last GPU fails here, not in the window."""

import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "gpu-checks"
STEPS = ["tests", "qffn", "e2e_flash", "endor", "offload_30", "offload_50", "ffn"]


@pytest.mark.slow
def test_dry_run_runs_every_step_and_each_writes_rows_without_errors(tmp_path):
    out = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "OUT": str(tmp_path), "GPU_CHECKS_SECONDS": "1200"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    finished = dict(re.findall(r"^== (\w+): rc (\d+) in", out.stdout, re.M))
    assert list(finished) == STEPS and set(finished.values()) == {"0"}, out.stdout[-3000:]
    with tarfile.open(tmp_path / "logs.tgz") as logs:
        assert {f"./{step}.log" for step in STEPS} <= set(logs.getnames())
    assert len(list(tmp_path.iterdir())) <= 8  # what a device call brings back of $OUT
    results = sorted(tmp_path.glob("*.jsonl"))
    assert {p.name for p in results} == {
        "bench_e2e_flash_cpu.jsonl",
        "bench_ffn_cpu.jsonl",
        "bench_qffn_cpu.jsonl",
        "bench_endor_cpu.jsonl",
        "bench_offload_cpu_30.jsonl",
        "bench_offload_cpu_50.jsonl",
    }
    for path in results:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert rows, f"{path.name}: no rows"
        assert [r for r in rows if r.get("error")] == [], path.name
        assert all(r["device"].startswith("cpu") for r in rows if "device" in r), path.name
    e2e = [json.loads(line) for line in (tmp_path / "bench_e2e_flash_cpu.jsonl").read_text().splitlines()]
    assert {r["mode"] for r in e2e if r["bench"] == "e2e"} == {"naive", "hybrid", "flash-oracle", "flash"}
    offload = [json.loads(line) for line in (tmp_path / "bench_offload_cpu_30.jsonl").read_text().splitlines()]
    modes = [r["mode"] for r in offload if r["bench"] == "offload"]
    assert sorted(modes) == ["accelerate", "dense", "endor", "endor+more-resident"]  # one slot count: the default
    assert len([r for r in offload if r["bench"] == "offload_ratios"]) == 1


def test_unknown_option_is_refused():
    out = subprocess.run(["bash", str(SCRIPT), "--dryrun"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "usage" in out.stderr
