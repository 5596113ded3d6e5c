"""Ollama's JavaScript client (`ollama` on npm) against a real server, through
scripts/ollama_js_check.mjs: list, show, ps, chat and generate streamed and not, embed, tools
and a tool result, format json, an unknown model's 404. Skipped unless `node` and the client are
installed: `npm install --prefix .cache/ollama-js ollama@0.6.4` (or OLLAMA_JS_MODULE naming the
client's dist/index.mjs)."""
import os
import shutil
import subprocess

import pytest

from tests.server_proc import ROOT, smollm2_folder_server

SCRIPT = ROOT / "scripts" / "ollama_js_check.mjs"
MODULE = os.environ.get("OLLAMA_JS_MODULE") or str(
    ROOT / ".cache" / "ollama-js" / "node_modules" / "ollama" / "dist" / "index.mjs")

pytestmark = [
    pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed"),
    pytest.mark.skipif(not os.path.exists(MODULE), reason=f"the ollama JS client is not at "
                       f"{MODULE} (npm install --prefix .cache/ollama-js ollama@0.6.4)"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with smollm2_folder_server(tmp_path_factory.mktemp("ollama-js-models")) as proc:
        yield proc


def test_the_javascript_client_checks_pass(server):
    env = {**os.environ, "OLLAMA_HOST": server.base, "OLLAMA_JS_MODULE": MODULE}
    env.pop("OLLAMA_MODEL", None)
    done = subprocess.run(["node", str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out + "\n--- server log ---\n" + server.log()[-4000:]
    passed = [line[5:].split(":")[0] for line in done.stdout.splitlines()
              if line.startswith("ok   ")]
    assert passed == ["list", "show", "chat", "chat streamed", "ps", "generate", "embed",
                      "tools", "format json", "unknown model"], out
    assert "all checks passed" in done.stdout
