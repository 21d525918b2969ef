"""Every benchmark runs, every time: each `bench/bench_*.py` module in its smoke mode (`--smoke`: the smallest shapes,
one round, seconds), as a user runs it (`python -m bench.bench_x`), so a benchmark cannot rot while the tests stay
green. A new benchmark is covered by being added to bench/."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
# Their smoke runs are the steps of `.ci/gpu-checks --dry-run` (tests/bench/test_gpu_checks.py), with the arguments a
# GPU run gives them: running them here again would only add minutes.
IN_GPU_CHECKS = {"bench_e2e_scale", "bench_endor", "bench_ffn", "bench_offload"}
MODULES = sorted(p.stem for p in BENCH.glob("bench_*.py"))
# Rows that say why a configuration cannot run at smoke sizes, by the words of their error: the oracle predictor holds
# every W_up / W_gate row, more than bench_predictor's smoke budget. Any other error row fails the run.
EXPECTED_ERRORS = {"bench_predictor": "below the minimum"}


def test_every_benchmark_is_covered():
    assert IN_GPU_CHECKS <= set(MODULES), IN_GPU_CHECKS - set(MODULES)
    gpu_checks = (ROOT / ".ci" / "gpu-checks").read_text()
    assert all(f"python3 -m bench.{name} --device $dev $smoke" in gpu_checks for name in IN_GPU_CHECKS)


@pytest.mark.slow
@pytest.mark.parametrize("module", [m for m in MODULES if m not in IN_GPU_CHECKS])
def test_smoke_run_prints_rows(module, tmp_path):
    # Run from an empty folder (what a run writes to its working directory lands there): the checkout is importable
    # through PYTHONPATH instead of the working directory.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", "--smoke", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert rows, f"bench.{module} --smoke printed no rows: {out.stdout[-1000:]}"
    # Every row can be traced to the code, the time, the machine and the device that produced it.
    missing = [
        (i, key) for i, row in enumerate(rows) for key in ("commit", "date", "host", "device") if not row.get(key)
    ]
    assert not missing, f"bench.{module} rows without provenance (row, key): {missing[:5]}"
    expected = EXPECTED_ERRORS.get(module)
    errors = [r["error"] for r in rows if r.get("error") and (expected is None or expected not in r["error"])]
    assert not errors, f"bench.{module} --smoke rows with errors: {errors[:3]}"
