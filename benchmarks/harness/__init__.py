"""What the benchmark scenarios share: `client` (one timed streamed request), `launch` (servers
started and stopped here), `datasets` (prompts), `workload` (a workload run against a server),
`metrics` (summaries, tables, the result file) and `options` (the command-line options they
repeat)."""
