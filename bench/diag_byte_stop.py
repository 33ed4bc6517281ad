"""Session 57: why test_stop_completed_by_a_byte_run_at_the_last_token_is_a_stop found no two-byte
character in 40 sampled replies on CUDA (the CPU finds one in 11 of 40 seeds at the same width).
Prints the hits, the byte-token share, and the first step's top logprobs of our engine against
mlx-lm's forward on the same checkpoint and device."""
import json, pathlib, shutil, sys, tempfile

import mlx.core as mx
import numpy as np

sys.path.insert(0, "tests")
from test_tokenizer import _spm_dir
from tensorfold.testing import write_checkpoint
from tensorfold.engine import Engine
from tensorfold.engine.types import SamplingParams
from tensorfold.engine.prefill import PrefillMode

tmp = pathlib.Path(tempfile.mkdtemp())
spm = _spm_dir(tmp / "spm")
from tensorfold.testing import widened
ck = write_checkpoint(tmp / "model", **widened(dict(family="qwen3", layout="mlx", bits=4, seed=3, vocab_size=640)))
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(spm / f, ck / f)
(ck / "chat_template.jinja").unlink(missing_ok=True)
cfg = json.loads((ck / "config.json").read_text())
print({k: cfg.get(k) for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                               "head_dim", "num_hidden_layers", "vocab_size", "tie_word_embeddings")})
eng = Engine(ck, prefill_mode=PrefillMode(grid=16))
tok = eng.tokenizer
prompt = "The quick brown fox"
lead, cont = range(3 + 0xC2, 3 + 0xE0), range(3 + 0x80, 3 + 0xC0)
hits, nbyte, tot = [], 0, 0
for seed in range(int(sys.argv[1]) if len(sys.argv) > 1 else 40):
    text, ids, _ = eng.generate_text(prompt=prompt, max_tokens=120, sampling=SamplingParams(temperature=3.0, seed=seed),
                                     ignore_eos=True)
    if seed == 0:
        print("seed 0 ids", ids[:40])
    nbyte += sum(tok.is_byte_token(i) for i in ids)
    tot += len(ids)
    hit = next((j for j in range(1, len(ids) - 2) if ids[j] in lead and ids[j + 1] in cont
                and not tok.is_byte_token(ids[j - 1]) and not tok.is_byte_token(ids[j + 2])), None)
    if hit is not None and len(ch := tok.decode(ids[hit:hit + 2])) == 1 and ch in text:
        hits.append(seed)
print("device", mx.default_device(), "hits", hits, "byte share", round(nbyte / max(tot, 1), 3))
# the first step's distribution: ours (logprobs of the raw row) against mlx-lm's forward
evs = list(eng.generate(prompt=prompt, max_tokens=3, logprobs=20, sampling=SamplingParams(temperature=0.0)))
lps = [lp for ev in evs for lp in (ev.logprobs or [])]
ours = {i: v for i, v in lps[0].top}
from mlx_lm import load
model, _ = load(str(ck))
pids = eng.prepare(prompt=prompt).ids
print("prompt ids", pids)
logits = model(mx.array([pids]))[0, -1].astype(mx.float32)
ref = np.array(logits - mx.logsumexp(logits), dtype=np.float64)
top = np.argsort(-ref)[:20]
print("mlx-lm top5", [(int(i), round(float(ref[i]), 4)) for i in top[:5]])
print("ours   top5", [(i, round(v, 4)) for i, v in list(ours.items())[:5]])
common = [i for i in ours if i < ref.shape[0]]
print("max |ours - mlx-lm| over our top 20:", max(abs(ours[i] - ref[i]) for i in common))
p = np.exp(ref / 3.0 - np.max(ref / 3.0)); p /= p.sum()
print("at T 3: p(byte ids)", round(float(p[3:259].sum()), 3), "p(lead)", round(float(p[3 + 0xC2:3 + 0xE0].sum()), 3),
      "p(cont)", round(float(p[3 + 0x80:3 + 0xC0].sum()), 3))
