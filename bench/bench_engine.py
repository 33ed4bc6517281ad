"""TensorFold vs mlx-lm on the same checkpoint, side by side in one process.

    python bench/bench_engine.py --model PATH [--prompts 512,2048] [--decode 128]
    python bench/bench_engine.py --shape small-4bit          # writes a random checkpoint first

Prints prompt tok/s, serial and drafted decode tok/s, acceptance and peak memory for both, and
the ratios. Every timed result is evaluated (MLX is lazy); each figure is a median of --repeat."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))


def mlx_lm_run(model, tok, prompt, n_decode):
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    mx.reset_peak_memory()
    last, t_first = None, None
    t0 = time.perf_counter()
    for r in stream_generate(model, tok, prompt, max_tokens=n_decode, sampler=make_sampler(0.0)):
        if t_first is None:
            t_first = time.perf_counter()
        last = r
    t_last = time.perf_counter()
    wall = t_last - t0
    n = last.generation_tokens
    # as ours (Engine: (tokens - 1) / (last token - first token)); mlx-lm's own generation_tps
    # counts n tokens over the n - 1 intervals after its first (+1.6% at 64 tokens)
    decode_tps = (n - 1) / (t_last - t_first) if n > 1 and t_last > t_first else last.generation_tps
    return dict(prompt_tps=last.prompt_tps, decode_tps=decode_tps,
                peak_gb=mx.get_peak_memory() / 1e9, tokens=n, wall=wall)


def ours_run(eng, prompt, n_decode, draft):
    from tensorfold.engine import SamplingParams

    mx.reset_peak_memory()
    eng.snapshots._entries.clear()          # time a fresh prefill
    t0 = time.perf_counter()
    _, ids, st = eng.generate_text(prompt=prompt, max_tokens=n_decode, draft=draft, ignore_eos=True,
                                   sampling=SamplingParams(temperature=0.0))
    wall = time.perf_counter() - t0
    return dict(prompt_tps=len(prompt) / st.prefill_s, decode_tps=st.decode_tps,
                peak_gb=mx.get_peak_memory() / 1e9, tokens=len(ids), wall=wall, ids=list(ids),
                accept=(st.accepted / st.drafted) if st.drafted else 0.0,
                # tokens emitted per decode call (each call emits its accepted drafts plus one)
                # (the first token is the prefill's, not a decode call's)
                per_round=(st.completion_tokens - 1) / max(1, st.completion_tokens - 1 - st.accepted))


def _fresh_kernels(eng):
    """Kernels and the compiled step made again at their next use (after a setting they read changed)."""
    from tensorfold.kernels import _cuda
    _cuda.clear_kernel_caches()     # the launch plans hold kernels too (session 43: they had kept inline ones)
    eng.model.__dict__.pop("_exact_step", None)


def _no_merge(on, eng):
    """The attention merge not launched (kernels._cuda.ATTN_NO_MERGE: wrong outputs, timing only)."""
    from tensorfold.kernels import _cuda
    _cuda.ATTN_NO_MERGE = on
    _fresh_kernels(eng)


def _other_text(on, eng):
    """The other CUDA kernel text mode than the one in effect (TENSORFOLD_CUDA_TEXT: "file", the default
    since session 43, or "inline"): the same operations from another text."""
    import os
    from tensorfold.kernels._sources import cuda_text_mode
    if on:
        _other_text.saved = os.environ.get("TENSORFOLD_CUDA_TEXT")
        os.environ["TENSORFOLD_CUDA_TEXT"] = "inline" if cuda_text_mode() == "file" else "file"
    elif _other_text.saved is None:
        os.environ.pop("TENSORFOLD_CUDA_TEXT", None)
    else:
        os.environ["TENSORFOLD_CUDA_TEXT"] = _other_text.saved
    _fresh_kernels(eng)


def med(runs, key):
    return statistics.median(r[key] for r in runs)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--shape", help="write a random checkpoint of this shape (bench/shapes.py)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--prompts", default="512,2048")
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prefill", choices=["mlx", "kernels"], default="mlx",
                    help="our prefill ops (mlx-lm always runs MLX's own forward)")
    ap.add_argument("--copy-prompt", action="store_true",
                    help="repetitive prompt (drafting can accept) instead of random ids")
    ap.add_argument("--host-decode", action="store_true",
                    help="serial greedy decode reads every step's logits back and samples on the "
                         "host (the path before pipelining; same tokens)")
    ap.add_argument("--other-step", action="store_true",
                    help="also time serial decode with the exact step run the other way "
                         "(eager by default; compiled under TENSORFOLD_COMPILE_DECODE=0)")
    ap.add_argument("--no-merge-too", action="store_true",
                    help="CUDA, timing only: also time serial decode with the attention merge not launched "
                         "(kernels._cuda.ATTN_NO_MERGE: wrong outputs), the most a fused merge could gain")
    ap.add_argument("--other-text-too", action="store_true",
                    help="CUDA: also time serial decode with the other kernel text mode (TENSORFOLD_CUDA_TEXT: "
                         "inline where files are in effect, the default, else files; the same operations)")
    ap.add_argument("--no-drafted", action="store_true",
                    help="skip the drafted runs (their column then repeats nothing: '-')")
    args = ap.parse_args(argv)

    import mlx_lm
    from tensorfold.engine import Engine, PrefillMode
    from gpu_kernel_time import use_staging_env
    use_staging_env()               # MM_STAGING / CP_UR: GEMM stagings (bench only)

    path = args.model
    if args.shape:
        import shapes
        path = shapes.cached(args.shape, layers=args.layers)
    eng = Engine(path, prefill_mode=PrefillMode(ops=args.prefill))
    eng._pipeline = not args.host_decode
    ref, tok = mlx_lm.load(str(path))
    tok._eos_token_ids = set()   # decode the full length on both sides
    vocab = eng.model.cfg.vocab_size
    variants = {}
    if args.no_merge_too:
        variants["no merge (timing only)"] = _no_merge
    if args.other_text_too:
        from tensorfold.kernels._sources import cuda_text_mode
        variants[f"kernel texts {'inline' if cuda_text_mode() == 'file' else 'in files'}"] = _other_text
    print(f"# {path}  device={mx.default_device()}  mlx={mx.__version__}  row_exact={eng.row_exact}  prefill={args.prefill}"
          f"  serial decode={'host' if args.host_decode else 'pipelined'}")
    print("| prompt | mlx-lm prompt tok/s | ours | ratio | mlx-lm decode tok/s | ours serial | ratio "
          "| ours drafted | accept | tok/call | peak GB mlx-lm | ours |" + ((" ours serial, eager step |" if eng.model.uses_compiled_step() else " ours serial, compiled step |") if args.other_step else "")
          + "".join(f" ours serial, {label} | ratio |" for label in variants))
    print("|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.other_step else "")
          + "---|---|" * len(variants))
    rng = np.random.default_rng(0)
    for n in [int(x) for x in args.prompts.split(",")]:
        if args.copy_prompt:
            base = rng.integers(3, min(vocab, 500), size=64).tolist()
            prompt = (base * (n // 64 + 1))[:n]
        else:
            prompt = rng.integers(3, min(vocab, 500), size=n).tolist()
        # warm up both (compilation, allocation)
        mlx_lm_run(ref, tok, prompt[:64], 4)
        ours_run(eng, prompt[:64], 4, False)
        ref_runs, ser_runs, dr_runs, other_runs = [], [], [], []
        var_runs = {label: [] for label in variants}
        for _ in range(args.repeat):
            ref_runs.append(mlx_lm_run(ref, tok, prompt, args.decode))
            ser_runs.append(ours_run(eng, prompt, args.decode, False))
            if not args.no_drafted:
                dr_runs.append(ours_run(eng, prompt, args.decode, True))
            for label, switch in variants.items():
                # trace the step again under the variant, outside the timed run: it is traced per (rows,
                # KV capacity), and the capacity follows the prompt and max_tokens, so the warm-up is the
                # same request (a shorter one left the trace in the timed prefill: session 42)
                switch(True, eng)
                try:
                    ours_run(eng, prompt, args.decode, False)
                    var_runs[label].append(ours_run(eng, prompt, args.decode, False))
                finally:
                    switch(False, eng)
                    ours_run(eng, prompt, args.decode, False)   # and back, before the next timed run
            if args.other_step:
                eng.model.compiled_decode = not eng.model.uses_compiled_step()
                try:
                    other_runs.append(ours_run(eng, prompt, args.decode, False))
                finally:
                    del eng.model.compiled_decode
        print(f"# {n}: decode tok/s per run: mlx-lm " + " ".join(f"{r['decode_tps']:.1f}" for r in ref_runs)
              + ", ours serial " + " ".join(f"{r['decode_tps']:.1f}" for r in ser_runs)
              + "".join(f", {label} " + " ".join(f"{r['decode_tps']:.1f}" for r in runs)
                        for label, runs in var_runs.items()),
              file=sys.stderr)
        for label, runs in var_runs.items():
            if variants[label] is not _no_merge:    # a variant of the same operations: the same tokens
                same = all(r["ids"] == ser_runs[0]["ids"] for r in runs + ser_runs)
                print(f"# {n}: {label}: {'the same tokens as' if same else 'OTHER TOKENS THAN'} ours serial",
                      file=sys.stderr)
        rp, op = med(ref_runs, "prompt_tps"), med(ser_runs, "prompt_tps")
        rd, od = med(ref_runs, "decode_tps"), med(ser_runs, "decode_tps")
        dr = (f"{med(dr_runs, 'decode_tps'):.1f} | {med(dr_runs, 'accept'):.2f} | {med(dr_runs, 'per_round'):.2f}"
              if dr_runs else "- | - | -")
        print(f"| {n} | {rp:.0f} | {op:.0f} | {op / rp:.2f} | {rd:.1f} | {od:.1f} | {od / rd:.2f} | {dr} | "
              f"{med(ref_runs, 'peak_gb'):.2f} | {med(ser_runs, 'peak_gb'):.2f} |"
              + (f" {med(other_runs, 'decode_tps'):.1f} |" if other_runs else "")
              + "".join(f" {med(runs, 'decode_tps'):.1f} | {med(runs, 'decode_tps') / od:.3f} |"
                        for runs in var_runs.values()),
              flush=True)


if __name__ == "__main__":
    main()
