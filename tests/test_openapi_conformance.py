"""The OpenAPI document states what the server does: schemathesis (its CLI) generates requests
from /openapi.json, valid and invalid ones, sends them to a real server, and checks every answer
against the document: no 5xx, a documented status, a documented content type, a body (and each
event of a stream) of the documented schema, invalid data refused, the Allow header of a 405.

The server is started with small limits so that generated requests are cheap (answers of at
most 4 tokens, a short context), and the hooks below give generated bodies the served model's
name, so that they reach the engine rather than stop at a 404. The run is bounded (a few
examples per operation, a fixed seed); PAGEDLLAMA_CONFORMANCE_EXAMPLES=30 searches further.

Left out, by design:
- positive_data_acceptance (a request the schema allows must not be refused): JSON Schema cannot
  say everything a body must be, so some schema-valid bodies are 400s: `16.0` where an integer
  is due (numbers are strict; JSON Schema's `integer` takes 16.0), token ids beyond the model's
  vocabulary, an empty prompt or input, a GBNF grammar that does not parse, a `tool_calls`
  entry whose `arguments` are not JSON text, `max_tokens: 0` on /v1/messages, message and
  input-item shapes checked where they are converted (a role, a content block's type).
- use_after_free, ensure_resource_availability, ignored_auth and object_level_authorization:
  they need resources the API creates and deletes, or a key (none is set here).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.server_proc import ROOT, SMOLLM2_NAME, running_server

try:
    import schemathesis
except ImportError:   # the hooks are defined only where schemathesis is installed
    schemathesis = None

EXAMPLES = int(os.environ.get("PAGEDLLAMA_CONFORMANCE_EXAMPLES", "5"))
ENV = {"PAGEDLLAMA_MAX_OUTPUT": "4", "PAGEDLLAMA_N_CTX": "512", "PAGEDLLAMA_THREADS": "2",
       "PAGEDLLAMA_MAX_SEQS": "4", "PAGEDLLAMA_MAX_QUEUE": "32"}
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance,response_headers_conformance,negative_data_rejection,"
          "missing_required_header,unsupported_method,allow_header_conformance")
SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"


if schemathesis is not None:
    @schemathesis.hook
    def map_body(context, body):
        """A generated body names the served model (where it names one as a string): the
        request then goes through to the engine. A `model` of another type is left as it is,
        so that a body made invalid there stays invalid."""
        if isinstance(body, dict) and isinstance(body.get("model"), str):
            return {**body, "model": SMOLLM2_NAME}
        return body


def run_schemathesis(base: str, examples: int, cwd: Path) -> subprocess.CompletedProcess:
    """The CLI, run in `cwd` (it keeps a cache of past failures in .schemathesis/ there, which
    it would replay first)."""
    return subprocess.run(
        [str(SCHEMATHESIS), "run", f"{base}/openapi.json", "--checks", CHECKS,
         "--max-examples", str(examples), "--seed", "1", "--workers", "1",
         "--request-timeout", "60", "--no-color", "--generation-database", "none"],
        cwd=cwd, capture_output=True, text=True, timeout=600,
        env={**os.environ, "SCHEMATHESIS_HOOKS": "tests.test_openapi_conformance",
             "PYTHONPATH": str(ROOT)})


@pytest.mark.skipif(not SCHEMATHESIS.exists(), reason="schemathesis is not installed "
                    "(requirements-dev.txt)")
def test_schemathesis_finds_no_difference_between_the_document_and_the_server(tmp_path):
    with running_server(ENV) as base:
        t0 = time.monotonic()
        result = run_schemathesis(base, EXAMPLES, tmp_path)
        took = time.monotonic() - t0
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-12000:]
    generated = re.search(r"(\d+) generated", out)
    assert generated and int(generated.group(1)) >= 500, out[-3000:]   # it did run
    print(f"schemathesis: {generated.group(1)} requests in {took:.1f} s")
