"""Do MLX's float matmuls give other bits when an operand is a strided slice? (session 47)

deepseek_v32's cache keeps each key's latent (kv_lora_rank) and rope part (qk_rope_head_dim) side
by side in one row; mlx-lm keeps them in two buffers. On the H200 our dense prefill (mlx-lm's ops
on slices of that row) gave float32 logits a few ulps from mlx-lm's (test_dsa.py's
test_dense_prefill_bitwise). This asks, per product of that path, whether the slice and a
contiguous copy of it give the same bits.

    python3 bench/mlx_strided_matmul_probe.py [model]

One line per case: the product, dtype, shapes, then "same" or the largest difference. With
`model`, also the test checkpoint deepseek_v32_hf_f32 (widened by $TF_TEST_HIDDEN) through our
prefill and mlx-lm's: the logits, each layer's hidden state, and at the first layer that differs
its attention and MLP given mlx-lm's input, so a difference is placed in one module."""
import mlx.core as mx
import numpy as np

CASES = [  # (S keys, kv_lora_rank, rope dims, heads, nope, v)
    (20, 64, 16, 4, 128, 64),      # the test checkpoint at TF_TEST_HIDDEN=256
    (20, 64, 16, 4, 32, 32),       # at the CI's width
    (2048, 512, 64, 16, 128, 128),  # DeepSeek-V3.2's dims (16 of its 128 heads)
]


def diff(a, b):
    d = mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item()
    return "same" if mx.array_equal(a, b).item() else f"differ, max |d| {d:.3g}"


def main():
    print(f"mlx {mx.__version__} {mx.default_device()}")
    rng = np.random.default_rng(0)
    for S, kvr, rd, H, nope, v in CASES:
        for dt in (mx.float32, mx.bfloat16):
            row = mx.array(rng.standard_normal((1, 1, S + 7, kvr + rd), dtype=np.float32)).astype(dt)
            lat, kpe = row[..., :S, :kvr], row[..., :S, kvr:]
            latc, kpec = mx.contiguous(lat), mx.contiguous(kpe)
            wk = mx.array(rng.standard_normal((H, kvr, nope), dtype=np.float32)).astype(dt)
            wv = mx.array(rng.standard_normal((H, v, kvr), dtype=np.float32)).astype(dt)
            qpe = mx.array(rng.standard_normal((1, H, S, rd), dtype=np.float32)).astype(dt)
            mx.eval(row, latc, kpec, wk, wv, qpe)
            tag = f"S={S} kvr={kvr} rd={rd} H={H} nope={nope} v={v} {dt}"
            print(f"{tag} lat @ embed_q: {diff(lat @ wk, latc @ wk)}")
            print(f"{tag} lat @ unembed_out.T: {diff(lat @ wv.swapaxes(-1, -2), latc @ wv.swapaxes(-1, -2))}")
            print(f"{tag} q_pe @ k_pe.T: {diff(qpe @ kpe.swapaxes(-1, -2), qpe @ kpec.swapaxes(-1, -2))}")


class _Strided:
    """dsa.py's mlx.core with mx.contiguous as the identity: its dense path on the slices as before
    session 47's copies (patched in after loading: the loader's own copies stay)."""
    contiguous = staticmethod(lambda a: a)

    def __getattr__(self, name):
        return getattr(mx, name)


def model(strided: bool):
    import pathlib
    import sys
    import tempfile

    import mlx_lm
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import make_prompt_cache

    from tensorfold.models import load_model
    from tensorfold.testing import DEFAULT_SET, widened, write_checkpoint
    p = write_checkpoint(pathlib.Path(tempfile.mkdtemp()) / "f32", **widened(DEFAULT_SET["deepseek_v32_hf_f32"]))
    ours, (ref, _) = load_model(p), mlx_lm.load(str(p))
    from tensorfold.models import dsa
    dsa.mx = _Strided() if strided else mx
    n = ours.cfg.index_topk
    ids = mx.array([np.random.default_rng(1).integers(3, ours.cfg.vocab_size, size=n).tolist()])
    hs, done = {}, ours._layer_done
    ours._layer_done = lambda i, h, c, e: (hs.__setitem__(i, h), done(i, h, c, e))
    got = ours.forward(ids, ours.new_cache(), exact=False, all_logits=True)
    m, cache = ref.model, make_prompt_cache(ref)
    print(f"model hidden {ours.cfg.hidden_size} L={n}{' as before (slices)' if strided else ''}: logits {diff(got, ref(ids, cache=cache)[0])}")
    h = m.embed_tokens(ids)
    mask = create_attention_mask(h, None, return_array=True)
    first = None
    for i, layer in enumerate(m.layers):
        x, h = h, layer(h, mask, make_prompt_cache(ref)[i])
        d = diff(hs[i], h)
        print(f"layer {i} hidden: {d}")
        if d != "same" and first is None:
            first = (i, x)
    if first is None:
        return
    i, x = first
    ly, rl = ours.layers[i], m.layers[i]
    c = ours.new_cache()
    c.reserve(n)
    a = ours._attention(ly, i, mx.fast.rms_norm(x, ly.in_norm, ours.eps), c, False)
    ra = rl.self_attn(rl.input_layernorm(x), mask, make_prompt_cache(ref)[i])
    print(f"layer {i} attention given mlx-lm's input: {diff(a, ra)}")
    hm = x + ra
    y = ours._mlp(ly, mx.fast.rms_norm(hm, ly.post_norm, ours.eps), False)
    print(f"layer {i} mlp given mlx-lm's input: {diff(y, rl.mlp(rl.post_attention_layernorm(hm)))}")
    sys.stdout.flush()


if __name__ == "__main__":
    import sys
    main()
    if sys.argv[1:] == ["model"]:
        model(strided=True)
        model(strided=False)
