"""End-to-end exactness on the current default device with the real tinycode-4bit model:
row_check, drafted == serial (context copy + test mix proposer), resumed == fresh."""
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import tensorfold
from tensorfold.engine import Engine, PrefillMode, SamplingParams

path = Path(tensorfold.__file__).parent / "data" / "tinycode-4bit"
mode = PrefillMode(grid=int(sys.argv[1]) if len(sys.argv) > 1 else 2048)
t = time.time()
eng = Engine(path, prefill_mode=mode)
print("device", mx.default_device(), "row_exact", eng.row_exact, f"init {time.time()-t:.1f}s", flush=True)
if not eng.row_exact:
    print("ROW_CHECK FAILED: drafting is disabled, so drafted == serial below proves nothing", flush=True)
reqs = ["Show the function dumps from json.", "Show the function urlparse from urllib.parse.",
        "Show the function loads from json.", "Show the function join from os.path."]
ok = total = acc = dr = 0
for i, r in enumerate(reqs):
    for temp in (0.0, 0.8):
        p = SamplingParams(temperature=temp, top_p=0.95, seed=i)
        msgs = [{"role": "user", "content": r}]
        a = eng.generate_text(messages=msgs, max_tokens=96, sampling=p, draft=False)
        b = eng.generate_text(messages=msgs, max_tokens=96, sampling=p, draft=True)
        total += 1
        ok += a[1] == b[1]
        acc += b[2].accepted; dr += b[2].drafted
print(f"drafted == serial: {ok}/{total}   accepted {acc}/{dr} drafted tokens", flush=True)
# resumed == fresh, three turns
turns = [[{"role": "system", "content": "You write Python. " * 40},
          {"role": "user", "content": "Show the function dumps from json."}],
         [{"role": "user", "content": "Show the function loads from json."}],
         [{"role": "user", "content": "Show the function join from os.path."}]]
p = SamplingParams(temperature=0.7, seed=3)
msgs, same, cached = [], 0, []
for t_ in turns:
    msgs = msgs + t_
    a = eng.generate_text(messages=msgs, max_tokens=64, sampling=p)
    b = Engine(path, prefill_mode=mode, drafts=False).generate_text(messages=msgs, max_tokens=64, sampling=p)
    same += a[1] == b[1]
    cached.append(a[2].cached_tokens)
    msgs = msgs + [{"role": "assistant", "content": a[0]}]
print(f"resumed == fresh: {same}/3 turns, cached tokens per turn {cached}", flush=True)
