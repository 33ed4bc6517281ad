"""Device time of every kernel of one decode step (ours: compiled exact step; or mlx-lm's call),
by kernel name, under Nsight Compute (cold caches, each kernel alone):

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \\
        python3 bench/gpu_step_kernels.py --which ours > ours.csv
    python3 bench/gpu_step_kernels.py --report ours.csv

The checkpoint (--shape, default qwen3-8b-4bit) is written once to --dir and reused."""
from __future__ import annotations

import argparse
import csv
import ctypes
import glob
import os
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def cudart():
    import nvidia
    for base in list(nvidia.__path__):
        for lib in glob.glob(os.path.join(base, "*", "lib", "libcudart.so*")):
            return ctypes.CDLL(lib)
    return ctypes.CDLL("libcudart.so")


def report(path):
    rows = [r for r in csv.DictReader(l for l in open(path) if l.startswith('"'))]
    tot, cnt = defaultdict(float), defaultdict(int)
    for r in rows:
        name = (r.get("Kernel Name") or "").split("(")[0]
        name = name.split("<")[0][:60]
        v = float(r["Metric Value"].replace(",", ""))
        unit = r["Metric Unit"]
        us = v / 1e3 if unit in ("ns", "nsecond") else (v if unit in ("us", "usecond") else v * 1e3)
        tot[name] += us
        cnt[name] += 1
    all_us = sum(tot.values())
    print(f"# {path}: {sum(cnt.values())} kernels, {all_us / 1e3:.2f} ms device time in one step")
    print("| kernel | launches | total us | share |")
    print("|---|---|---|---|")
    for name in sorted(tot, key=lambda n: -tot[n])[:25]:
        print(f"| {name} | {cnt[name]} | {tot[name]:.0f} | {tot[name] / all_us:.1%} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--which", choices=["ours", "ours-compiled", "ref"])
    ap.add_argument("--shape", default="qwen3-8b-4bit")
    ap.add_argument("--dir", default="/tmp/tf-ckpt")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--report")
    args = ap.parse_args()
    if args.report:
        return report(args.report)
    import mlx.core as mx
    import shapes
    path = shapes.cached(args.shape, root=Path(args.dir))
    from gpu_step_profile import ours_step, ref_step
    ids = mx.random.randint(3, 500, (1, args.prompt)).astype(mx.int32)
    if args.which == "ref":
        step = ref_step(path, ids)
    else:
        model, step = ours_step(path, ids)
        model.compiled_decode = args.which == "ours-compiled"
    for _ in range(3):
        mx.eval(step())
    mx.synchronize()
    rt = cudart()
    rt.cudaProfilerStart()
    mx.eval(step())
    mx.synchronize()
    rt.cudaProfilerStop()


if __name__ == "__main__":
    main()
