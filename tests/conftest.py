import pytest

from tests.server_proc import SMOLLM2_NAME, running_server


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
