"""One MoE layer's prefill expert matmuls: mlx-lm's gather_qmm (sorted) against TensorFold's
dequantize + gather_mm (sorted), Qwen3-30B-A3B shapes by default, on the default device.

    python bench/bench_moe_prefill.py                    # T = 16 .. 2048 tokens
    python bench/bench_moe_prefill.py --tokens 2048 --experts 128 --hidden 2048 --inter 768

Both run the routed SwiGLU MLP of `tokens` tokens (top-k of random router logits, sorted by
expert as mlx-lm's SwitchGLU does): gate and up [E, F, D], down [E, D, F], 4-bit g64. Each
timed call is evaluated (mx.eval); medians of --reps. "extra MB" is the call's peak memory above
what was allocated before it (the dequantized weights are transient). max |diff| is against the
gather_qmm result, relative to its max |value|.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx



from tensorfold.models.moe import Experts, _gather_sort, _scatter_unsort  # noqa: E402
from tensorfold.models.dense import swiglu  # noqa: E402


def make(E, F, D, bits=4, gs=64):
    def q(shape):
        w = (mx.random.normal(shape) * 0.02).astype(mx.bfloat16)
        wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
        return Experts(wq, s, b, gs, bits)
    g, u, d = q((E, F, D)), q((E, F, D)), q((E, D, F))
    mx.eval(*g.arrays(), *u.arrays(), *d.arrays())
    return g, u, d


def mlp(g, u, d, x, inds, dense: bool):
    xe = mx.expand_dims(x, (-2, -3))
    xe, idx, inv = _gather_sort(xe, inds)
    f = (lambda e, a: e.gather_dequantized(a, idx)) if dense else (lambda e, a: e.gather(a, idx, True))
    y = f(d, swiglu(f(g, xe), f(u, xe)))
    return _scatter_unsort(y, inv, inds.shape).squeeze(-2)


def timed(fn, reps):
    mx.eval(fn())
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), (mx.get_peak_memory() - base) / 2**20


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16,64,256,2048")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    E, k, D, F = a.experts, a.topk, a.hidden, a.inter
    g, u, d = make(E, F, D)
    print(f"device {mx.default_device()}, E={E} top-{k} D={D} F={F}, 4-bit g64, bf16 activations\n")
    print("| tokens | gather_qmm ms | dequantize + gather_mm ms | speed-up | extra MB qmm | extra MB dequant "
          "| max rel diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for T in [int(t) for t in a.tokens.split(",")]:
        x = (mx.random.normal((1, T, D)) * 0.5).astype(mx.bfloat16)
        logits = mx.random.normal((1, T, E))
        inds = mx.argpartition(logits, kth=-k, axis=-1)[..., -k:]
        mx.eval(x, inds)
        t_q, m_q = timed(lambda: mlp(g, u, d, x, inds, False), a.reps)
        t_d, m_d = timed(lambda: mlp(g, u, d, x, inds, True), a.reps)
        yq = mlp(g, u, d, x, inds, False).astype(mx.float32)
        yd = mlp(g, u, d, x, inds, True).astype(mx.float32)
        rel = (mx.abs(yq - yd).max() / mx.abs(yq).max()).item()
        print(f"| {T} | {t_q * 1e3:.2f} | {t_d * 1e3:.2f} | {t_q / t_d:.1f}x | {m_q:.0f} | {m_d:.0f} | {rel:.1e} |",
              flush=True)


if __name__ == "__main__":
    main()
