"""What each part of the exact decode step really costs inside the pipelined decode loop
(issue 4): serial decode tok/s with one part of the step replaced by a no-op. The replies are
garbage by design; only the time is read. One process per ablation (patches act at import):

    for a in none attn merge kv norm swiglu; do python3 bench/gpu_ablate.py --shape qwen3-8b-4bit --ablate $a; done

none: the real step.  attn: row_attention returns q (no attention launches).  merge: only the
partial kernel runs (no merge launch).  kv: the KV cache writes are dropped (no scatters).
norm: mx.fast.rms_norm returns its input.  swiglu: swiglu(g, u) returns g."""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))


def patch(which: str) -> None:
    from tensorfold import kernels
    from tensorfold.kernels import _cuda
    from tensorfold.models import dense
    if which == "attn":
        kernels.row_attention = lambda q, k, v, off, scale, stream=None: q
    elif which == "merge":
        real = _cuda._kernel

        def attention(q, k, v, offset, scale, stream):
            B, HQ, M, D = q.shape
            HKV, cap = k.shape[1], k.shape[2]
            name, template, threads, smem, span = _cuda._attn_launch(q.dtype, k.dtype, v.dtype, D, HQ, HKV)
            nspan = -(-cap // span)
            part = real(name, smem)(
                inputs=[q, k, v, offset, _cuda._scale_array(scale * _cuda.LOG2E)], template=list(template),
                grid=(nspan * threads, B * HKV, 1), threadgroup=(threads, 1, 1),
                output_shapes=[(B * HQ * M, nspan, D + 2)], output_dtypes=[mx.float32], stream=stream)[0]
            return part[:, 0, :D].reshape(q.shape).astype(q.dtype)
        _cuda.attention = attention
    elif which == "kv":
        dense.StepCache.write = lambda self, layer, k, v: (self.keys[layer], self.values[layer])
    elif which == "norm":
        mx.fast.rms_norm = lambda x, w, eps: x
    elif which == "swiglu":
        dense.swiglu = lambda g, u: g
    elif which != "none":
        raise SystemExit(f"unknown ablation {which}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b-4bit")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ablate", default="none")
    a = ap.parse_args()
    import shapes
    from bench_engine import ours_run
    from tensorfold.engine import Engine, PrefillMode
    path = shapes.cached(a.shape)
    patch(a.ablate)
    eng = Engine(path, prefill_mode=PrefillMode(ops="mlx"))
    import numpy as np
    prompt = np.random.default_rng(0).integers(3, 500, size=a.prompt).tolist()
    ours_run(eng, prompt[:64], 4, False)
    runs = [ours_run(eng, prompt, a.decode, False)["decode_tps"] for _ in range(a.repeat)]
    print(f"| {a.ablate} | {a.prompt} | {statistics.median(runs):.1f} | {' / '.join(f'{r:.1f}' for r in runs)} |")


if __name__ == "__main__":
    main()
