"""The prompt-cache key: a hash of everything that changes the bits of a snapshot.

Model identity (config.json and the weight files' contents), MLX version, the backend and the device's
make (a GPU's name and compute capability, a CPU's architecture and name), TensorFold's
code (its Python sources, the kernel sources and the compiled extension), the activation dtype, the
prefill mode, the GPU backend and the environment variables that choose an arithmetic path
(BITS_ENV). A snapshot saved under another key is never reused.

The weight files are hashed whole (sha256): two checkpoints of one shape that differ anywhere
(a fine-tune of a few layers, a file replaced in place) must not share snapshots. A file's hash
is remembered in $TENSORFOLD_CACHE_DIR/weights-sha256.json (default ~/.cache/tensorfold) under
its path, size, inode, mtime and ctime, so it is read once, not at every start."""

from __future__ import annotations

import functools
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
    except (OSError, ValueError, RecursionError):     # a damaged memo: the weights are hashed again
        return {}


def _memo_hit(memo: dict, f: Path) -> str | None:
    """The file's remembered sha256, where its stamp is unchanged."""
    m = memo.get(str(f.resolve()))
    ok = isinstance(m, dict) and m.get("stamp") == _stamp(f.stat()) and isinstance(m.get("sha256"), str)
    return m["sha256"] if ok else None


def _weight_files(path: Path) -> list[Path]:
    """The files the loader reads (models.config.weight_files); none where it would refuse."""
    from ..errors import CheckpointError
    from ..models.config import weight_files
    try:
        return weight_files(Path(path))
    except CheckpointError:
        return []


def weight_stamps(model_path) -> dict:
    """{file: (size, inode, mtime, ctime)} of the checkpoint's weight files: the same stamps when
    the key is hashed as when the weights were loaded say the key is of the loaded bytes."""
    out = {}
    for f in _weight_files(Path(model_path)):
        try:
            out[str(f)] = _stamp(f.stat())
        except OSError:
            out[str(f)] = None
    return out


def unhashed_bytes(model_path) -> int:
    """Bytes of the checkpoint's weight files whose sha256 the memo does not hold yet."""
    memo = _read_memo()
    return sum(f.stat().st_size for f in _weight_files(Path(model_path)) if _memo_hit(memo, f) is None)


def file_hashes(files: list[Path]) -> list[str]:
    """sha256 of each file's bytes, from the memo where the file's stamp is unchanged."""
    memo = _read_memo()
    out, new = [], False
    t0 = time.perf_counter()
    for f in files:
        digest = _memo_hit(memo, f)
        if digest is None:
            st = f.stat()
            digest = _sha256_file(f)
            if _stamp(f.stat()) == _stamp(st):      # not written while read
                memo[str(f.resolve())] = {"stamp": _stamp(st), "sha256": digest}
                new = True
        out.append(digest)
    if new:
        if len(memo) > _MEMO_MAX:
            memo = dict(list(memo.items())[-_MEMO_MAX:])
        memo_f = _memo_file()
        tmp = memo_f.with_name(f".{memo_f.name}.{os.getpid()}")
        try:
            memo_f.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(memo))
            os.replace(tmp, memo_f)
        except OSError:
            try:                                 # hashed again next time; no file left behind
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
        if time.perf_counter() - t0 > 2:
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


# ELF note header of the linker's build id (namesz 4, descsz 20, NT_GNU_BUILD_ID, "GNU\0"): 20 bytes
# that differ at every build of the same sources
_BUILD_ID = b"\x04\x00\x00\x00\x14\x00\x00\x00\x03\x00\x00\x00GNU\x00"


def _without_build_id(data: bytes) -> bytes:
    i = data.find(_BUILD_ID)
    if i < 0:
        return data
    j = i + len(_BUILD_ID)
    return data[:j] + bytes(20) + data[j + 20:]


def _gpu_backend() -> str:
    """Which GPU backend this MLX has ("cuda" / "metal" / "none"): with the device and
    TENSORFOLD_KERNELS, which face our kernels take (the kernels' own checks)."""
    from ..kernels import _cuda_available, _metal_available
    return "cuda" if _cuda_available() else "metal" if _metal_available() else "none"


@functools.lru_cache(maxsize=1)
def kernel_hash() -> str:
    """Hash of TensorFold's code: its Python sources (a model's or a kernel wrapper's change can
    change a snapshot's bits: a new version resumed an old version's KV, session 52), the native
    extension (its build id left out: each rebuild of the same sources orphaned every snapshot) and
    the shipped GPU kernel sources."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    py = sorted(f for f in root.rglob("*.py") if "data" not in f.relative_to(root).parts)
    csrc = root.parent.parent / "csrc"
    for f in sorted(root.glob("_ext*")) + py + sorted((root / "_kernels").rglob("*")) + \
            sorted(csrc.rglob("*") if csrc.is_dir() else []):
        if f.is_file():
            h.update(str(f.relative_to(f.parents[1])).encode())
            data = f.read_bytes()
            h.update(_without_build_id(data) if f.name.startswith("_ext") else data)
    return h.hexdigest()


# Environment variables that choose how a prefill computes, so a snapshot's bits: in the key.
# TENSORFOLD_MOE_PREFILL picks the MoE prefill's grouped GEMM (dequantized or gather_qmm: other
# bits); TENSORFOLD_KERNELS=cpu the CPU face of our kernels on a GPU (`--prefill kernels`, the
# sparse attention); TENSORFOLD_FUSED_QK=0 MLX's rms_norm + rope instead of the fused CUDA kernel.
# (A MoE server restarted with another TENSORFOLD_MOE_PREFILL resumed the other path's snapshots:
# a resumed reply unlike the fresh one.)
BITS_ENV = ("TENSORFOLD_MOE_PREFILL", "TENSORFOLD_KERNELS", "TENSORFOLD_FUSED_QK")
# The others TensorFold reads, and why they are not in the key: places and secrets
# (API_KEY, CACHE_DIR, SNAPSHOT_DIR, KERNEL_CACHE, KERNEL_COMPILE_THREADS), memory only
# (QUEUE_DEPTH, RESERVE_PROMPT: the KV buffer grown chunk by chunk), or the same bits by test
# (COMPILE_DECODE: test_compiled_step.py; INPLACE_KV: test_compiled_step.py / test_models.py;
# CUDA_TEXT: the same PTX, test_kernels.py's text-mode test; CUDA_SOURCES / METAL_SOURCES: where
# the sources are read from, hashed by kernel_hash when shipped).
NOT_BITS_ENV = ("TENSORFOLD_API_KEY", "TENSORFOLD_CACHE_DIR", "TENSORFOLD_SNAPSHOT_DIR",
                "TENSORFOLD_KERNEL_CACHE", "TENSORFOLD_KERNEL_COMPILE_THREADS",
                "TENSORFOLD_QUEUE_DEPTH", "TENSORFOLD_RESERVE_PROMPT", "TENSORFOLD_COMPILE_DECODE",
                "TENSORFOLD_INPLACE_KV", "TENSORFOLD_CUDA_TEXT", "TENSORFOLD_CUDA_SOURCES",
                "TENSORFOLD_METAL_SOURCES")


def _hardware() -> dict:
    """The device's make (mx.device_info: a GPU's name and compute capability, a CPU's architecture
    and name): MLX's GPU kernels are chosen per architecture, and BLAS per CPU, so a snapshot
    directory shared between machines (a home over NFS) must not hand one's KV to another."""
    try:
        info = mx.device_info()
    except Exception:  # noqa: BLE001 - an MLX without it: the device string alone
        return {}
    keys = ("architecture", "device_name", "compute_capability_major", "compute_capability_minor")
    return {k: str(info[k]) for k in keys if k in info}


def cache_key(model_path, dtype: str, mode_key: str, *, kernels: str | None = None,
              whole: bool = True) -> str:
    """whole: hash the weight files' bytes (keys of snapshots kept on disk); False samples them
    (an engine without a snapshot directory: its keys never meet another process's)."""
    path = Path(model_path)
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    _weights_identity(h, path, whole)
    parts = {"mlx": mx.__version__, "tensorfold": __version__, "device": str(mx.default_device()),
             "kernels": kernels if kernels is not None else kernel_hash(),
             "dtype": dtype, "prefill": mode_key, "gpu_backend": _gpu_backend(), "hardware": _hardware(),
             "env": {k: os.environ.get(k, "") for k in BITS_ENV}}
    h.update(json.dumps(parts, sort_keys=True).encode())
    return h.hexdigest()[:32]
