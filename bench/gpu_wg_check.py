"""row_attn_wg (wgmma) against row_attn_tc's bits on a few small cases, with the size of any
difference: a first check of the kernel's layouts before the bit test and the timings
(bash bench/gpu_run.sh s33a runs it first). Prints one line a (case, plan)."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np

from tensorfold import kernels as K
from tensorfold.kernels import _cuda


def main(plans):
    print("device_info", mx.device_info(), "wgmma", _cuda.wgmma_device())
    mx.random.seed(3)
    for (B, HQ, HKV, D, cap, M, off) in ((1, 4, 1, 128, 64, 16, 48), (1, 32, 8, 128, 1024, 16, 1008),
                                          (1, 32, 8, 128, 3000, 1, 2999), (1, 8, 1, 64, 2100, 5, 2000),
                                          (2, 32, 8, 128, 5000, 16, 4984)):
        k = mx.random.normal((B, HKV, cap, D)).astype(mx.bfloat16)
        v = mx.random.normal((B, HKV, cap, D)).astype(mx.bfloat16)
        q = mx.random.normal((B, HQ, M, D)).astype(mx.bfloat16)
        _cuda.attn_impl = "span"
        ref = np.array(K.row_attention(q, k, v, off, D ** -0.5).astype(mx.float32))
        for p in plans:
            _cuda.attn_impl = p
            try:
                got = np.array(K.row_attention(q, k, v, off, D ** -0.5).astype(mx.float32))
            except Exception as e:   # noqa: BLE001  (a compile error is the answer here)
                print(f"{(B, HQ, HKV, D, cap, M, off)} {p}: ERROR {str(e)[:300]}")
                continue
            bad = got != ref
            where = np.argwhere(bad)[:3].tolist()
            print(f"{(B, HQ, HKV, D, cap, M, off)} {p}: {int(bad.sum())} of {bad.size} differ, "
                  f"max |diff| {float(np.nanmax(np.abs(got - ref))):.3g}, first {where}")
    _cuda.attn_impl = None


if __name__ == "__main__":
    main(sys.argv[1:] or ["wg4", "ws4", "wg4.3"])
