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


# ---- indirect imports: what a module pulls in through the modules it imports -------------------
OWN = set(PACKAGES)


def module_file(name: str) -> Path | None:
    """The file of one of the tree's modules (a package's __init__.py), or None."""
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def modules_imported(path: Path) -> set[str]:
    """The full names a file imports (`import a.b`, `from a.b import c`: a.b, and a.b.c when
    that is a module of the tree), anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names
                      if module_file(f"{node.module}.{alias.name}") is not None}
    return names


def pulled_in(path: Path) -> set[str]:
    """Every module a file imports directly or through the tree's modules it imports (the
    packages above a module included: importing a.b runs a/__init__.py)."""
    seen: set[str] = set()
    todo = list(modules_imported(path))
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in seen:
                continue
            seen.add(prefix)
            file = module_file(prefix) if parts[0] in OWN else None
            if file is not None:
                todo += modules_imported(file)
    return seen


def reaches(path: Path, prefixes: set[str]) -> set[str]:
    """The modules among `prefixes` (or below them) that `path` pulls in."""
    return {m for m in pulled_in(path) if m in prefixes or m.split(".")[0] in prefixes
            or any(m.startswith(p + ".") for p in prefixes)}


MODELS_AND_GENERATION = {"engine", "scheduler", "kvcache", "llama_cpp", "server.service",
                         "server.batch"}
API_MODULES = {"server.api", "server.openai", "server.anthropic", "server.ollama",
               "server.chat"}


def test_the_http_edge_pulls_in_no_model_generation_or_api_module_indirectly():
    edge = files_of("server/http")
    assert edge
    for p in edge:
        assert reaches(p, MODELS_AND_GENERATION | API_MODULES | {"server.config"}) == set(), p


def test_the_configuration_pulls_in_no_api_module():
    assert reaches(ROOT / "server" / "config.py",
                   API_MODULES | {"server.http.client", "server.service", "fastapi",
                                  "starlette"}) == set()


def test_the_service_speaks_no_http_even_indirectly():
    service = files_of("server/service")
    assert service
    for p in service:
        assert reaches(p, {"fastapi", "starlette", "uvicorn", "server.api"}) == set(), p


def test_no_answer_shape_or_route_reads_the_engines_request():
    shapes = files_of("server/openai", "server/anthropic", "server/ollama", "server/api",
                      "server/chat")
    assert shapes
    for p in shapes:
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ImportFrom) and node.module in ("engine", "engine.request"):
                assert "Request" not in {alias.name for alias in node.names}, p


def test_only_the_configuration_reads_the_environment():
    readers = [p for p in files_of("engine", "kvcache", "scheduler", "server")
               if p not in (ROOT / "server" / "config.py", ROOT / "engine" / "config.py")
               and ("os.environ" in p.read_text() or "getenv" in p.read_text())]
    assert readers == []
