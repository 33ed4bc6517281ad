"""Benchmark: sparse selected-key attention (tensorfold.kernels.sparse_attention) vs MLX's
dense masked attention (mx.fast.scaled_dot_product_attention with an additive mask built
from the same selection), on the default device.

Shape (default: DeepSeek V3.2-style MLA decode per shard): 16 query heads, one shared
KV head, D = 576 latent, bf16; top-k 2048 keys per row chosen at random (distinct,
ascending, like select_topk's output); rows at the end of a KV buffer of S keys,
S in 8k / 32k / 64k / 128k; M = 1 (decode), M = 64 and M = 2048 (`--ms`; the prefill's grid
chunk: 2,048 rows).

    python bench/bench_sparse_attention.py            # all sizes
    python bench/bench_sparse_attention.py --quick    # 8k / 32k only (CPU)
    python bench/bench_sparse_attention.py --table    # markdown table
    python bench/bench_sparse_attention.py --table --stream 16   # + per call in a stream of 16
    python bench/bench_sparse_attention.py --table --stream 16 --compiled   # ... both compiled

Every timed call evaluates its result (mx.eval). Times are medians. Single calls rotate over
copies of K / V (and q, the indices, the mask) totalling at least --rotate-mb (default 128 MB,
twice the H200's L2), so that no call finds its keys in the cache from the call before; before
session 51 they did not, which flattered the sparse op's one-row calls (2,048 selected keys,
2.4 MB, stayed in the L2 while the dense op read all S keys). Peak memory is
mx.get_peak_memory() during the calls minus the memory active before them (the KV
buffers, q, the indices and the mask are already allocated), i.e. the op's own extra
memory. The dense mask is built once outside the timing (it stands for the selection;
building it per step would cost more still). select_topk is timed on fp32 scores [1, M, S].
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from tensorfold import kernels as K

FULL_KEYS = [8192, 32768, 65536, 131072]
QUICK_KEYS = [8192, 32768]
MS = [1, 64]
STREAM = 0            # --stream N
STREAM_MAX_M = 64     # the stream columns are timed for M <= this (a decode / verify call)
COMPILED = False      # --compiled
HOST_OFFSET = False   # --host-offset: pass the offset as a host-made int32 array instead of an int
ROTATE_BYTES = 128 << 20   # --rotate-mb: single calls cycle over copies of their inputs this large


def timed(fn, min_runs=3, budget_s=2.0):
    """(median seconds, extra peak bytes, last result): one warm-up call, then at least min_runs timed
    calls (2 when a call takes over 3 s) within budget_s; every result evaluated."""
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    mx.eval(fn())
    if time.perf_counter() - t0 > 3.0:
        min_runs = 2
    times, out = [], None
    t_end = time.perf_counter() + budget_s
    while len(times) < min_runs or (time.perf_counter() < t_end and len(times) < 50):
        out = None
        t0 = time.perf_counter()
        out = fn()
        mx.eval(out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), max(0, mx.get_peak_memory() - base), out


def bench_case(S, M, topk, Hq, Hkv, D, dtype, seed=0):
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((1, Hkv, S, D)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((1, Hkv, S, D)).astype(np.float32)).astype(dtype)
    q = mx.array(rng.standard_normal((1, Hq, M, D)).astype(np.float32)).astype(dtype)
    offset = S - M
    T = topk
    ind = np.full((1, M, T), -1, np.int32)
    mask = np.full((1, 1, M, S), -np.inf, np.float32)
    for i in range(M):
        p = offset + i
        sel = np.sort(rng.choice(p + 1, size=min(T, p + 1), replace=False)).astype(np.int32)
        ind[0, i, :len(sel)] = sel
        mask[0, 0, i, sel] = 0.0
    ind = mx.array(ind)
    mask = mx.array(mask).astype(dtype)
    scores = mx.array(rng.standard_normal((1, M, S)).astype(np.float32))
    mx.eval(k, v, q, ind, mask, scores)
    scale = D ** -0.5

    off = mx.array(offset, dtype=mx.int32) if HOST_OFFSET else offset
    per = k.nbytes + v.nbytes + q.nbytes + ind.nbytes + mask.nbytes
    n_copies = max(1, -(-ROTATE_BYTES // per))
    sets = [(q, k, v, ind, mask)] + [tuple(a * 1 for a in (q, k, v, ind, mask)) for _ in range(n_copies - 1)]
    mx.eval(sets)
    turn = [0]

    def next_set():
        turn[0] += 1
        return sets[turn[0] % n_copies]

    def ours():
        q_, k_, v_, ind_, _ = next_set()
        return K.sparse_attention(q_, k_, v_, ind_, off, scale)

    def theirs():
        q_, k_, v_, _, m_ = next_set()
        return mx.fast.scaled_dot_product_attention(q_, k_, v_, scale=scale, mask=m_)

    def topk_sel():
        return K.select_topk(scores, topk, offset)

    budget = 2.0 if S <= 32768 else 4.0
    t_ours, m_ours, o1 = timed(ours, budget_s=budget)
    builds = []                 # host time to build the op's graph (launches queued at eval)
    for _ in range(20):
        t0 = time.perf_counter()
        o = ours()
        builds.append(time.perf_counter() - t0)
        mx.eval(o)
    t_build = statistics.median(builds)
    t_dense, m_dense, o2 = timed(theirs, budget_s=budget)
    # same selection -> same result (within bf16 tolerance)
    err = float(mx.abs(o1.astype(mx.float32) - o2.astype(mx.float32)).max())
    del o1, o2
    t_topk, _, _ = timed(topk_sel, budget_s=budget)
    res = dict(S=S, M=M, err=err, copies=n_copies, ours_ms=t_ours * 1e3, dense_ms=t_dense * 1e3,
               build_ms=t_build * 1e3,
               topk_ms=t_topk * 1e3, ours_mb=m_ours / 2**20, dense_mb=m_dense / 2**20)
    if STREAM and M <= STREAM_MAX_M:
        res.update(stream_case(q, k, v, ind, mask, off, scale, STREAM))
    del k, v, q, ind, mask, scores, sets
    mx.clear_cache()
    return res


def stream_case(q, k, v, ind, mask, off, scale, layers: int, reps: int = 5):
    """Per-call time in a stream of `layers` calls, as a model's prefill issues them: each call on
    its own layer's K / V (copies, so no call finds another's keys in the L2), all results built
    and then evaluated together (every one of them), no wait between calls. Median over reps."""
    ks = [k * 1 for _ in range(layers)]
    vs = [v * 1 for _ in range(layers)]
    mx.eval(ks, vs)
    out = {}
    ours = lambda q_, k_, v_, ind_: K.sparse_attention(q_, k_, v_, ind_, off, scale)  # noqa: E731
    dense = lambda q_, k_, v_, m_: mx.fast.scaled_dot_product_attention(  # noqa: E731
        q_, k_, v_, scale=scale, mask=m_)
    if COMPILED:      # both ops replayed from a trace, as inside a compiled decode step
        ours, dense = mx.compile(ours), mx.compile(dense)
    for name, call in (("ours", lambda i: ours(q, ks[i], vs[i], ind)),
                       ("dense", lambda i: dense(q, ks[i], vs[i], mask))):
        mx.eval([call(i) for i in range(layers)])          # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            mx.eval([call(i) for i in range(layers)])
            times.append((time.perf_counter() - t0) / layers)
        out[f"{name}_stream_ms"] = statistics.median(times) * 1e3
    del ks, vs
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="8k / 32k keys only")
    ap.add_argument("--table", action="store_true", help="print a markdown table")
    ap.add_argument("--keys", default=None, help="comma-separated key counts")
    ap.add_argument("--ms", default=None, help="comma-separated row counts (default 1,64)")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--dim", type=int, default=576)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tc-tiles", default=None,
                    help="CUDA: DT,NST of the tensor-core form (_cuda.SPARSE_TC_TILES)")
    ap.add_argument("--rotate-mb", type=int, default=128,
                    help="single calls cycle over copies of their inputs totalling this many MB "
                         "(default 128: twice the H200's L2; 0: one set, the pre-session-51 mode)")
    ap.add_argument("--host-offset", action="store_true",
                    help="pass the offset as a host-made int32 array (MLX: managed memory on CUDA)")
    ap.add_argument("--stream", type=int, default=0, metavar="N",
                    help="also time each op inside a stream of N calls on N layers' K / V, "
                         "evaluated together (a prefill's view: no wait per call)")
    ap.add_argument("--compiled", action="store_true",
                    help="with --stream: both ops through mx.compile (no graph building per call)")
    a = ap.parse_args()
    global HOST_OFFSET, STREAM, COMPILED, ROTATE_BYTES
    HOST_OFFSET = a.host_offset
    ROTATE_BYTES = a.rotate_mb << 20
    STREAM = a.stream
    COMPILED = a.compiled
    if a.tc_tiles and K.backend_face() == "cuda":
        from tensorfold.kernels import _cuda
        _cuda.SPARSE_TC_TILES = tuple(int(x) for x in a.tc_tiles.split(","))
    keys = [int(x) for x in a.keys.split(",")] if a.keys else (QUICK_KEYS if a.quick else FULL_KEYS)
    ms = [int(x) for x in a.ms.split(",")] if a.ms else MS
    dtype = getattr(mx, a.dtype)
    dev = mx.default_device()
    face = K.backend_face()
    rows = []
    for S in keys:
        for M in ms:
            r = bench_case(S, M, a.topk, a.heads, a.kv_heads, a.dim, dtype)
            rows.append(r)
            if not a.table:
                print(f"S={S:6d} M={M:3d}  sparse {r['ours_ms']:9.2f} ms  dense {r['dense_ms']:9.2f} ms"
                      f"  x{r['dense_ms'] / r['ours_ms']:6.1f}  select_topk {r['topk_ms']:8.2f} ms"
                      f"  peak +{r['ours_mb']:.1f} / +{r['dense_mb']:.1f} MB  max|diff| {r['err']:.2e}"
                      f"  ({r['copies']} input copies)",
                      flush=True)
    if a.table:
        small = mx.ones((16,))
        mx.eval(small)
        floor = timed(lambda: small + 1)[0]
        print(f"sparse_attention vs dense masked sdpa, device {dev} (face {face}), "
              f"Hq={a.heads} Hkv={a.kv_heads} D={a.dim} {a.dtype}, top-k {a.topk}; single calls over "
              f"copies of {a.rotate_mb} MB or more; "
              f"median ms, extra peak MB; one trivial op + eval: {floor * 1e3:.3f} ms\n")
        st = (f" | in a stream of {STREAM}{' (compiled)' if COMPILED else ''}: sparse ms | dense ms "
              "| dense/sparse" if STREAM else "")
        print("| keys | M | sparse ms | dense masked ms | dense/sparse | select_topk ms "
              "| sparse peak MB | dense peak MB | max abs diff | sparse graph build ms" + st + " |")
        print("|---:" * (10 + (3 if STREAM else 0)) + "|")
        for r in rows:
            st = (f" | {r['ours_stream_ms']:.3f} | {r['dense_stream_ms']:.3f} | "
                  f"{r['dense_stream_ms'] / r['ours_stream_ms']:.1f}x" if "ours_stream_ms" in r
                  else " | - | - | -" if STREAM else "")
            print(f"| {r['S'] // 1024}k | {r['M']} | {r['ours_ms']:.2f} | {r['dense_ms']:.2f} | "
                  f"{r['dense_ms'] / r['ours_ms']:.1f}x | {r['topk_ms']:.2f} | {r['ours_mb']:.2f} | "
                  f"{r['dense_mb']:.2f} | {r['err']:.1e} | {r['build_ms']:.3f}{st} |")


if __name__ == "__main__":
    main()
