"""Peak memory of MLX's own attention for one prefill chunk against a long cache (issue 7).

    python3 bench/gpu_sdpa_mem.py            # H200: Qwen3-30B-A3B's attention, 2k-row chunks

One layer's prefill attention as the grid prefill runs it (mlx-lm's call): q [1, 32, 2048, 128]
against the first `keys` rows of a reserved K / V buffer [1, 4, keys + 1024, 128] (bf16, a
slice, as KVCache hands it over), mask "causal". Prints, per key count, the peak memory of the
call above what was allocated before it, minus its output, for the sliced buffer and for a
contiguous copy of the same keys: memory that grows with the keys here grows with the prompt in
every engine that prefills through MLX's attention (ours and mlx-lm's)."""

from __future__ import annotations

import mlx.core as mx


def one(keys: int, sliced: bool, H=32, Hk=4, D=128, L=2048):
    q = mx.random.normal((1, H, L, D)).astype(mx.bfloat16)
    cap = keys + 1024 if sliced else keys
    k = mx.random.normal((1, Hk, cap, D)).astype(mx.bfloat16)
    v = mx.random.normal((1, Hk, cap, D)).astype(mx.bfloat16)
    mx.eval(q, k, v)
    ks, vs = (k[..., :keys, :], v[..., :keys, :]) if sliced else (k, v)
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    o = mx.fast.scaled_dot_product_attention(q, ks, vs, scale=D ** -0.5, mask="causal")
    mx.eval(o)
    mx.synchronize()
    return (mx.get_peak_memory() - before - o.nbytes) / 1e6


def main():
    print("| keys | extra MB, sliced K / V | extra MB, contiguous |")
    print("|---:|---:|---:|")
    gpu = mx.default_device().type == mx.gpu     # MLX's CPU attention materializes the scores
    for keys in ((2048, 16384, 65536, 131072) if gpu else (2048,)):
        a = [one(keys, True) for _ in range(2)][-1]
        b = [one(keys, False) for _ in range(2)][-1]
        print(f"| {keys} | {a:.1f} | {b:.1f} |", flush=True)


if __name__ == "__main__":
    main()
