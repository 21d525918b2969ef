"""bench/bench_io.py Table 2 on a tiny synthesized store with given sets: every configuration of the table is
a row, each reads its own file copy, the order rotates per token, and the counts are the ones the sets imply."""

import argparse
import shutil
from pathlib import Path

import pytest
import torch

from bench import bench_io
from flashllm_ext.flash.convert import synthesize
from flashllm_ext.flash.store import FlashStore

LAYERS, D, NEURONS = 2, 64, 256


def _args(**kw) -> argparse.Namespace:
    base = dict(
        store=None,
        layers=None,
        tokens=12,
        documents=2,
        sparsity=0.97,
        naive_tokens=3,
        window=2,
        base_threads=2,
        max_threads=4,
        max_gap=None,
        remove_copies=True,
        json=True,
    )
    return argparse.Namespace(**{**base, **kw})


def _source(seed: int, density: float):
    def source(n_tokens, n_layers, n_neurons):
        return torch.rand(n_tokens, n_layers, n_neurons, generator=torch.Generator().manual_seed(seed)) < density

    return source


def test_token_order_rotates_every_configuration_through_every_position():
    n = 11
    orders = [bench_io.token_order(t, n) for t in range(n)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    for position in range(n):
        assert sorted(o[position] for o in orders) == list(range(n))


def test_aligned_buffer_is_page_aligned_and_touched():
    out = bench_io.aligned_buffer(3 * 4096 + 100)
    assert out.numel() == 3 * 4096 + 100 and out.data_ptr() % 4096 == 0 and bool((out == 1).all())


def test_configs_have_oracle_twins_and_separate_thread_and_coalescing_rows():
    configs = bench_io.table2_configs(8, 32)
    names = [c.name for c in configs]
    assert names[0].startswith("naive") and configs[0].sets == "all"
    assert "+ 32 threads" in names and "+ coalescing" in names
    threads_row = next(c for c in configs if c.name == "+ 32 threads")
    assert threads_row.threads == 32 and not threads_row.coalescing  # one technique per step
    for name in dict.fromkeys(names[1:]):
        assert sorted(c.sets for c in configs if c.name == name) == ["oracle", "predictor"]


@pytest.mark.parametrize("glu", [True, False])
def test_table2_rows_counts_and_copies(tmp_path, monkeypatch, glu):
    synthesize(tmp_path / "store", LAYERS, D, NEURONS, glu=glu)
    fs = FlashStore(tmp_path / "store")
    monkeypatch.setattr(bench_io, "CACHE", tmp_path / "copies")
    orders = []
    real_order = bench_io.token_order
    monkeypatch.setattr(bench_io, "token_order", lambda t, n: orders.append(real_order(t, n)) or orders[-1])
    sources = {"predictor": _source(0, 0.6), "oracle": _source(1, 0.1)}
    args = _args()
    rows = bench_io.table2(args, lambda row: None, sources, fs=fs, model_layers=30)

    configs = bench_io.table2_configs(args.base_threads, args.max_threads)
    assert [(r["config"], r["sets"]) for r in rows] == [(c.name, c.sets) for c in configs]
    n_tokens = 14  # 12 + window 2, in 2 documents of 7
    assert len(orders) == n_tokens - args.window and orders[0] != orders[1]
    assert len({r["file"] for r in rows}) == len(rows)  # each configuration its own copy...
    assert not any(Path(r["file"]).exists() for r in rows)  # ...removed at the end with --remove-copies
    parts = 3 if glu else 2
    for row, config in zip(rows, configs):
        assert row["unit"] == "per token over 2 of the model's 30 FFN layers" and row["io_ms_per_token"] > 0
        sets = sources[config.sets](n_tokens, LAYERS, NEURONS) if config.sets != "all" else None
        if sets is None:
            assert row["tokens"] == args.naive_tokens
            assert row["bytes_per_token"] == LAYERS * NEURONS * fs.row_bytes == row["analytic_bytes_per_token"]
            continue
        assert row["tokens"] == n_tokens - args.window
        read = sets.clone()
        if config.window:
            for t in range(1, n_tokens):
                read[t] &= ~sets[max(0, t - args.window) : t].any(0)
        active = int(read[args.window :].sum())
        assert row["analytic_bytes_per_token"] == active * fs.row_bytes / row["tokens"]
        if not config.coalescing:  # one read per requested row: a bundle, or each of its parts
            assert row["reads_per_token"] == active * (1 if config.bundled else parts) / row["tokens"]
        assert row["bytes_per_token"] >= row["analytic_bytes_per_token"]  # reads widened to 4 KiB blocks
    by = {(r["config"], r["sets"]): r for r in rows}
    assert by[("+ coalescing", "predictor")]["reads_per_token"] < by[("+ 4 threads", "predictor")]["reads_per_token"]
    assert by[("+ window", "predictor")]["read_density"] < by[("predictor-driven", "predictor")]["read_density"]


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (make deps installs it)")
def test_gaps_reads_every_set_at_every_gap_beside_fio(tmp_path):
    synthesize(tmp_path / "store", LAYERS, D, NEURONS, glu=True)
    fs = FlashStore(tmp_path / "store")
    sets = _source(0, 0.3)
    args = _args(tokens=3, repeats=2, seconds=0.05, gaps=[-1, 4096, 1 << 20], max_threads=4)
    rows = bench_io.gaps(args, lambda row: None, sets, fs=fs, model_layers=8)

    assert [r["kind"].split(" ")[0].rstrip(",:") for r in rows] == [
        "fio",
        "fio",
        "FlashReader",
        "FlashReader",
        "FlashReader",
        "bound",
    ]
    assert all(r["mbps"] > 0 for r in rows[:2]) and rows[0]["kind"].startswith("fio read ")
    exact, near, far = rows[2:5]
    active = sets(3, LAYERS, NEURONS)
    assert exact["reads_per_token"] == int(active.sum()) / 3  # one read per requested bundle
    assert exact["bytes_per_token"] >= int(active.sum()) * fs.row_bytes / 3
    assert far["reads_per_token"] <= near["reads_per_token"] <= exact["reads_per_token"]
    assert far["reads_per_token"] == LAYERS  # a whole small layer fits one read under a 1 MiB gap
    bound = rows[-1]
    assert len(bound["bound_runs"]) == 2 and bound["bound"] > 0
    assert bound["model_bytes"] == Path(fs.bundles_path).stat().st_size + (
        Path(fs.resident_path).stat().st_size if Path(fs.resident_path).is_file() else 0
    )
