"""Prompt-cache snapshots on disk: one safetensors file per snapshot, written atomically.

File: KV per layer (`k.{i}`, `v.{i}`) plus metadata {format, key, tokens (count), token_hash,
token_ids (base64 int32), created, checksum (sha256 of the tensor bytes), pinned}. Written to a
temporary name, fsynced, then renamed; temporary files are never read and are removed at start.
Loaded lazily: the index holds only headers; tensors are read when a prompt matches. A truncated,
tampered, foreign or other-format file is ignored with a warning."""

from __future__ import annotations

import atexit
import collections
import base64
import fcntl
import hashlib
import json
import logging
import math
import os
import stat
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import mlx.core as mx

FORMAT = "tensorfold-snapshot-1"
log = logging.getLogger("tensorfold")

_NP = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}
_MX = {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32}


@dataclass
class DiskEntry:
    path: Path
    key: str
    tokens: np.ndarray
    nbytes: int
    created: float
    pinned: bool
    checksum: str


def _read_header(f: Path) -> tuple[dict, int]:
    with open(f, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ValueError("truncated header")
        n = struct.unpack("<Q", raw)[0]
        if n > 64 << 20:
            raise ValueError("header too large")
        head = fh.read(n)
        if len(head) < n:
            raise ValueError("truncated header")
    return json.loads(head), 8 + n


def _checksum(arrays: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _check_layout(header, tokens: int) -> int:
    """Validate a snapshot header's tensors (a flipped bit in the JSON must be an error here, not a
    TypeError later): k.0, v.0, ... k.{L-1}, v.{L-1}, each a known dtype, a shape of non-negative
    integers whose sequence axis (-2) holds `tokens`, and data offsets that hold exactly that shape,
    laid end to end from 0. Returns L; raises ValueError."""
    if not isinstance(header, dict):
        raise ValueError("header is not an object")
    names = [k for k in header if k != "__metadata__"]
    L = len(names) // 2
    if not L or sorted(names) != sorted(f"{c}.{i}" for i in range(L) for c in "kv"):
        raise ValueError("tensor names are not k.0, v.0, ... k.L-1, v.L-1")
    end = 0
    for i in range(L):
        for name in (f"k.{i}", f"v.{i}"):
            info = header[name]
            if not isinstance(info, dict) or info.get("dtype") not in _NP:
                raise ValueError(f"{name}: bad dtype")
            shape, offs = info.get("shape"), info.get("data_offsets")
            if not (isinstance(shape, list) and len(shape) >= 2 and
                    all(type(d) is int and d >= 0 for d in shape) and shape[-2] == tokens):
                raise ValueError(f"{name}: bad shape {shape!r}")
            if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
                    and offs[0] == end and offs[1] - offs[0] ==
                    int(np.prod(shape)) * np.dtype(_NP[info["dtype"]]).itemsize):
                raise ValueError(f"{name}: bad data offsets {offs!r}")
            end = offs[1]
    return L


def read_tensors(entry: DiskEntry) -> list[tuple[np.ndarray, np.ndarray, str]]:
    """Read and verify a snapshot's tensors with numpy (no MLX: safe off the engine thread).
    Returns [(k, v, dtype tag)] per layer; raises ValueError when the file is not intact."""
    header, base = _read_header(entry.path)
    size = entry.path.stat().st_size
    layers = range(_check_layout(header, len(entry.tokens)))
    out, flat = [], []
    with open(entry.path, "rb") as fh:
        data = fh.read()
    if len(data) != size:
        raise ValueError("size changed while reading")
    for i in layers:
        pair = []
        for name in (f"k.{i}", f"v.{i}"):
            info = header[name]
            s, e = info["data_offsets"]
            if base + e > size:
                raise ValueError("truncated tensor data")
            a = np.frombuffer(data, dtype=_NP[info["dtype"]], count=(e - s) // np.dtype(_NP[info["dtype"]]).itemsize,
                              offset=base + s).reshape(info["shape"])
            pair.append(a)
            flat.append(a)
        out.append((pair[0], pair[1], header[f"k.{i}"]["dtype"]))
    if _checksum(flat) != entry.checksum:
        raise ValueError("checksum mismatch")
    return out


def to_mlx(tensors) -> list[tuple[mx.array, mx.array]]:
    kv = []
    for k, v, tag in tensors:
        if tag == "BF16":
            kv.append((mx.array(k).view(mx.bfloat16), mx.array(v).view(mx.bfloat16)))
        else:
            kv.append((mx.array(k), mx.array(v)))
    return kv


def _lock(fh) -> bool:
    """An exclusive advisory lock on an open file, without waiting: True when taken. A snapshot's
    temporary file is locked by its writer until it is renamed, so a file that can be locked is
    one whose writer is gone (a crash, a kill)."""
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


ABANDONED_AFTER = 60.0      # seconds since a temporary file's last write before it may be removed


def _regular(f: Path) -> bool:
    """A regular file: never open a FIFO (the open blocks until a writer comes: the engine hung)
    or a device that happens to carry a snapshot's name."""
    try:
        return stat.S_ISREG(f.stat().st_mode)
    except OSError:
        return False


def _abandoned(f: Path) -> bool:
    """A temporary file no live writer holds (a writer in this process or another, on this host),
    and unwritten for ABANDONED_AFTER: a writer takes its lock just after it creates the file, and
    a scan between the two had removed a live write (23 of 5,000 saves beside a restarting reader)."""
    try:
        if not _regular(f) or time.time() - f.stat().st_mtime < ABANDONED_AFTER:
            return False
        with open(f, "rb") as fh:
            return _lock(fh)
    except OSError:
        return False


class DiskStore:
    def __init__(self, directory, max_bytes: int = 8 << 30):
        self.dir = Path(directory).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._writer = None
        self._jobs: collections.deque = collections.deque()     # snapshots copied out, not yet written
        self._too_big_said = False
        self.entries: list[DiskEntry] = []
        self._seen = None       # the directory's mtime at the last look (refresh)
        self.scan()
        atexit.register(self.flush)     # queued snapshots reach the disk (returns at once if none)

    def scan(self) -> None:
        self._seen = self._mtime()
        entries = []
        for f in self.dir.iterdir():
            if f.name.startswith(".tmp-"):
                # an interrupted write is never reused; one a live writer holds (this process's
                # included: two engines may share a directory) is left to it
                if _abandoned(f):
                    try:
                        f.unlink()
                    except OSError:
                        pass
                continue
            if f.suffix != ".safetensors" or not _regular(f):
                continue
            try:
                entries.append(self._entry(f))
            except Exception as e:  # noqa: BLE001 - a damaged header is ignored, whatever it holds
                log.warning("ignoring snapshot %s: %s: %s", f.name, type(e).__name__, e)
        with self._lock:
            self.entries = sorted(entries, key=lambda e: e.created)

    def _entry(self, f: Path) -> DiskEntry:
        header, base = _read_header(f)
        meta = header.get("__metadata__") or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        toks = np.frombuffer(base64.b64decode(meta["token_ids"]), dtype=np.int32).astype(np.int64)
        if len(toks) != int(meta["tokens"]):
            raise ValueError("token count mismatch")
        if hashlib.sha256(toks.astype(np.int32).tobytes()).hexdigest() != meta["token_hash"]:
            raise ValueError("token hash mismatch")
        L = _check_layout(header, len(toks))
        size = f.stat().st_size
        end = header[f"v.{L - 1}"]["data_offsets"][1]
        if base + end != size:
            raise ValueError(f"size {size} != expected {base + end} (truncated?)")
        created = float(meta["created"])
        if not math.isfinite(created):      # nan or 1e400: the eviction order was undefined, or never reached it
            raise ValueError(f"created time {meta['created']!r} is not a finite number")
        return DiskEntry(f, meta["key"], toks, size, created, meta.get("pinned") == "1", meta["checksum"])

    def _mtime(self):
        try:
            return self.dir.stat().st_mtime_ns
        except OSError:
            return None

    def refresh(self) -> None:
        """Take in the snapshots another process sharing the directory wrote (or removed) since
        the last look; one stat when nothing changed. (Only scan() removes abandoned temp files.)"""
        m = self._mtime()
        if m is None or m == self._seen:
            return
        self._seen = m
        try:
            names = {f.name: f for f in self.dir.iterdir()
                     if f.suffix == ".safetensors" and not f.name.startswith(".tmp-") and _regular(f)}
        except OSError:
            return
        with self._lock:
            known = {e.path.name for e in self.entries}
        new = []
        for name, f in names.items():
            if name not in known:
                try:
                    new.append(self._entry(f))
                except Exception:  # noqa: BLE001 - damaged or vanished: not taken in
                    pass
        with self._lock:
            # (an entry this process wrote after the listing is kept: its file exists)
            kept = [e for e in self.entries if e.path.name in names or e.path.exists()]
            have = {e.path.name for e in kept}
            self.entries = sorted(kept + [e for e in new if e.path.name not in have], key=lambda e: e.created)

    def candidates(self, key: str) -> list[DiskEntry]:
        self.refresh()
        with self._lock:
            return [e for e in self.entries if e.key == key]

    def drop(self, entry: DiskEntry) -> None:
        with self._lock:
            self.entries = [e for e in self.entries if e.path != entry.path]

    # ---- writing: arrays leave MLX on the caller's (engine) thread; files are written by a
    # ---- background writer with numpy only, so a request never waits for the disk
    _TAG = {np.dtype(np.uint16): "BF16", np.dtype(np.float16): "F16", np.dtype(np.float32): "F32"}

    def _job(self, key: str, tokens, kv, pinned: bool):
        toks = np.asarray(tokens, dtype=np.int32)
        mx.eval([a for pair in kv for a in pair])
        flat = []
        for k, v in kv:
            for a in (k, v):
                flat.append(np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a))
        return key, toks, flat, pinned, ("BF16" if kv and kv[0][0].dtype == mx.bfloat16 else None)

    # snapshots copied out of MLX and waiting for the writer, at most (each a whole KV cache in host
    # memory, counted by neither budget: a slow disk had let them pile up without bound)
    MAX_QUEUED = 2

    def _fits(self, tokens, kv) -> bool:
        """A snapshot larger than the whole budget is not written (the newest file is always kept,
        so --snapshot-gib 0 had still written every snapshot). The arrays' bytes here, before
        they are copied out; the file's exact size (with its header) in _write."""
        return self._say_fits(len(tokens), sum(a.nbytes for pair in kv for a in pair))

    def _say_fits(self, tokens: int, size: int) -> bool:
        if size <= self.max_bytes:
            return True
        if not self._too_big_said:
            self._too_big_said = True
            log.info("a prompt snapshot of %d tokens (%.3g GB) is larger than the disk budget (%.3g GB): "
                     "not written (said once)", tokens, size / 1e9, self.max_bytes / 1e9)
        return False

    def save(self, key: str, tokens, kv: list[tuple[mx.array, mx.array]], *, pinned: bool = False) -> Path | None:
        """Write a snapshot now (atomically); returns its path (None: larger than the budget)."""
        if not self._fits(tokens, kv):
            return None
        return self._write(*self._job(key, tokens, kv, pinned))

    def save_async(self, key: str, tokens, kv: list[tuple[mx.array, mx.array]], *, pinned: bool = False) -> None:
        """Copy the arrays out of MLX here, write the file in the background writer. Where
        MAX_QUEUED snapshots already wait, the oldest unpinned one waiting is dropped (a cache:
        nothing saved is lost); where all of them are pinned, this one if it is not, else the
        oldest of them."""
        if not self._fits(tokens, kv):
            return
        with self._lock:
            if len(self._jobs) >= self.MAX_QUEUED:
                at = next((i for i, j in enumerate(self._jobs) if not j[3]), None)    # j[3]: pinned
                if at is None and not pinned:
                    log.warning("the snapshot writer is behind (a slow disk?): a snapshot was not written")
                    return
                del self._jobs[at or 0]
                self._pending -= 1
                log.warning("the snapshot writer is behind (a slow disk?): a queued snapshot was dropped")
        job = self._job(key, tokens, kv, pinned)
        with self._lock:
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(target=self._drain, name="tensorfold-snapshot-writer",
                                                daemon=True)
                self._writer.start()
            self._pending += 1
            self._jobs.append(job)
            self._idle.notify_all()

    def _drain(self) -> None:
        while True:
            with self._lock:
                self._idle.wait_for(lambda: self._jobs)
                job = self._jobs.popleft()
            try:
                self._write(*job)
            except Exception as e:  # noqa: BLE001 - the writer lives on; the next snapshot is written
                log.warning("could not write a snapshot to %s: %s: %s", self.dir, type(e).__name__, e)
            finally:
                with self._lock:
                    self._pending -= 1
                    self._idle.notify_all()

    def flush(self, timeout: float | None = 600) -> None:
        """Wait until every queued snapshot is on disk."""
        with self._lock:
            self._idle.wait_for(lambda: self._pending == 0, timeout)

    def _write(self, key: str, toks: np.ndarray, flat: list[np.ndarray], pinned: bool, bf16) -> Path | None:
        th = hashlib.sha256(toks.tobytes()).hexdigest()
        meta = {"format": FORMAT, "key": key, "tokens": str(len(toks)), "token_hash": th,
                "token_ids": base64.b64encode(toks.tobytes()).decode(), "created": repr(time.time()),
                "checksum": _checksum(flat), "pinned": "1" if pinned else "0"}
        header, off = {"__metadata__": meta}, 0
        for i, a in enumerate(flat):
            name = f"{'kv'[i % 2]}.{i // 2}"
            tag = "BF16" if (bf16 and a.dtype == np.uint16) else self._TAG[a.dtype]
            header[name] = {"dtype": tag, "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
            off += a.nbytes
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        name = f"{key[:12]}-{th[:16]}-{len(toks)}.safetensors"
        final = self.dir / name
        if not pinned and self._pinned_on_disk(final):
            meta["pinned"] = "1"        # another process sharing the directory pinned these tokens
            head = json.dumps(header, separators=(",", ":")).encode()
            head += b" " * (-len(head) % 8)
        if not self._say_fits(len(toks), 8 + len(head) + off):
            return None
        tmp = self.dir / f".tmp-{os.getpid()}-{threading.get_ident()}-{name}"
        # a directory removed while the server runs is made again (every save after had failed
        # until a restart)
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            with open(tmp, "wb") as fh:
                _lock(fh)                   # held until closed, after the rename
                fh.write(struct.pack("<Q", len(head)))
                fh.write(head)
                for a in flat:
                    fh.write(np.ascontiguousarray(a).tobytes())
                fh.flush()
                os.fsync(fh.fileno())
                os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)     # a full disk keeps no partial file
            raise
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        entry = self._entry(final)
        with self._lock:
            # an unpinned snapshot whose tokens are a prefix of this one is superseded (unless another
            # process sharing the directory has since pinned that file: its header says so)
            stale = [e for e in self.entries if e.path != final and e.key == key and not e.pinned
                     and len(e.tokens) <= len(toks) and np.array_equal(e.tokens, toks[: len(e.tokens)])
                     and not self._pinned_on_disk(e.path)]
            for e in stale:
                try:
                    e.path.unlink()
                except OSError:
                    pass
            gone = {e.path for e in stale} | {final}
            self.entries = [e for e in self.entries if e.path not in gone] + [entry]
        self._evict()
        return final

    @staticmethod
    def _pinned_on_disk(f: Path) -> bool:
        """The file's header says pinned (read now: another process may have replaced it)."""
        if not _regular(f):         # absent, or a FIFO another process left there (open would block)
            return False
        try:
            header, _ = _read_header(f)
            return (header.get("__metadata__") or {}).get("pinned") == "1"
        except Exception:  # noqa: BLE001 - absent or damaged: not pinned
            return False

    def _evict(self) -> None:
        """Bound total bytes: oldest unpinned first, pinned last; the newest is kept."""
        with self._lock:
            total = sum(e.nbytes for e in self.entries)
            for pinned in (False, True):
                for e in sorted(self.entries, key=lambda e: e.created)[:-1]:
                    if total <= self.max_bytes:
                        return
                    if e.pinned == pinned:
                        if not pinned and self._pinned_on_disk(e.path):
                            e.pinned = True     # another store sharing the directory pinned it since
                            continue
                        try:
                            e.path.unlink()
                        except OSError:
                            pass
                        total -= e.nbytes
                        self.entries.remove(e)
