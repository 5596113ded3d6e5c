"""Sealed reasoning: a thinking model's reasoning text, encrypted so that a stateless client
(`store: false`, `include: ["reasoning.encrypted_content"]`, as Codex sends) can carry it to the
next request, where only this server can open it.

AES-256-GCM (authenticated: a token altered or sealed under another key does not open) under a
server key, set at start-up by `configure` from the settings: `PAGEDLLAMA_REASONING_KEY` (any
string, hashed to a key) when set, else a random key kept in `reasoning.key` (mode 0600) under
`PAGEDLLAMA_STATE_DIR` (default `~/.cache/pagedllama`), created on first use, so sealed
reasoning still opens after a restart. Not configured (a unit test): a random key for the
process.
A token is URL-safe base64 of a version byte, a 12-byte nonce and the ciphertext with its tag.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import os
import secrets
import threading
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_FILE = "reasoning.key"
_VERSION = b"\x01"
_NONCE = 12
_AAD = b"pagedllama reasoning"   # binds a token to this use of the key

_lock = threading.Lock()
_aead: AESGCM | None = None
_secret: str | None = None          # configure: the key's text, or
_key_dir: Path | None = None        # where the key file is kept (None: a key for this process)


class SealError(ValueError):
    """A token that does not open: altered, truncated, or sealed under another key."""


def seal(text: str) -> str:
    """The text as a token only this server can open."""
    nonce = secrets.token_bytes(_NONCE)
    sealed = _cipher().encrypt(nonce, text.encode(), _AAD)
    return base64.urlsafe_b64encode(_VERSION + nonce + sealed).decode()


def unseal(token: str) -> str:
    """The text a token holds; SealError when it does not open."""
    try:
        raw = base64.urlsafe_b64decode(token.encode())
    except (binascii.Error, ValueError) as exc:
        raise SealError("not a sealed token") from exc
    if raw[:1] != _VERSION or len(raw) < 1 + _NONCE + 16:
        raise SealError("not a sealed token")
    try:
        return _cipher().decrypt(raw[1:1 + _NONCE], raw[1 + _NONCE:], _AAD).decode()
    except (InvalidTag, UnicodeDecodeError) as exc:
        raise SealError("not sealed by this server's key, or altered") from exc


def configure(secret: str | None, key_dir: Path | None) -> None:
    """The server's key: `secret` hashed when given, else the key file under `key_dir` (made on
    first use); with neither, a random key for this process. Forgets the loaded key."""
    global _secret, _key_dir
    with _lock:
        _secret, _key_dir = secret or None, key_dir
    reset()


def configuration() -> tuple[str | None, Path | None]:
    """What `configure` was last given: (secret, key_dir)."""
    with _lock:
        return _secret, _key_dir


def reset() -> None:
    """Forget the loaded key (the next seal or unseal reads the configured key or file again)."""
    global _aead
    with _lock:
        _aead = None


def _cipher() -> AESGCM:
    global _aead
    with _lock:
        if _aead is None:
            _aead = AESGCM(hashlib.sha256(_key_material()).digest())
        return _aead


def _key_material() -> bytes:
    if _secret:
        return _secret.encode()
    if _key_dir is None:
        return secrets.token_bytes(32)
    path = _key_dir / KEY_FILE
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    material = secrets.token_hex(32).encode()
    # written whole under a temporary name, then linked into place: a process that reads the
    # file never sees it half written, and of two that create it at once, the first one wins
    tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(material)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return path.read_bytes()
    finally:
        tmp.unlink(missing_ok=True)
    return material
