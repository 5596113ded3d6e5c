"""The snapshot files' format and the file utilities of the prefix cache's tiers (the package
doc describes the format and its checks). Every file the kvcache package reads or writes goes
through this module or its package."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
import threading
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvcache.blocks import block_hashes

State = bytes | bytearray   # a sequence's state as llama.cpp writes it

MAGIC = b"PGLKV2\n"
OLD_MAGICS = (b"PGLKV1\n",)      # earlier formats: skipped and deleted
U32 = struct.Struct("<I")        # the header's length, and each CRC-32
FILE_SUFFIX = ".kv"
LOCK_NAME = ".lock"
TRIM = "trim"                    # the disk thread's order to trim the directory
KEY_MASK = 0xFFFFFFFFFFFFFFFF
# A folder's modification time within this of the clock may change again without changing
# (file systems keep coarse times): such a folder is listed again on the next lookup.
RACY_NS = 1_000_000_000


def space_digest(identity: dict, block_size: int) -> str:
    """The name of a space's folder: a digest of everything that decides its numbers."""
    text = json.dumps({"block_size": block_size, "space": identity}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def file_name(key: int) -> str:
    """A snapshot file's name: the chain hash of its last block."""
    return f"{key & KEY_MASK:016x}{FILE_SUFFIX}"


def encode(identity: dict, block_size: int, tokens: Sequence[int], data: State) -> list[State]:
    """A snapshot file's bytes (package doc), in parts: the head, the state, the last checksum."""
    header = json.dumps({"space": identity, "block_size": block_size, "tokens": list(tokens),
                         "size": len(data)}).encode()
    head = MAGIC + U32.pack(len(header)) + header
    head += U32.pack(zlib.crc32(head))
    return [head, data, U32.pack(zlib.crc32(data, zlib.crc32(head)))]


@contextmanager
def dir_lock(directory: Path) -> Iterator[None]:
    """Hold the directory's lock (flock on `.lock`) against other processes and stores; where
    the lock file cannot be opened (a read-only directory) nothing is held."""
    try:
        f = open(directory / LOCK_NAME, "ab")
    except OSError:
        f = None
    try:
        if f is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        yield
    finally:
        if f is not None:
            f.close()   # releases the lock


def file_digest(path: Path, memo: Path | None = None) -> str:
    """SHA-256 of a file's content, remembered by (path, size, mtime, inode) in this process
    and, when `memo` is given, in that JSON file (a 270 MB model hashes in about a second)."""
    st = path.stat()
    stamp = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
    if stamp in _DIGESTS:
        return _DIGESTS[stamp]
    known: dict = {}
    if memo is not None:
        try:
            known = json.loads(memo.read_text())
        except (OSError, ValueError):
            known = {}
    digest = known.get(stamp)
    if not isinstance(digest, str):
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        if memo is not None:
            known[stamp] = digest
            try:
                write_atomic(memo, json.dumps(known, sort_keys=True).encode())
            except OSError:
                pass
    _DIGESTS[stamp] = digest
    return digest


_DIGESTS: dict[str, str] = {}


def write_temp(path: Path, data: State | Sequence[State]) -> Path:
    """Write `data` (bytes, or parts of them one after the other) to a temporary file beside
    `path`, to be renamed there; returns its name."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            for part in ([data] if isinstance(data, (bytes, bytearray)) else data):
                f.write(part)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_atomic(path: Path, data: State | Sequence[State]) -> None:
    """Write `data` to a temporary file beside `path` and rename it there: a reader, or another
    process writing the same file, sees the old file or the new one, never a part of one."""
    tmp = write_temp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class BadFile(Exception):
    """A snapshot file that fails a check (package doc); the message says which."""


class UnreadableFile(BadFile):
    """A snapshot file that could not be read (permissions, an I/O error): skipped, not
    deleted."""


class GoneFile(Exception):
    """A snapshot file deleted (by a trim, here or in another process) before it was read."""


def read_snapshot(path: Path, identity: dict, block_size: int, expected: tuple[int, ...] | None,
                  state: bool) -> tuple[tuple[int, ...], int, bytearray | None]:
    """A snapshot file's tokens, its state's size and, with `state`, the state, checked
    (package doc) against the space (`identity`, `block_size`) it is read for: the header
    always, the whole file's checksum when the state is read, and the tokens against `expected`
    when given. Raises BadFile (why) or GoneFile."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise GoneFile(str(path)) from None
    except OSError as exc:
        raise UnreadableFile(f"it could not be read ({exc.strerror or exc})") from None
    with f:
        try:
            st = os.fstat(f.fileno())
            head = f.read(len(MAGIC) + U32.size)
            if head[:len(MAGIC)] in OLD_MAGICS:
                raise BadFile("written in an older format")
            if len(head) < len(MAGIC) + U32.size or not head.startswith(MAGIC):
                raise BadFile("not a snapshot file (or truncated)")
            (n,) = U32.unpack_from(head, len(MAGIC))
            if len(head) + n + 2 * U32.size > st.st_size:
                raise BadFile("truncated (or its header length is damaged)")
            rest = f.read(n + U32.size)
            crc = zlib.crc32(rest[:n], zlib.crc32(head))
            if len(rest) != n + U32.size or U32.unpack_from(rest, n)[0] != crc:
                raise BadFile("header checksum mismatch")
            tokens, size = check_header(path, rest[:n], identity, block_size)
            if expected is not None and tokens != expected:
                raise BadFile("its tokens are not the ones indexed")
            if st.st_size != len(head) + len(rest) + size + U32.size:
                raise BadFile(f"truncated or too long ({st.st_size} bytes, "
                              f"{len(head) + len(rest) + size + U32.size} expected)")
            if not state:
                return tokens, size, None
            data = bytearray(size)
            got = f.readinto(data)
            tail = f.read(U32.size + 1)
            if got != size or len(tail) != U32.size:
                raise BadFile("truncated")
            crc = zlib.crc32(data, zlib.crc32(rest[n:], crc))
            if U32.unpack(tail)[0] != crc:
                raise BadFile("checksum mismatch")
            return tokens, size, data
        except OSError as exc:
            raise UnreadableFile(f"it could not be read ({exc.strerror or exc})") from None


def check_header(path: Path, raw: bytes, identity: dict,
                 block_size: int) -> tuple[tuple[int, ...], int]:
    """A header's tokens and state size, if it belongs where it lies: this space (the
    folder's digest), this block size, whole blocks, the file named by its tokens."""
    try:
        header = json.loads(raw)
        space, size_of_block = header["space"], header["block_size"]
        tokens, size = header["tokens"], header["size"]
    except (ValueError, KeyError, TypeError):
        raise BadFile("its header does not parse") from None
    if not isinstance(space, dict) or type(size_of_block) is not int or type(size) is not int \
            or size < 0 or not isinstance(tokens, list) \
            or not all(type(t) is int for t in tokens):
        raise BadFile("its header does not parse")
    if space_digest(space, size_of_block) != path.parent.name:
        raise BadFile("its space identity or block size is not its folder's")
    if space != identity or size_of_block != block_size:
        raise BadFile("written for other numbers (model, build or settings)")
    if not tokens or len(tokens) % block_size:
        raise BadFile("its tokens are not whole blocks")
    if file_name(block_hashes(tokens, block_size)[-1]) != path.name:
        raise BadFile("its name is not the chain hash of its tokens")
    return tuple(tokens), size
