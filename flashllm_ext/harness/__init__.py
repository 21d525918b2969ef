"""What the demos and benchmarks measure with: memory cgroups, interleaved timing, tables."""
