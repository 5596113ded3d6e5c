"""The layer rules of the tree: at run time only engine/ imports llama_cpp (measurement tools in
benchmarks/tools/ may too: they time llama.cpp itself); kvcache/ and scheduler/ import no layer
above them; the server's HTTP edge knows nothing of models."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["benchmarks", "engine", "experiments", "kvcache", "scheduler", "scripts", "server",
            "tests"]


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def files_of(*packages: str) -> list[Path]:
    return [p for package in packages for p in sorted((ROOT / package).rglob("*.py"))]


MEASUREMENT_TOOLS = ROOT / "benchmarks" / "tools"


def test_only_engine_imports_llama_cpp():
    outside = [p for p in files_of(*PACKAGES) if not p.is_relative_to(ROOT / "engine")
               and not p.is_relative_to(MEASUREMENT_TOOLS)]
    assert outside and [p for p in outside if "llama_cpp" in imported_modules(p)] == []


def test_the_runtime_imports_no_measurement_tools():
    runtime = files_of("engine", "kvcache", "scheduler", "server")
    assert runtime and [p for p in runtime if "benchmarks" in imported_modules(p)] == []


def submodules_imported(path: Path, package: str) -> set[str]:
    """The `package.sub` names a file imports (from package.sub import ...)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] == package and len(parts) > 1:
                names.add(".".join(parts[:2]))
    return names


def test_the_http_edge_knows_nothing_of_models_or_generation():
    edge = files_of("server/http")
    assert edge
    for p in edge:
        assert not imported_modules(p) & {"engine", "scheduler", "kvcache"}, p
        assert not submodules_imported(p, "server") & {"server.service", "server.api",
                                                         "server.openai"}, p


@pytest.mark.parametrize("package", ["kvcache", "scheduler"])
def test_pure_python_layers_import_nothing_above_them(package):
    above = {"engine", "server", "llama_cpp", "benchmarks", "experiments"}
    assert [p for p in files_of(package) if imported_modules(p) & above] == []
