"""H200 diagnostic: resumed + drafted vs resumed serial vs fresh, per turn (tinycode-4bit, grid 16).

On 2026-11-30 (H200) turn 1 gave resumed+drafted != resumed serial (first difference at reply
token 54) while fresh drafted == fresh serial and resumed serial == fresh serial; on the CPU all
equal. Run: python3 bench/gpu_diag_resume.py"""
from pathlib import Path
import tensorfold
from tensorfold.engine import Engine, PrefillMode, SamplingParams
path = Path(tensorfold.__file__).parent / "data" / "tinycode-4bit"
mode = PrefillMode(grid=16)
eng = Engine(path, prefill_mode=mode)
fresh = Engine(path, prefill_mode=mode)
turns = [[{"role": "system", "content": "You write Python. " * 40},
          {"role": "user", "content": "Show the function dumps from json."}],
         [{"role": "user", "content": "Show the function loads from json."}],
         [{"role": "user", "content": "Show the function join from os.path."}]]
p = SamplingParams(temperature=0.7, seed=3)
msgs = []
for i, t_ in enumerate(turns):
    msgs = msgs + t_
    a = eng.generate_text(messages=msgs, max_tokens=64, sampling=p)            # resumed, drafts
    a2 = eng.generate_text(messages=msgs, max_tokens=64, sampling=p, draft=False)  # resumed, serial
    fresh.cache_clear() if hasattr(fresh, "cache_clear") else None
    b = Engine(path, prefill_mode=mode, drafts=False).generate_text(messages=msgs, max_tokens=64, sampling=p)
    c = Engine(path, prefill_mode=mode).generate_text(messages=msgs, max_tokens=64, sampling=p)  # fresh, drafts
    first = lambda x, y: next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), None)
    print(i, "res+draft==fresh serial", a[1] == b[1], "res serial==fresh serial", a2[1] == b[1],
          "fresh draft==fresh serial", c[1] == b[1], "res draft==res serial", a[1] == a2[1],
          "first diff a/b", first(a[1], b[1]), "cached", a[2].cached_tokens, a2[2].cached_tokens,
          "accepted", a[2].accepted, c[2].accepted, flush=True)
    msgs = msgs + [{"role": "assistant", "content": a[0]}]
