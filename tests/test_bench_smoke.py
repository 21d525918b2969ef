"""Every benchmark runs, every time: each `bench/bench_*.py` script in its smoke mode (`--smoke`: the smallest shapes,
one round, seconds), as a user runs it, so a benchmark cannot rot while the tests stay green. A new script is covered
by being added to bench/."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
# Their smoke runs are the steps of `.ci/gpu-checks --dry-run` (tests/test_gpu_checks.py), with the arguments a GPU
# run gives them: running them here again would only add minutes.
IN_GPU_CHECKS = {"bench_e2e.py", "bench_endor.py", "bench_ffn.py", "bench_offload.py"}
SCRIPTS = sorted(p.name for p in BENCH.glob("bench_*.py"))


def test_every_benchmark_is_covered():
    assert IN_GPU_CHECKS <= set(SCRIPTS), IN_GPU_CHECKS - set(SCRIPTS)
    gpu_checks = (BENCH.parent / ".ci" / "gpu-checks").read_text()
    assert all(f"bench/{name} --device $dev $smoke" in gpu_checks for name in IN_GPU_CHECKS)


@pytest.mark.slow
@pytest.mark.parametrize("script", [s for s in SCRIPTS if s not in IN_GPU_CHECKS])
def test_smoke_run_prints_rows(script, tmp_path):
    out = subprocess.run([sys.executable, str(BENCH / script), "--smoke", "--json"], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert rows, f"{script} --smoke printed no rows: {out.stdout[-1000:]}"
