"""Prompt-cache snapshots on disk: one safetensors file per snapshot, written atomically.

File: KV per layer (`k.{i}`, `v.{i}`) plus metadata {format, key, tokens (count), token_hash,
token_ids (base64 int32), created, checksum (sha256 of the tensor bytes), pinned}. Written to a
temporary name, fsynced, then renamed; temporary files are never read and are removed at start.
Loaded lazily: the index holds only headers; tensors are read when a prompt matches. A truncated,
tampered, foreign or other-format file is ignored with a warning."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
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


def read_tensors(entry: DiskEntry) -> list[tuple[np.ndarray, np.ndarray, str]]:
    """Read and verify a snapshot's tensors with numpy (no MLX: safe off the engine thread).
    Returns [(k, v, dtype tag)] per layer; raises ValueError when the file is not intact."""
    header, base = _read_header(entry.path)
    size = entry.path.stat().st_size
    layers = sorted({int(k.split(".")[1]) for k in header if k.startswith("k.")})
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


class DiskStore:
    def __init__(self, directory, max_bytes: int = 8 << 30):
        self.dir = Path(directory).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self.entries: list[DiskEntry] = []
        self.scan()

    def scan(self) -> None:
        entries = []
        for f in self.dir.iterdir():
            if f.name.startswith(".tmp-"):
                try:
                    f.unlink()        # an interrupted write: never reused
                except OSError:
                    pass
                continue
            if f.suffix != ".safetensors":
                continue
            try:
                entries.append(self._entry(f))
            except (OSError, ValueError, KeyError) as e:
                log.warning("ignoring snapshot %s: %s", f.name, e)
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
        size = f.stat().st_size
        end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        if base + end != size:
            raise ValueError(f"size {size} != expected {base + end} (truncated?)")
        return DiskEntry(f, meta["key"], toks, size, float(meta["created"]), meta.get("pinned") == "1",
                         meta["checksum"])

    def candidates(self, key: str) -> list[DiskEntry]:
        with self._lock:
            return [e for e in self.entries if e.key == key]

    def drop(self, entry: DiskEntry) -> None:
        with self._lock:
            self.entries = [e for e in self.entries if e.path != entry.path]

    def save(self, key: str, tokens, kv: list[tuple[mx.array, mx.array]], *, pinned: bool = False) -> Path:
        toks = np.asarray(tokens, dtype=np.int32)
        th = hashlib.sha256(toks.tobytes()).hexdigest()
        arrays = {}
        for i, (k, v) in enumerate(kv):
            arrays[f"k.{i}"], arrays[f"v.{i}"] = k, v
        mx.eval(list(arrays.values()))
        flat = []
        for i in range(len(kv)):
            for name in (f"k.{i}", f"v.{i}"):
                a = arrays[name]
                flat.append(np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a))
        meta = {"format": FORMAT, "key": key, "tokens": str(len(toks)), "token_hash": th,
                "token_ids": base64.b64encode(toks.tobytes()).decode(), "created": repr(time.time()),
                "checksum": _checksum(flat), "pinned": "1" if pinned else "0"}
        name = f"{key[:12]}-{th[:16]}-{len(toks)}.safetensors"
        final = self.dir / name
        tmp = self.dir / f".tmp-{os.getpid()}-{threading.get_ident()}-{name}"
        mx.save_safetensors(str(tmp), arrays, metadata=meta)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        entry = self._entry(final)
        with self._lock:
            # an unpinned snapshot whose tokens are a prefix of this one is superseded
            stale = [e for e in self.entries if e.path != final and e.key == key and not e.pinned
                     and len(e.tokens) <= len(toks) and np.array_equal(e.tokens, toks[: len(e.tokens)])]
            for e in stale:
                try:
                    e.path.unlink()
                except OSError:
                    pass
            gone = {e.path for e in stale} | {final}
            self.entries = [e for e in self.entries if e.path not in gone] + [entry]
        self._evict()
        return final

    def _evict(self) -> None:
        """Bound total bytes: oldest unpinned first, pinned last; the newest is kept."""
        with self._lock:
            total = sum(e.nbytes for e in self.entries)
            for pinned in (False, True):
                for e in sorted(self.entries, key=lambda e: e.created)[:-1]:
                    if total <= self.max_bytes:
                        return
                    if e.pinned == pinned:
                        try:
                            e.path.unlink()
                        except OSError:
                            pass
                        total -= e.nbytes
                        self.entries.remove(e)
