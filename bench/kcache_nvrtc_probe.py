"""The kernel cache's compiles without a GPU: side by side against one after another (sessions 48-49).

NVRTC needs no GPU. Given an MLX CUDA wheel's package directory (its include/ with CCCL and its
lib/libmlx.so, whose embedded device headers the cache reads) and an NVRTC library, this builds the
decode step's kernel texts exactly as the CUDA face would launch them (the launches go to a stub: nothing
runs), compiles every instance through kernels/_kcache.py one after another, then again THREADS at once
through compiles_batched() (in worker processes since session 49; on threads in session 48), each into
empty directories, and checks that both give the same cubins byte for byte. It answers whether NVRTC
compiles side by side safely and identically before the H200 times it.

    python bench/kcache_nvrtc_probe.py MLX_CUDA_PKG_DIR LIBNVRTC [THREADS] [ARCH]

e.g. the wheel staged by ../shared/gpu/prepare-mlx-cuda unzipped, and `pip install nvidia-cuda-nvrtc`'s
nvidia/cu13/lib/libnvrtc.so.13; ARCH default sm_90a. CUDA runtime headers from CUDA_HOME
(default /usr/local/cuda)."""
from __future__ import annotations

import ctypes
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np


def main():
    pkg, lib = Path(sys.argv[1]), sys.argv[2]
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else os.cpu_count()
    arch = sys.argv[4] if len(sys.argv) > 4 else "sm_90a"
    ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)         # where _kcache._nvrtc finds it, as MLX's own

    import tensorfold.kernels as K
    from tensorfold.kernels import _cuda, _kcache
    from tensorfold.kernels._sources import cache_dir

    def stub(**kw):              # mx.fast.cuda_kernel's kernel object: no launch, zeros
        return lambda **c: [mx.zeros(s, d) for s, d in zip(c["output_shapes"], c["output_dtypes"])]
    mx.fast.cuda_kernel = stub
    mx.cuda.is_available = lambda: True                # _cuda._make wraps each kernel in CachedKernel
    K.backend_face = lambda stream=None: "cuda"
    K._gpu_stream = lambda s: None
    _kcache._mlx_dir = lambda: pkg
    _kcache._arch = lambda: arch

    rng = np.random.default_rng(0)

    def rand(shape, dtype):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    def build():
        for N, Kd, gs, b in ((4096, 4096, 64, 4), (12288, 4096, 64, 4), (4096, 12288, 64, 4), (1152, 384, 64, 8)):
            wq, s, bb = mx.quantize(rand((N, Kd), mx.float32), group_size=gs, bits=b)
            for M in (1, 9, 16):
                K.row_quantized_matmul(rand((M, Kd), mx.bfloat16), wq, s.astype(mx.bfloat16),
                                       bb.astype(mx.bfloat16), gs, b)
        for M in (1, 16):
            K.row_matmul(rand((M, 4096), mx.bfloat16), rand((4096, 4096), mx.bfloat16))
        for cap, M in ((2048, 1), (2048, 16), (32768, 16)):
            k, v = rand((1, 8, cap, 128), mx.bfloat16), rand((1, 8, cap, 128), mx.bfloat16)
            K.row_attention(rand((1, 32, M, 128), mx.bfloat16), k, v, cap - M, 128 ** -0.5)

    os.environ["TENSORFOLD_CACHE_DIR"] = tempfile.mkdtemp(prefix="probe-tf.")   # the kernel bodies' files: one
    # directory for both runs, since a text names its body's file by path (the same texts, the same modules)

    def run(n):
        os.environ["MLX_PTX_CACHE_DIR"] = tempfile.mkdtemp(prefix="probe-mlx.")
        shutil.rmtree(cache_dir() / "cubin", ignore_errors=True)          # our own copies: none either
        os.environ["TENSORFOLD_KERNEL_COMPILE_THREADS"] = str(n)
        _cuda.clear_kernel_caches()
        _kcache.stats.update(hits=0, copied=0, compiled=0, failed=0)
        t = time.perf_counter()
        with _kcache.batched():
            build()
        took = time.perf_counter() - t
        d = Path(os.environ["MLX_PTX_CACHE_DIR"])
        return took, dict(_kcache.stats), {p.relative_to(d): p.read_bytes() for p in d.rglob("*.ptx")}

    _kcache.device_headers()                           # read once, outside the timings
    t1, s1, c1 = run(1)
    tn, sn, cn = run(threads)
    same = c1.keys() == cn.keys() and all(c1[k] == cn[k] for k in c1)
    print(f"NVRTC {_kcache.target()}: {s1['compiled']} instances; one after another {t1:.1f} s, "
          f"{threads} at once {tn:.1f} s ({t1 / tn:.2f}x); stats {s1} / {sn}; "
          f"cubins byte-identical: {same} ({sum(len(v) for v in c1.values()) / 1e6:.1f} MB)")
    sys.exit(0 if same and s1["failed"] == 0 and sn["failed"] == 0 else 1)


if __name__ == "__main__":
    main()
