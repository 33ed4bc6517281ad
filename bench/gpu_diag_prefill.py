"""Where does a resumed prefill's state leave the fresh one's? (gpu_diag_resume.py's turn 1)

Compares, bit for bit: the KV caches and first-token logits of turn 1's prompt prefilled fresh
(twice: determinism), resumed from the turn-0 snapshot (176 on tinycode, grid 16) and resumed
from 256; then feeds the fresh serial reply through each cache with exact steps and reports the
first step whose logits differ. Run: python3 bench/gpu_diag_prefill.py"""
from pathlib import Path

import mlx.core as mx

import tensorfold
from tensorfold.engine import Engine, PrefillMode, SamplingParams

path = Path(tensorfold.__file__).parent / "data" / "tinycode-4bit"
mode = PrefillMode(grid=16)
p = SamplingParams(temperature=0.7, seed=3)
t0 = [{"role": "system", "content": "You write Python. " * 40},
      {"role": "user", "content": "Show the function dumps from json."}]
eng = Engine(path, prefill_mode=mode)
reply0, _, st0 = eng.generate_text(messages=t0, max_tokens=64, sampling=p)
msgs = t0 + [{"role": "assistant", "content": reply0}, {"role": "user", "content": "Show the function loads from json."}]
ids = eng.prompt_ids(msgs)
print("turn-1 prompt", len(ids), "tokens", flush=True)


def kv_of(cache):
    return [a[..., : cache.offset, :] for a in cache.keys + cache.values]


def first_kv_diff(c1, c2):
    if c1.offset != c2.offset:
        return f"offsets {c1.offset} {c2.offset}"
    worst = None
    for n, (a, b) in enumerate(zip(kv_of(c1), kv_of(c2))):
        ne = mx.not_equal(a, b).any(axis=(0, 1, 3))
        if bool(ne.any().item()):
            pos = int(mx.argmax(ne.astype(mx.int32)).item())
            worst = pos if worst is None else min(worst, pos)
            print(f"   array {n} ({'k' if n < len(c1.keys) else 'v'} layer {n % len(c1.keys)}) first differing position {pos}")
    return "equal" if worst is None else f"first differing position {worst}"


# resumed from the turn-0 snapshot (the engine's own lookup)
ca, la, cached_a = eng._prefill(ids)
fresh1 = Engine(path, prefill_mode=mode, drafts=False)
cb, lb, _ = fresh1._prefill(ids)
fresh2 = Engine(path, prefill_mode=mode, drafts=False)
cc, lc, _ = fresh2._prefill(ids)
ca2, la2, cached_a2 = eng._prefill(ids)      # now resumes from the grid point a's prefill saved
mx.eval(la, lb, lc, la2)
print("resumed from", cached_a, "and", cached_a2)
print("fresh vs fresh (determinism):", first_kv_diff(cb, cc), "logits equal", bool(mx.array_equal(lb, lc).item()))
print(f"resumed {cached_a} vs fresh:", first_kv_diff(ca, cb), "logits equal", bool(mx.array_equal(la, lb).item()))
print(f"resumed {cached_a2} vs fresh:", first_kv_diff(ca2, cb), "logits equal", bool(mx.array_equal(la2, lb).item()))

# feed the fresh serial reply through two caches with exact one-row steps: first differing logits
_, reply_b, _ = Engine(path, prefill_mode=mode, drafts=False).generate_text(messages=msgs, max_tokens=64, sampling=p)


def first_step_diff(c1, c2):
    for j, tok in enumerate(reply_b[:-1]):
        l1 = eng.model.forward(mx.array([[tok]]), c1, exact=True, all_logits=True)
        l2 = eng.model.forward(mx.array([[tok]]), c2, exact=True, all_logits=True)
        if not bool(mx.array_equal(l1, l2).item()):
            return j
    return None


print(f"decode on resumed-{cached_a} vs fresh cache: first differing step", first_step_diff(ca, cb))
print(f"decode on resumed-{cached_a2} vs fresh cache: first differing step", first_step_diff(ca2, cc))
