"""Benchmarks: one module per scenario, each run as `python -m benchmarks.<name>` (serve, engine,
core, settings, interference, chunking, repeat, paired, compare, cluster, prefix, preemption,
structured, neighbor, replicas, guidellm_pairs), on the shared pieces in `harness/`;
`tools/` measures llama.cpp itself. What each measures: docs/benchmarks.md."""
