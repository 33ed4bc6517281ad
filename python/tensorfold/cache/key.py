"""The prompt-cache key: a hash of everything that changes the bits of a snapshot.

Model identity (config.json and the weight files' contents), MLX version, TensorFold version, the
kernel sources (and the compiled extension), the activation dtype and the prefill mode. A snapshot
saved under another key is never reused.

The weight files are hashed whole (sha256): two checkpoints of one shape that differ anywhere
(a fine-tune of a few layers, a file replaced in place) must not share snapshots. A file's hash
is remembered in $TENSORFOLD_CACHE_DIR/weights-sha256.json (default ~/.cache/tensorfold) under
its path, size, inode, mtime and ctime, so it is read once, not at every start."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from pathlib import Path

import mlx.core as mx

from .. import __version__

log = logging.getLogger("tensorfold")
_SAMPLE = 1 << 16
_MEMO_MAX = 4096


def _memo_file() -> Path:
    from ..kernels._sources import user_cache_home
    return Path(os.environ.get("TENSORFOLD_CACHE_DIR") or user_cache_home()) / "weights-sha256.json"


def _stamp(st: os.stat_result) -> list:
    return [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def _read_memo() -> dict:
    try:
        memo = json.loads(_memo_file().read_text())
        return memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        return {}


def _unhashed(files: list[Path], memo: dict) -> list[Path]:
    return [f for f in files if (m := memo.get(str(f.resolve()))) is None
            or not isinstance(m, dict) or m.get("stamp") != _stamp(f.stat())]


def _weight_files(path: Path) -> list[Path]:
    return sorted(f for f in Path(path).glob("*.safetensors") if f.is_file())


def unhashed_bytes(model_path) -> int:
    """Bytes of the checkpoint's weight files whose sha256 the memo does not hold yet."""
    return sum(f.stat().st_size for f in _unhashed(_weight_files(Path(model_path)), _read_memo()))


def file_hashes(files: list[Path]) -> list[str]:
    """sha256 of each file's bytes, from the memo where the file's stamp is unchanged."""
    memo_f = _memo_file()
    memo = _read_memo()
    out, new = [], False
    todo = _unhashed(files, memo)
    if todo:
        gb = sum(f.stat().st_size for f in todo) / 1e9
        if gb > 1:
            log.info("hashing %.1f GB of weights once, to key their prompt-cache snapshots", gb)
    t0 = time.perf_counter()
    for f in files:
        key = str(f.resolve())
        st = f.stat()
        m = memo.get(key)
        if isinstance(m, dict) and m.get("stamp") == _stamp(st) and isinstance(m.get("sha256"), str):
            out.append(m["sha256"])
            continue
        digest = _sha256_file(f)
        if _stamp(f.stat()) == _stamp(st):      # not written while read
            memo[key] = {"stamp": _stamp(st), "sha256": digest}
            new = True
        out.append(digest)
    if new:
        if len(memo) > _MEMO_MAX:
            memo = dict(list(memo.items())[-_MEMO_MAX:])
        try:
            memo_f.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo_f.with_name(f".{memo_f.name}.{os.getpid()}")
            tmp.write_text(json.dumps(memo))
            os.replace(tmp, memo_f)
        except OSError:
            pass                                 # hashed again next time
        if todo and time.perf_counter() - t0 > 2:
            log.info("weights hashed in %.1f s", time.perf_counter() - t0)
    return out


def _sha256_file(f: Path) -> str:
    h, buf = hashlib.sha256(), bytearray(1 << 22)
    view = memoryview(buf)
    with open(f, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _weights_identity(h, path: Path, whole: bool = True) -> None:
    """Name, size and safetensors header (shapes, dtypes, offsets) of each file, and its sha256
    (whole) or only its first and last 64 KiB (not whole: a key that never leaves the process)."""
    files = _weight_files(path)
    digests = file_hashes(files) if whole else [None] * len(files)
    for f, digest in zip(files, digests):
        size = f.stat().st_size
        h.update(f.name.encode() + struct.pack("<Q", size))
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0] if size >= 8 else 0
            h.update(fh.read(min(n, size)))
            if digest is not None:
                h.update(digest.encode())
                continue
            h.update(fh.read(_SAMPLE))
            if size > _SAMPLE:
                fh.seek(max(0, size - _SAMPLE))
                h.update(fh.read(_SAMPLE))


def kernel_hash() -> str:
    """Hash of the native extension binary and the shipped GPU kernel sources."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for f in sorted(root.glob("_ext*")) + sorted((root / "_kernels").rglob("*")) + \
            sorted((root.parent.parent / "csrc").rglob("*") if (root.parent.parent / "csrc").is_dir() else []):
        if f.is_file():
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def cache_key(model_path, dtype: str, mode_key: str, *, kernels: str | None = None,
              whole: bool = True) -> str:
    """whole: hash the weight files' bytes (keys of snapshots kept on disk); False samples them
    (an engine without a snapshot directory: its keys never meet another process's)."""
    path = Path(model_path)
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    _weights_identity(h, path, whole)
    parts = {"mlx": mx.__version__, "tensorfold": __version__,
             "kernels": kernels if kernels is not None else kernel_hash(),
             "dtype": dtype, "prefill": mode_key}
    h.update(json.dumps(parts, sort_keys=True).encode())
    return h.hexdigest()[:32]
