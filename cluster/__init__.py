"""Several pagedllama replicas on this machine behind a cache-aware router (sglang-router).

`python -m cluster --replicas 2 --policy cache_aware --port 8000` (what `make cluster` runs).
"""
