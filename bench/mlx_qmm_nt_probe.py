"""Which non-transposed quantized matmuls (x @ w, transpose=False) MLX's backend runs (session 46).

deepseek_v32's absorbed-MLA prefill (mlx-lm's op, and ours: models/dsa.py) computes the keys as
mx.quantized_matmul(latent, embed_q, transpose=False) over [heads, kv_lora_rank, qk_nope] weights.
On the H200, MLX 0.32.4 refused our small test checkpoint's product ("No implementation for problem
shape: 5x32x64x4, transpose: false", group 32). This asks, per shape, whether it runs and how far it
is from the same product through mx.dequantize + matmul, so it is known whether a real DeepSeek-V3.2
checkpoint (kv_lora_rank 512, qk_nope 128, 128 heads) prefills on CUDA, and which test shapes would.

    python3 bench/mlx_qmm_nt_probe.py

One line per case: M (rows), N (= qk_nope), K (= kv_lora_rank), L (heads), group, x contiguous or a
slice of a wider buffer (as the model's latent is), then "refused: <MLX's message>" or the relative
error."""
import mlx.core as mx
import numpy as np

CASES = [  # (M, N, K, L, group)
    (5, 32, 64, 4, 32),       # the test checkpoint's (refused on the H200, session 46)
    (5, 64, 64, 4, 32),
    (5, 64, 128, 4, 64),
    (5, 128, 256, 4, 64),
    (5, 128, 512, 4, 64),     # DeepSeek-V3.2's embed_q, 4 of its 128 heads
    (5, 128, 512, 4, 32),
    (64, 128, 512, 8, 64),
    (2048, 128, 512, 4, 64),  # one prefill chunk
]


def case(M, N, K, L, g, sliced, bits=4):
    rng = np.random.default_rng(0)
    w = mx.array(rng.standard_normal((L, K, N), dtype=np.float32) / np.sqrt(K)).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=g, bits=bits)          # groups along N, the last axis
    wide = K + 64 if sliced else K
    buf = mx.array(rng.standard_normal((1, 1, M, wide), dtype=np.float32)).astype(mx.bfloat16)
    x = buf[..., :K] if sliced else buf
    mx.eval(wq, s, b, x)
    try:
        y = mx.quantized_matmul(x, wq, s, b, transpose=False, group_size=g, bits=bits)
        mx.eval(y)
    except RuntimeError as e:
        return f"refused: {str(e)[:110]}"
    ref = x.astype(mx.float32) @ mx.dequantize(wq, s, b, group_size=g, bits=bits).astype(mx.float32)
    err = mx.max(mx.abs(y.astype(mx.float32) - ref)).item() / (mx.max(mx.abs(ref)).item() + 1e-30)
    return f"rel_err {err:.3g}"


def main():
    print(f"mlx {mx.__version__} {mx.default_device()}")
    for M, N, K, L, g in CASES:
        for sliced in (False, True):
            print(f"M={M} N={N} K={K} L={L} g={g} x={'slice' if sliced else 'contiguous'}: "
                  f"{case(M, N, K, L, g, sliced)}", flush=True)


if __name__ == "__main__":
    main()
