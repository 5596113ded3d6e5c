"""The layer rules of the tree: only engine/ imports llama_cpp; kvcache/ and scheduler/ import
no layer above them."""
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


def test_only_engine_imports_llama_cpp():
    outside = [p for p in files_of(*PACKAGES) if not p.is_relative_to(ROOT / "engine")]
    assert outside and [p for p in outside if "llama_cpp" in imported_modules(p)] == []


@pytest.mark.parametrize("package", ["kvcache", "scheduler"])
def test_pure_python_layers_import_nothing_above_them(package):
    above = {"engine", "server", "llama_cpp", "benchmarks", "experiments"}
    assert [p for p in files_of(package) if imported_modules(p) & above] == []
