"""In-memory prompt cache: grid-point KV snapshots, LRU by bytes and count.

An entry holds the KV of one prefilled prompt up to its last grid point G, with the tokens it
covers. Any grid point g <= G inside the common prefix of a new prompt is usable (the first g
positions of the entry), so one entry serves every grid point of its prompt without copies."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import mlx.core as mx


@dataclass
class Entry:
    key: str
    tokens: np.ndarray                  # int64, length G (a grid point)
    kv: list[tuple[mx.array, mx.array]]  # per layer, [1, Hkv, G, D]
    nbytes: int
    pinned: bool = False
    created: float = field(default_factory=time.time)
    source: str = "memory"


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


class SnapshotStore:
    def __init__(self, max_bytes: int, max_entries: int = 64):
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._entries: "OrderedDict[int, Entry]" = OrderedDict()
        self._next = 0
        self._lock = threading.RLock()     # the engine's thread and the warm-up's add entries

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def pinned_nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values() if e.pinned)

    def holds(self, key: str, tokens) -> bool:
        """An entry of this key with exactly these tokens is stored."""
        tokens = np.asarray(tokens, dtype=np.int64)
        with self._lock:
            return any(e.key == key and np.array_equal(e.tokens, tokens) for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: str, prompt: np.ndarray, grid: int, limit: int) -> tuple[Entry | None, int]:
        """Best (entry, g): the largest grid point g <= limit within a stored prefix of `prompt`."""
        best, best_g, best_id = None, 0, None
        with self._lock:
            for eid, e in self._entries.items():
                if e.key != key:
                    continue
                g = min(common_prefix(e.tokens, prompt), limit) // grid * grid
                if g > best_g:
                    best, best_g, best_id = e, g, eid
            if best_id is not None:
                self._entries.move_to_end(best_id)
        return best, best_g

    def add(self, key: str, tokens, kv, *, pinned: bool = False, source: str = "memory") -> Entry | None:
        tokens = np.asarray(tokens, dtype=np.int64)
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
        if nbytes > self.max_bytes:
            return None
        with self._lock:
            for eid, e in self._entries.items():     # the same snapshot again (read twice from disk)
                if e.key == key and np.array_equal(e.tokens, tokens):
                    e.pinned = e.pinned or pinned
                    self._entries.move_to_end(eid)
                    return e
            # an entry whose tokens are a prefix of this one is superseded (unless pinned)
            for eid in [i for i, e in self._entries.items()
                        if e.key == key and not e.pinned and len(e.tokens) <= len(tokens)
                        and common_prefix(e.tokens, tokens) == len(e.tokens)]:
                del self._entries[eid]
            entry = Entry(key, tokens, kv, nbytes, pinned, source=source)
            self._entries[self._next] = entry
            self._next += 1
            self._evict()
        return entry

    def _evict(self) -> None:
        def over():
            return self.nbytes > self.max_bytes or len(self._entries) > self.max_entries
        for pinned_pass in (False, True):   # unpinned first, oldest first; pinned last
            for eid in list(self._entries):
                if not over():
                    return
                if self._entries[eid].pinned == pinned_pass:
                    del self._entries[eid]
