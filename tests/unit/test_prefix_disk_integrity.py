"""The disk tier never restores a state for tokens it was not computed for (kvcache/snapshots/,
package doc): a file whose bytes changed, whose header was rewritten with other tokens, space or
block size, or that was renamed to another snapshot's name is skipped with a log line, deleted
and counted as bad."""
from __future__ import annotations

import json
import logging
import os
import random
import struct
import tempfile
import zlib
from contextlib import contextmanager
from functools import cache
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import PrefixStore, block_hashes
from kvcache.snapshots import files as snapshot_files

BS = 4
IDENTITY = {"model": "m", "kv_type": "f16"}


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def state_of(tokens) -> bytes:
    """A state that differs for every token list (what the check compares restores with)."""
    return random.Random(str(tokens)).randbytes(64)


def store(directory, block_size=BS, identity=IDENTITY):
    s = PrefixStore(ram_limit=1 << 20, disk_dir=Path(directory), disk_limit=1 << 20,
                    min_tokens=8)
    return s, s.space(identity, block_size, whole_only=False)


def written(directory, *token_lists) -> list[Path]:
    """The files a store writes for these token lists, in their order."""
    s, space = store(directory)
    for tokens in token_lists:
        space.put(tokens, state_of(tokens))
    s.close()
    return [space.directory / snapshot_files.file_name(block_hashes(t, BS)[-1])
            for t in token_lists]


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@contextmanager
def log_lines():
    handler = Records()
    logger = logging.getLogger("pagedllama.kvcache")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


def restored(directory, tokens, block_size=BS, identity=IDENTITY):
    """What a new process restores for `tokens` (None: nothing), and its store."""
    s, space = store(directory, block_size, identity)
    try:
        found = space.find(block_hashes(tokens, block_size), tokens, len(tokens))
        return (space.fetch(*found) if found is not None else None), s
    finally:
        s.close()


def rewrite(path: Path, change) -> None:
    """Rewrite a file's header with change(header) and seal it again with valid checksums, as
    a program that knows the format (or a bug in one) would."""
    raw = path.read_bytes()
    start = len(snapshot_files.MAGIC) + 4
    (n,) = struct.unpack_from("<I", raw, len(snapshot_files.MAGIC))
    header = json.loads(raw[start:start + n])
    state = raw[start + n + 4:-4]
    change(header)
    path.write_bytes(b"".join(snapshot_files.encode(header["space"], header["block_size"],
                                               header["tokens"], state)))


def assert_skipped(lines, s, path, why):
    assert any(str(path) in line and why in line for line in lines), lines
    assert s.counts["disk"].bad == 1 and not path.exists()


def assert_not_restored(tmp_path, tokens, path, why):
    """Restoring `tokens` finds nothing: the file at `path` is skipped (logged with `why`,
    counted bad) and deleted."""
    with log_lines() as lines:
        got, s = restored(tmp_path, tokens)
    assert got is None
    assert_skipped(lines, s, path, why)


def test_a_header_with_another_token_id_is_not_restored(tmp_path):
    a = prompt(1, 16)
    b = a[:5] + [a[5] + 1] + a[6:]
    (path,) = written(tmp_path, a)
    rewrite(path, lambda h: h["tokens"].__setitem__(5, b[5]))
    assert_not_restored(tmp_path, b, path, "its name is not the chain hash of its tokens")
    assert restored(tmp_path, a)[0] is None


def test_a_header_with_another_space_in_the_same_folder_is_not_restored(tmp_path):
    a = prompt(1, 16)
    (path,) = written(tmp_path, a)
    rewrite(path, lambda h: h["space"].__setitem__("kv_type", "q8_0"))
    assert_not_restored(tmp_path, a, path, "its space identity or block size is not its folder's")
    assert restored(tmp_path, a, identity={**IDENTITY, "kv_type": "q8_0"})[0] is None


def test_a_header_with_another_block_size_is_not_restored(tmp_path):
    a = prompt(1, 16)
    (path,) = written(tmp_path, a)
    rewrite(path, lambda h: h.__setitem__("block_size", 8))
    # a process with block size 8 has a folder of its own: it finds nothing
    got, s = restored(tmp_path, a, block_size=8)
    assert got is None and path.exists()
    assert_not_restored(tmp_path, a, path, "its space identity or block size is not its folder's")


def test_a_file_renamed_to_another_snapshots_name_is_not_restored(tmp_path):
    a, b = prompt(1, 16), prompt(2, 16)
    path_a, path_b = written(tmp_path, a, b)
    os.replace(path_a, path_b)          # b's name, a's content
    assert_not_restored(tmp_path, a, path_b, "its name is not the chain hash of its tokens")
    assert restored(tmp_path, b)[0] is None


def test_a_file_in_the_older_format_is_skipped_and_deleted(tmp_path):
    a = prompt(1, 16)
    (path,) = written(tmp_path, a)
    data = state_of(a)
    header = json.dumps({"space": IDENTITY, "block_size": BS, "tokens": a, "size": len(data),
                         "crc32": zlib.crc32(data)}).encode()
    path.write_bytes(b"PGLKV1\n" + struct.pack("<I", len(header)) + header + data)
    assert_not_restored(tmp_path, a, path, "written in an older format")


@cache
def one_file() -> tuple[str, bytes]:
    """A file the store wrote, as (its path in the cache directory, its bytes)."""
    with tempfile.TemporaryDirectory() as d:
        (path,) = written(d, prompt(1, 16))
        return str(path.relative_to(d)), path.read_bytes()


def check_one_changed_byte(pos: int, xor: int) -> None:
    """A new process with only that file, one byte changed, restores nothing for its tokens and
    logs why (the file deleted and counted as bad). A change before the state is caught when
    the folder is scanned: the file is never indexed."""
    name, raw = one_file()
    changed = bytearray(raw)
    changed[pos] ^= xor
    tokens = prompt(1, 16)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / name
        path.parent.mkdir()
        path.write_bytes(bytes(changed))
        with log_lines() as lines:
            s, space = store(d)
            found = space.find(block_hashes(tokens, BS), tokens, len(tokens))
            got = space.fetch(*found) if found is not None else None
            s.close()
        assert got is None, f"byte {pos} ^ {xor:#x}: restored"
        in_head = pos < len(raw) - 4 - len(state_of(tokens))
        assert not (in_head and found), f"byte {pos} ^ {xor:#x}: indexed"
        assert_skipped(lines, s, path, "")


def test_the_file_restores_before_it_is_changed(tmp_path):
    name, raw = one_file()
    (tmp_path / name).parent.mkdir()
    (tmp_path / name).write_bytes(raw)
    got, s = restored(tmp_path, prompt(1, 16))
    assert got is not None and got.data == state_of(prompt(1, 16)) and s.counts["disk"].bad == 0


@settings(max_examples=200, deadline=None)
@given(data=st.data(), xor=st.integers(1, 255))
def test_any_changed_byte_of_a_written_file_is_caught(data, xor):
    pos = data.draw(st.integers(0, len(one_file()[1]) - 1), label="position")
    check_one_changed_byte(pos, xor)


def test_every_byte_position_is_caught():
    for pos in range(len(one_file()[1])):
        check_one_changed_byte(pos, 0x80 if pos % 2 else 0x01)
