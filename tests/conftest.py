import os
import tempfile

import pytest

from tests.server_proc import SMOLLM2_NAME, running_server

# the speculation probe's answers (engine/speculation.py) are kept for the whole run, shared by
# every server the tests start, and never written to the user's cache directory
os.environ.setdefault("PAGEDLLAMA_PROBE_DIR", tempfile.mkdtemp(prefix="pagedllama-probes-"))


@pytest.fixture(scope="session")
def server_url():
    """One shared server with the default configuration (SmolLM2, FIFO, prefix caching on)."""
    with running_server() as base:
        yield base


@pytest.fixture(scope="session")
def model_name() -> str:
    return SMOLLM2_NAME


@pytest.fixture()
def client(server_url):
    from openai import OpenAI
    return OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=120)
