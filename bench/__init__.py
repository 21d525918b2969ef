"""The benchmarks, each run from the repository root as `python -m bench.<name>` (e.g. `python -m bench.bench_ffn`)."""
