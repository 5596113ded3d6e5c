"""A fake unified KV cache that applies the manager's KV ops the way llama.cpp does, for unit tests
of the pure-Python layers: cells are tagged with (seq, pos); a cell is free when no seq tags it."""
from __future__ import annotations

import itertools
import pickle

from kvcache import CopyOp, DropSavedOp, LoadOp, RemoveOp, RestoreOp, SaveOp, SnapshotOp


class FakeKV:
    def __init__(self, n_cells: int, tiers=None):
        self.n_cells = n_cells
        self.tiers = tiers      # a kvcache.snapshots.Space: SnapshotOp saves there, LoadOp reads
        self.seqs: dict[int, dict[int, int]] = {}      # seq -> pos -> cell
        self.tags: dict[int, set[tuple[int, int]]] = {}  # cell -> {(seq, pos)}
        self.values: dict[int, tuple] = {}              # cell -> what was computed there
        self.saved: dict[int, dict[int, tuple]] = {}
        self._cell_ids = itertools.count()

    @property
    def used_cells(self) -> int:
        return len(self.tags)

    def apply(self, ops) -> list[int]:
        """Apply ops as engine/llama.py's Context.apply does; returns the seq ids whose LoadOp
        found no state to read."""
        unread = []
        for op in ops:
            if isinstance(op, CopyOp):
                for pos, cell in list(self.seqs.get(op.src, {}).items()):
                    if op.p0 <= pos < op.p1:
                        self._drop(op.dst, pos)
                        self.seqs.setdefault(op.dst, {})[pos] = cell
                        self.tags[cell].add((op.dst, pos))
            elif isinstance(op, RemoveOp):
                for pos in list(self.seqs.get(op.seq, {})):
                    if pos >= op.p0 and (op.p1 < 0 or pos < op.p1):
                        self._drop(op.seq, pos)
            elif isinstance(op, SaveOp):
                self.saved[op.key] = {p: self.values[c] for p, c in self.seqs.get(op.seq, {}).items()}
            elif isinstance(op, RestoreOp):
                for pos, value in self.saved.pop(op.key).items():
                    self.write(op.seq, pos, value)
            elif isinstance(op, DropSavedOp):
                self.saved.pop(op.key, None)
            elif isinstance(op, SnapshotOp):   # the sequence's cells as llama.cpp would save them
                state = {p: self.values[c] for p, c in self.seqs.get(op.seq, {}).items()}
                assert sorted(state) == list(range(len(op.tokens))), "a snapshot of whole cells"
                self.tiers.put(op.tokens, pickle.dumps(state))
            elif isinstance(op, LoadOp):   # read as the engine reads it (Space.load)
                restore = self.tiers.load(op)
                if restore is None:
                    unread.append(op.seq)
                    continue
                for pos in list(self.seqs.get(op.seq, {})):
                    self._drop(op.seq, pos)
                for pos, value in pickle.loads(restore.data).items():
                    if pos < op.n_tokens:
                        self.write(op.seq, pos, value)
        return unread

    def write(self, seq: int, pos: int, value: tuple) -> None:
        """What llama_decode does for one token: a new cell for (seq, pos)."""
        self._drop(seq, pos)
        cell = next(self._cell_ids)
        self.tags[cell] = {(seq, pos)}
        self.values[cell] = value
        self.seqs.setdefault(seq, {})[pos] = cell
        assert self.used_cells <= self.n_cells, "out of KV cells"

    def read(self, seq: int) -> list[tuple]:
        """The values a sequence attends to, in position order."""
        cells = self.seqs.get(seq, {})
        return [self.values[cells[p]] for p in sorted(cells)]

    def _drop(self, seq: int, pos: int) -> None:
        cell = self.seqs.get(seq, {}).pop(pos, None)
        if cell is not None:
            self.tags[cell].discard((seq, pos))
            if not self.tags[cell]:
                del self.tags[cell]
                del self.values[cell]
