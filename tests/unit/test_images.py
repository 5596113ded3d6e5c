"""The container images' recipes: the CPU and CUDA images stay alike where they should (one
entrypoint, user, health check and settings), and the CPU image holds only what serving needs
and a llama.cpp build that runs on any x86-64-v3 CPU without ggml's AMX kernels."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CPU = (ROOT / "docker" / "Dockerfile").read_text()
CUDA = (ROOT / "docker" / "Dockerfile.cuda").read_text()
TEST_ONLY = ("pytest", "hypothesis", "selenium", "openai", "kubernetes-validate", "matplotlib")


def instructions(dockerfile: str, name: str) -> list[str]:
    """Each NAME instruction of the final stage, continuation lines joined."""
    final = dockerfile.split("\nFROM ")[-1]
    joined = re.sub(r"\\\n\s*", " ", final)
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.startswith(name + " ")]


def env_keys(dockerfile: str) -> set[str]:
    return {k for line in instructions(dockerfile, "ENV") for k in re.findall(r"(\w+)=", line)}


def test_the_base_image_is_a_build_argument_defaulting_to_python_slim():
    assert CPU.count("FROM ${BASE}") == 2
    assert "ARG BASE=python:3.11-slim" in CPU.split("FROM")[0]


def test_both_images_share_entrypoint_user_and_health_check():
    for name in ("ENTRYPOINT", "USER", "HEALTHCHECK", "EXPOSE"):
        assert instructions(CPU, name) == instructions(CUDA, name), name
    assert instructions(CPU, "USER") == ["pagedllama"]


def test_both_images_set_the_same_settings_and_copy_the_same_code():
    assert env_keys(CUDA) - env_keys(CPU) == {"PAGEDLLAMA_GPU_LAYERS"}
    assert instructions(CPU, "COPY") == instructions(CUDA, "COPY")


def test_the_image_installs_only_the_runtime_requirements():
    assert "requirements.txt" in CPU and "requirements-dev.txt" not in CPU
    runtime = (ROOT / "requirements.txt").read_text().lower()
    assert not [p for p in TEST_ONLY if re.search(rf"^{p}==", runtime, re.M)]


def test_llama_cpp_is_built_portable_and_without_amx():
    args = re.search(r'ARG LLAMA_CMAKE_ARGS="([^"]*)"', CPU).group(1)
    assert "-DGGML_NATIVE=OFF" in args
    assert "ALL_VARIANTS" not in args and not re.search(r"AMX\w*=ON", args)
