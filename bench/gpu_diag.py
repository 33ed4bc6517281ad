"""Diagnose NaNs / row-exactness on the GPU: each op of the dense model, GPU vs CPU."""
import mlx.core as mx
import numpy as np
from tensorfold.testing import write_checkpoint
from tensorfold.models import load_model
from tensorfold import kernels as K

p = write_checkpoint('/tmp/ck', family='qwen3', layout='mlx', bits=4, seed=1)
m = load_model(p)
ids = mx.array([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]])


def rep(name, a, ref=None):
    a32 = a.astype(mx.float32)
    s = f"{name:28s} nan={mx.isnan(a32).any().item()} inf={mx.isinf(a32).any().item()} absmax={mx.abs(a32).max().item():.4g}"
    if ref is not None:
        s += f" maxdiff_vs_cpu={mx.abs(a32 - ref.astype(mx.float32)).max().item():.4g}"
    print(s, flush=True)


x = m.embed.embed(ids)
with mx.stream(mx.cpu):
    xc = m.embed.embed(ids)
    mx.eval(xc)
rep("embed", x, xc)
l = m.layers[0]
h = mx.fast.rms_norm(x, l.in_norm, m.eps)
with mx.stream(mx.cpu):
    hc = mx.fast.rms_norm(xc, l.in_norm, m.eps); mx.eval(hc)
rep("rms_norm", h, hc)
for L in (1, 4, 8, 12):
    y = l.q(h[:, :L])
    with mx.stream(mx.cpu):
        yc = l.q(hc[:, :L]); mx.eval(yc)
    rep(f"mlx qmm L={L}", y, yc)
    ye = l.q.exact(h[:, :L])
    rep(f"row qmm L={L}", ye, yc)
for exact in (False, True):
    c = m.new_cache()
    lg = m.forward(ids, c, exact=exact, all_logits=True)
    rep(f"forward exact={exact}", lg)
try:
    import mlx_lm
    ref, _ = mlx_lm.load(str(p))
    rep("mlx_lm forward", ref(ids))
except Exception as e:
    print("mlx_lm", e)
# row check detail
rng = np.random.default_rng(0)
steps = rng.integers(3, 500, size=9).tolist()
c1 = m.new_cache(); m.forward(mx.array([[3, 4, 5, 6, 7]]), c1, exact=False, logits=False)
serial = [m.forward(mx.array([[t]]), c1, exact=True, all_logits=True)[0] for t in steps]
c2 = m.new_cache(); m.forward(mx.array([[3, 4, 5, 6, 7]]), c2, exact=False, logits=False)
block = m.forward(mx.array([steps]), c2, exact=True, all_logits=True)
mx.eval(serial, block)
print("row_check rows equal:", [bool(mx.array_equal(serial[i], block[i]).item()) for i in range(9)])
print("row diffs:", [mx.abs(serial[i].astype(mx.float32) - block[i].astype(mx.float32)).max().item() for i in range(9)])
# per-op row-invariance on this model's shapes
x16 = mx.random.normal((1, 9, m.cfg.hidden_size)).astype(mx.bfloat16)
one = [mx.fast.rms_norm(x16[:, i:i+1], l.in_norm, m.eps) for i in range(9)]
allr = mx.fast.rms_norm(x16, l.in_norm, m.eps)
print("rms_norm row-invariant:", all(mx.array_equal(one[i][0, 0], allr[0, i]).item() for i in range(9)))
q = mx.random.normal((1, 4, 9, 16)).astype(mx.bfloat16)
one = [m.rope(q[:, :, i:i+1], 10 + i) for i in range(9)]
allr = m.rope(q, 10)
print("rope row-invariant:", all(mx.array_equal(one[i][0, :, 0], allr[0, :, i]).item() for i in range(9)))
from tensorfold.models.dense import swiglu
a, b = mx.random.normal((1, 9, 128)).astype(mx.bfloat16), mx.random.normal((1, 9, 128)).astype(mx.bfloat16)
one = [swiglu(a[:, i:i+1], b[:, i:i+1]) for i in range(9)]
allr = swiglu(a, b)
print("swiglu row-invariant:", all(mx.array_equal(one[i][0, 0], allr[0, i]).item() for i in range(9)))
e1 = [m.embed.embed(mx.array([[t]])) for t in steps]
ea = m.embed.embed(mx.array([steps]))
print("embed row-invariant:", all(mx.array_equal(e1[i][0, 0], ea[0, i]).item() for i in range(9)))
