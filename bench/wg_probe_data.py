"""Inputs and the package's own outputs for bench/wg_probe.cu's `file` mode (H200, MLX CUDA).

    python3 bench/wg_probe_data.py DIR [NxK ...]

For each shape: a random weight quantized as mlx-community's checkpoints (4 bits, group 64, bf16
scales and biases) and 16 bf16 x rows, written raw (x.bin, w.bin, s.bin, b.bin), then the
package's 4-bit GEMM on the first R rows for R = 1, 8, 9, 16, both row_qmm_tc (tc_plan's split)
and the default launch (row_qmm_cp), as out_tc_R.bin / out_cp_R.bin. The probe's wgmma kernel is
then compared with both, bit for bit."""
import os
import sys

import mlx.core as mx
import numpy as np


def raw(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a)


def main(root: str, shapes: list[str]) -> None:
    from tensorfold.kernels import _cuda
    gpu = mx.default_stream(mx.gpu)
    for shape in shapes:
        N, K = (int(v) for v in shape.split("x"))
        d = os.path.join(root, shape)
        os.makedirs(d, exist_ok=True)
        mx.random.seed(N + K)
        w = mx.random.normal((N, K)) * 0.02
        wq, s, b = mx.quantize(w, group_size=64, bits=4)
        s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
        x = (mx.random.normal((16, K)) * 0.5).astype(mx.bfloat16)
        mx.eval(wq, s, b, x)
        for name, a in (("x", x), ("w", wq), ("s", s), ("b", b)):
            raw(a).tofile(os.path.join(d, name + ".bin"))
        tc = _cuda.tc_plan(N, K, 64, 4)
        for R in (1, 8, 9, 16):
            y_tc = _cuda.quantized_matmul(x[:R], wq, s, b, 64, 4, gpu, plan=tc)
            y_cp = _cuda.quantized_matmul(x[:R], wq, s, b, 64, 4, gpu)
            mx.eval(y_tc, y_cp)
            raw(y_tc).tofile(os.path.join(d, f"out_tc_{R}.bin"))
            raw(y_cp).tofile(os.path.join(d, f"out_cp_{R}.bin"))
            same = bool(mx.array_equal(y_tc.view(mx.uint16), y_cp.view(mx.uint16)).item())
            print(f"{shape} split {tc[2]} R {R}: row_qmm_cp == row_qmm_tc: {same}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["12288x4096", "24576x4096", "4096x12288", "6144x4096"])
