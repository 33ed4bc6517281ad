"""The prompt-cache key: a hash of everything that changes the bits of a snapshot.

Model identity (config.json and the weight files), MLX version, TensorFold version, the kernel
sources (and the compiled extension), the activation dtype and the prefill mode. A snapshot saved
under another key is never reused."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import mlx.core as mx

from .. import __version__

_SAMPLE = 1 << 16


def _weights_identity(h, path: Path) -> None:
    """Name, size, safetensors header (shapes, dtypes, offsets) and head/tail bytes of each file."""
    files = sorted(path.glob("*.safetensors"))
    for f in files:
        size = f.stat().st_size
        h.update(f.name.encode() + struct.pack("<Q", size))
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0] if size >= 8 else 0
            h.update(fh.read(min(n, size)))
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


def cache_key(model_path, dtype: str, mode_key: str, *, kernels: str | None = None) -> str:
    path = Path(model_path)
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    _weights_identity(h, path)
    parts = {"mlx": mx.__version__, "tensorfold": __version__,
             "kernels": kernels if kernels is not None else kernel_hash(),
             "dtype": dtype, "prefill": mode_key}
    h.update(json.dumps(parts, sort_keys=True).encode())
    return h.hexdigest()[:32]
