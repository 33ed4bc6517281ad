"""Every decode kernel family, for tests/test_kcache.py's CUDA checks (run in a process of its own: MLX
keeps each module it loaded or compiled for the life of the process). The cases are
kernel_helpers.decode_kernel_cases on fixed inputs, the same in every process.

    python tests/kcache_cases.py OUT.npz     # the outputs' bits, and _kcache.stats as "stats"

With KCACHE_BATCHED=1 every case's graph is built inside _kcache.batched() before any is evaluated, so the
cache's misses compile side by side in worker processes (as an exact forward's do).
"""
from __future__ import annotations

import json
import os
import sys

import mlx.core as mx
import numpy as np

from kernel_helpers import bits, decode_kernel_cases


def cases():
    return decode_kernel_cases(np.random.default_rng(48), mx.default_stream(mx.gpu))


def main(path: str) -> None:
    from tensorfold.kernels import _kcache
    if os.environ.get("KCACHE_BATCHED") == "1":
        with _kcache.batched():
            outs = [f() for f in cases()]
        res = {f"c{i}": bits(o) for i, o in enumerate(outs)}
    else:
        res = {f"c{i}": bits(f()) for i, f in enumerate(cases())}
    np.savez(path, stats=np.array(json.dumps(_kcache.stats)), **res)


if __name__ == "__main__":
    main(sys.argv[1])
