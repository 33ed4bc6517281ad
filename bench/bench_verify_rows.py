"""What a verify call costs by its row count: the model's exact forward (the call a drafting round
makes: the last token plus k drafts, every row's logits) at M rows on a cache of --prompt tokens,
wall time a call with its result evaluated, the cache trimmed back after each call. Medians of
--repeat calls, in rounds that take every M in turn (so drift hits every M alike).

    python bench/bench_verify_rows.py --shape qwen3-8b-4bit --prompt 2048 --rows 1,8,9,16
    python bench/bench_verify_rows.py --model PATH

The engine's widest round verifies 1 + Engine.draft_width rows; this is the table that width is
chosen from (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--shape", help="write a random checkpoint of this shape (bench/shapes.py)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--rows", default="1,2,4,8,9,16")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    if bool(args.model) == bool(args.shape):
        ap.error("give one of --model / --shape")
    from tensorfold.engine import Engine

    path = args.model
    if args.shape:
        import shapes
        path = shapes.cached(args.shape, layers=args.layers)
    rows = [int(v) for v in args.rows.split(",")]
    eng = Engine(path, drafts=False)
    vocab = min(eng.model.cfg.vocab_size, eng.tokenizer.vocab_size)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, min(vocab, 500), size=args.prompt).tolist()
    cache, logits, _ = eng._prefill(ids, None, 0, room=max(rows) + 1)
    mx.eval(logits)
    base = len(ids)
    feeds = {m: mx.array([rng.integers(3, min(vocab, 500), size=m).tolist()]) for m in rows}

    def call(m):
        t0 = time.perf_counter()
        out = eng.model.forward(feeds[m], cache, exact=True, all_logits=True)
        mx.eval(out)
        dt = time.perf_counter() - t0
        cache.trim(base)
        return dt

    for m in rows:      # warm-up: compilation, allocation
        call(m), call(m)
    times = {m: [] for m in rows}
    for _ in range(args.repeat):
        for m in rows:
            times[m].append(call(m))
    print(f"# {path}  device={mx.default_device()}  mlx={mx.__version__}  cache {args.prompt} tokens  "
          f"medians of {args.repeat}")
    print("| rows | ms a call | / 1 row | ms a row |")
    print("|---|---|---|---|")
    one = statistics.median(times[rows[0]]) if rows[0] == 1 else None
    for m in rows:
        t = statistics.median(times[m]) * 1e3
        rel = f"{t / (one * 1e3):.2f}" if one else "-"
        print(f"| {m} | {t:.2f} | {rel} | {t / m:.3f} |", flush=True)


if __name__ == "__main__":
    main()
