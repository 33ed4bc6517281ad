"""The cost of growing the KV cache chunk by chunk during a prefill, against reserving the
prompt's rows once (engine/prefill.py; TENSORFOLD_RESERVE_PROMPT=0 turns the reserve off).

Only the cache: each 2,048-row chunk writes its rows into every layer and is evaluated, as a
prefill does, without the model's compute, so the figure is the copying the growth adds.

    python bench/bench_kv_reserve.py [--layers 48 --kv-heads 4 --head-dim 128 --prompt 16384]
"""
from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from tensorfold.models.kv import KVCache


def run(upfront: bool, n: int, layers: int, heads: int, hd: int, chunk: int = 2048) -> float:
    c = KVCache(layers, heads, hd, mx.bfloat16)
    rows = mx.ones((1, heads, chunk, hd), mx.bfloat16)
    mx.eval(rows)
    t = time.perf_counter()
    if upfront:
        c.reserve(n)
    for s in range(0, n, chunk):
        c.reserve(s + chunk)
        for i in range(layers):
            c.write(i, rows, rows)
        c.offset += chunk
        mx.eval(c.arrays())
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    kv_gb = a.layers * 2 * a.kv_heads * a.head_dim * 2 * a.prompt / 1e9
    print(f"# {mx.default_device()}, mlx {mx.__version__}: {a.layers} layers x {a.kv_heads} KV heads x "
          f"{a.head_dim}, bf16, {a.prompt} rows in 2,048-row chunks ({kv_gb:.2f} GB of KV), median of {a.reps}")
    print("| cache | seconds |\n|---|---:|")
    for name, up in (("grown chunk by chunk", False), ("prompt reserved once", True)):
        print(f"| {name} | {statistics.median(run(up, a.prompt, a.layers, a.kv_heads, a.head_dim) for _ in range(a.reps)):.3f} |")


if __name__ == "__main__":
    main()
