"""What the HTTP edge accepts: its limits, read from the environment by server/config.py
(edge_from_env). A plain record, so that the edge needs nothing of the configuration's other
modules (models, sampling)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EdgeLimits:
    """What the HTTP edge accepts (server/http/edge.py, server/http/protocol.py)."""
    max_body_bytes: int = 192 * 1024   # 413 above this, before the body is parsed
    read_timeout: float = 10.0         # a request head, and each read of a body, within this
    keepalive_timeout: float = 5.0     # an idle connection is closed after this
    max_header_bytes: int = 16 * 1024  # request line + headers; 431 above this
    drain_seconds: float = 30.0        # SIGTERM: time running requests get to finish
    protect_metrics: bool = False      # /metrics, /stats, /dashboard, /docs behind the API key
    # POST /v1/files (the Batch API's uploads): its own body limit, the batch file limit plus
    # room for the multipart framing (PAGEDLLAMA_BATCH_MAX_FILE_BYTES)
    max_upload_bytes: int = 100 * 1024**2 + 64 * 1024
