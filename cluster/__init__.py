"""Several pagedllama replicas on this machine behind one front door (HAProxy) that keeps each
session on one replica.

`python -m cluster --replicas 2 --policy session --port 8000` (what `make cluster` runs).
"""
