"""Shadow-check every verify call of a real generation: is row j of a k-row exact forward
bit-identical to the same token fed alone? On the first mismatch, trace the ops of both runs and
print the first op whose row differs (input or output). Backend-agnostic (CPU: expect no mismatch).

The scenario is gpu_diag_resume.py's (tinycode-4bit, grid 16, three turns, resumed + drafted),
where the H200 gave resumed+drafted != serial on turn 1.
Run: python3 bench/gpu_diag_rows.py [--turns 3] [--max-tokens 64]"""
import argparse
import sys
from pathlib import Path

import mlx.core as mx

import tensorfold
from tensorfold import kernels
from tensorfold.engine import Engine, PrefillMode, SamplingParams
from tensorfold.models.loader import Linear

ap = argparse.ArgumentParser()
ap.add_argument("--turns", type=int, default=3)
ap.add_argument("--max-tokens", type=int, default=64)
ap.add_argument("--traces", type=int, default=3, help="op traces to print (first mismatches)")
ap.add_argument("--force-trace", action="store_true", help="trace the first call even if equal (self-test)")
args = ap.parse_args()

path = Path(tensorfold.__file__).parent / "data" / "tinycode-4bit"
eng = Engine(path, prefill_mode=PrefillMode(grid=16))
model = eng.model
print("mlx", mx.__version__, "face", kernels.backend_face(), "row_exact", eng.row_exact, flush=True)

# ---- op tracing -------------------------------------------------------------------------------
TRACE: list | None = None


def _rec(name, axis, inp, out):
    if TRACE is not None:
        TRACE.append((name, axis, inp, out))


_lin_exact = Linear.exact


def _traced_lin(self, x):
    y = _lin_exact(self, x)
    _rec(f"linear{tuple(self.shape) if self.shape else ''}", x.ndim - 2, x, y)
    return y


Linear.exact = _traced_lin
_attn = kernels.row_attention


def _traced_attn(q, k, v, offset, scale, *a, **kw):
    y = _attn(q, k, v, offset, scale, *a, **kw)
    _rec("row_attention", 2, q, y)
    return y


kernels.row_attention = _traced_attn
_rope = model.rope


def _traced_rope(x, off):
    y = _rope(x, off)
    _rec("rope", 2, x, y)
    return y


model.rope = _traced_rope
_rms = mx.fast.rms_norm


def _traced_rms(x, w, eps):
    y = _rms(x, w, eps)
    _rec(f"rms_norm[{x.shape[-1]}]", 1, x, y)
    return y


try:
    mx.fast.rms_norm = _traced_rms
except (AttributeError, TypeError):
    print("(cannot patch mx.fast.rms_norm; norms untraced)")


def _row(a, axis, j):
    return mx.take(a, mx.array([j]), axis=axis)


def trace(ids, cache):
    global TRACE
    TRACE = []
    out = orig(ids, cache, exact=True, all_logits=True)
    rec, TRACE = TRACE, None
    mx.eval(out, [r[2] for r in rec], [r[3] for r in rec])
    return out, rec


def first_diff(block_rec, single_rec, j):
    for n, ((name, ax, bi, bo), (_, _, si, so)) in enumerate(zip(block_rec, single_rec)):
        for what, b, s in (("input", bi, si), ("output", bo, so)):
            br = _row(b, ax, j)
            if br.shape != s.shape:
                return f"op {n} {name}: shape {br.shape} vs {s.shape}"
            if not bool(mx.array_equal(br, s).item()):
                d = mx.abs(br.astype(mx.float32) - s.astype(mx.float32))
                return (f"op {n} {name} {what} differs: max|d| {d.max().item():.3g}, "
                        f"{int((d > 0).sum().item())}/{d.size} elements; shape {tuple(s.shape)}")
    return (f"none of {len(block_rec)} traced ops differs (else an untraced op: embedding, "
            f"residual add, swiglu)")


# ---- shadow check of each multi-row exact call ------------------------------------------------
orig = model.forward
stats = {"calls": 0, "rows": 0, "bad_calls": 0, "cap_dep": 0, "nondet": 0, "traced": 0}


def checked(ids, cache, *, exact, all_logits=False, logits=True):
    L = ids.shape[1]
    if not exact or L == 1 or not logits or not all_logits:
        return orig(ids, cache, exact=exact, all_logits=all_logits, logits=logits)
    off, cap = cache.offset, cache.capacity
    snap = cache.snapshot(off)
    mx.eval([a for kv in snap for a in kv])
    out = orig(ids, cache, exact=exact, all_logits=all_logits, logits=logits)
    mx.eval(out)
    stats["calls"] += 1
    stats["rows"] += L

    def restored():
        c = model.new_cache()
        c.restore(snap, off)
        return c

    c2 = restored()
    singles = [orig(ids[:, j:j + 1], c2, exact=True, all_logits=True) for j in range(L)]
    mx.eval(singles)
    bad = [j for j in range(L) if not bool(mx.array_equal(out[j], singles[j][0]).item())]
    kv_bad = [n for n, (a, b) in enumerate(zip(cache.keys + cache.values, c2.keys + c2.values))
              if not bool(mx.array_equal(a[..., off: off + L, :], b[..., off: off + L, :]).item())]
    if kv_bad:
        stats["kv_bad"] = stats.get("kv_bad", 0) + 1
        print(f"KV MISMATCH offset {off} L {L}: arrays {kv_bad} (written by the block vs by single steps)",
              flush=True)
    c3 = restored()
    again = orig(ids, c3, exact=True, all_logits=True)
    c4 = restored()
    s0 = orig(ids[:, :1], c4, exact=True, all_logits=True)
    mx.eval(again, s0)
    cap_dep = not bool(mx.array_equal(again, out).item())
    nondet = not bool(mx.array_equal(s0[0], singles[0][0]).item())
    stats["cap_dep"] += cap_dep
    stats["nondet"] += nondet
    if args.force_trace and not stats["traced"] and not bad:
        bad_rows, forced = [L - 1], True
    else:
        bad_rows, forced = bad, False
    if bad:
        stats["bad_calls"] += 1
    if bad_rows:
        print(f"{'(forced) ' if forced else ''}MISMATCH offset {off} L {L} cap {cap} (restored cap {c2.capacity}): rows {bad_rows}; "
              f"block(restored)==block {not cap_dep}; single twice equal {not nondet}", flush=True)
        if stats["traced"] < args.traces:
            stats["traced"] += 1
            _, brec = trace(ids, restored())
            j = bad_rows[0]
            c5 = restored()
            for t in range(j):
                orig(ids[:, t:t + 1], c5, exact=True, all_logits=True)
            _, srec = trace(ids[:, j:j + 1], c5)
            print("   first differing op for row", j, ":", first_diff(brec, srec, j), flush=True)
    if not bad_rows and (cap_dep or nondet):
        print(f"offset {off} L {L}: rows equal, but block(restored)==block {not cap_dep}, "
              f"single twice equal {not nondet}", flush=True)
    return out


model.forward = checked

turns = [[{"role": "system", "content": "You write Python. " * 40},
          {"role": "user", "content": "Show the function dumps from json."}],
         [{"role": "user", "content": "Show the function loads from json."}],
         [{"role": "user", "content": "Show the function join from os.path."}]][: args.turns]
p = SamplingParams(temperature=0.7, seed=3)
msgs = []
for i, t_ in enumerate(turns):
    msgs = msgs + t_
    text, ids, st = eng.generate_text(messages=msgs, max_tokens=args.max_tokens, sampling=p)
    print(f"turn {i}: {len(ids)} tokens, cached {st.cached_tokens}, accepted {st.accepted}/{st.drafted}; "
          f"so far {stats}", flush=True)
    msgs = msgs + [{"role": "assistant", "content": text}]

# a direct sweep: k-row windows at every offset of the last conversation, from a fresh prefill
full = eng.prompt_ids(msgs)
bad_sweep = 0
for off in range(16, len(full) - 9, 7):
    c = model.new_cache()
    model.forward(mx.array([full[:off]]), c, exact=False, logits=False)
    checked(mx.array([full[off: off + 9]]), c, exact=True, all_logits=True)
print("done", stats, flush=True)
sys.exit(1 if stats["bad_calls"] else 0)
