"""Where does a decode step's time go? Ours (the exact step, compiled and eager) vs mlx-lm's model
call, on the same checkpoint after the same prompt: per step, the host time to build the graph,
the host time of mx.async_eval (MLX encoding and launching every kernel), and the wait for the
device after it. Medians over --steps sequential steps (no overlap between steps, so the parts
add up).

    python3 bench/gpu_step_profile.py --shape qwen3-8b-4bit [--prompt 2048] [--steps 40]
Per-kernel device time of one step: bench/gpu_step_kernels.py (under ncu)."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))


TOKEN = [[7]]


def ours_step(path, ids):
    """(model, step): our exact one-row forward after prefilling ids, kept at one position."""
    from tensorfold.models import load_model
    model = load_model(Path(path))
    c = model.new_cache()
    model.forward(ids, c, exact=False, logits=False)
    mx.eval(c.arrays())
    tok = mx.array(TOKEN, dtype=mx.int32)

    def step():
        out = model.forward(tok, c, exact=True, all_logits=True)
        c.trim(c.offset - 1)          # stay at the same position (same work every step)
        return out
    return model, step


def ref_step(path, ids):
    """mlx-lm's model call after prefilling ids, kept at one position."""
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache
    model, _ = mlx_lm.load(str(path))
    c = make_prompt_cache(model)
    mx.eval(model(ids, cache=c))
    tok = mx.array(TOKEN, dtype=mx.int32)

    def step():
        out = model(tok, cache=c)
        for layer in c:
            layer.trim(1)
        return out
    return step


def timed_steps(step, n):
    build, launch, wait = [], [], []
    for _ in range(n):
        mx.synchronize()
        t0 = time.perf_counter()
        out = step()
        t1 = time.perf_counter()
        mx.async_eval(out)
        t2 = time.perf_counter()
        mx.eval(out)
        t3 = time.perf_counter()
        build.append(t1 - t0)
        launch.append(t2 - t1)
        wait.append(t3 - t2)
    med = lambda xs: statistics.median(xs) * 1e3
    return med(build), med(launch), med(wait)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--shape")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    path = args.model
    if args.shape:
        import shapes
        path = shapes.cached(args.shape)
    ids = mx.random.randint(3, 500, (1, args.prompt)).astype(mx.int32)
    model, our_step = ours_step(path, ids)
    model.compiled_decode = True
    for _ in range(3):
        mx.eval(our_step())
    rows = [("ours (compiled exact step)",) + timed_steps(our_step, args.steps)]
    model.compiled_decode = False
    for _ in range(3):
        mx.eval(our_step())
    rows.append(("ours (eager exact step)",) + timed_steps(our_step, args.steps))
    del model, our_step
    mx.clear_cache()
    ref = ref_step(path, ids)
    for _ in range(3):
        mx.eval(ref())
    rows.append(("mlx-lm model call",) + timed_steps(ref, args.steps))
    print(f"# {path} prompt {args.prompt}, {args.steps} steps, mlx {mx.__version__}, {mx.default_device()}")
    print("| step | build ms | async_eval ms | device wait ms | total ms |")
    print("|---|---|---|---|---|")
    for name, b, l, w in rows:
        print(f"| {name} | {b:.2f} | {l:.2f} | {w:.2f} | {b + l + w:.2f} |", flush=True)


if __name__ == "__main__":
    main()
