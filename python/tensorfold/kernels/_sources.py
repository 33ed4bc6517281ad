"""Loading the GPU kernel sources shipped as files (csrc/cuda/*.cu, metal/*.metal).

Each file is cut into sections by marker lines ``// @@header`` and ``// @@body <name>``.
The header section goes to ``header=`` of ``mx.fast.cuda_kernel`` / ``metal_kernel`` and
each body section is the ``source=`` of one kernel.

Helpers shared by all files of one kind live in a section file of their own
(csrc/cuda/common.cuh, metal/common.h); its header section is prepended to the header
of every other file of that kind, so each kernel is still compiled from one text.
"""

from __future__ import annotations

import functools
from pathlib import Path

_PKG = Path(__file__).resolve().parent.parent  # .../tensorfold


def kernel_dir(kind: str) -> Path:
    """Installed copy (tensorfold/_kernels/<kind>) first, else the repository's sources."""
    installed = _PKG / "_kernels" / kind
    if installed.is_dir():
        return installed
    repo = _PKG.parent.parent  # python/tensorfold -> repo root
    src = repo / ("csrc/cuda" if kind == "cuda" else "metal")
    if src.is_dir():
        return src
    raise FileNotFoundError(f"tensorfold: no {kind} kernel sources found ({installed}, {src})")


COMMON = {"cuda": "common.cuh", "metal": "common.h"}


@functools.lru_cache(maxsize=None)
def sections(kind: str, filename: str) -> dict[str, str]:
    """{'header': ..., '<body name>': ...} of one kernel source file; the header starts
    with the shared helpers of COMMON[kind] (when that file exists)."""
    out = _split((kernel_dir(kind) / filename).read_text())
    common = COMMON.get(kind)
    if common is not None and filename != common and (kernel_dir(kind) / common).is_file():
        out["header"] = _split((kernel_dir(kind) / common).read_text())["header"] + \
            out.get("header", "")
    return out


def _split(text: str) -> dict[str, str]:
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("// @@"):
            tag = stripped[5:].split()
            current = "header" if tag[0] == "header" else tag[1]
            out[current] = []
            continue
        if current is not None:
            out[current].append(line)
    return {k: "\n".join(v) + "\n" for k, v in out.items()}
