"""qwen3_moe: TensorFold vs mlx-lm on the same random-weight MoE checkpoint, in one process.

    python bench/bench_moe.py --shape qwen3-30b-a3b [--layers 12]     # H200: 2k / 16k / 64k prompts
    python bench/bench_moe.py --shape small                           # CPU: 2k / 8k prompts
    python bench/bench_moe.py --model PATH --prompts 2048,8192

For each prompt length: prefill peak memory (GB, mx.get_peak_memory around the prompt +
decode), prompt tok/s and serial decode tok/s (greedy, --decode tokens), for mlx-lm's
stream_generate and for our Engine (grid prefill through MLX's forward with LayerQueue(2),
row-exact decode). Checkpoints are written like bench/shapes.py does: weights drawn with
mx.random on the default device (fast on a GPU), quantized tensor by tensor (stacked experts
[E, out, in] as mlx-community stores them; routers 8-bit as mlx-lm's qwen3_moe predicate).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

SHAPES = {
    # Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B)
    "qwen3-30b-a3b": dict(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, intermediate=6144,
                          moe_intermediate=768, experts=128, topk=8, vocab=151936),
    # small enough for MLX's CPU backend (its quantized / gather ops are not BLAS-backed)
    "small": dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=768,
                  moe_intermediate=128, experts=16, topk=4, vocab=8192),
}


def write_moe(name: str, out: Path, bits: int = 4, group_size: int = 64, seed: int = 0,
              layers: int | None = None) -> Path:
    from tensorfold.testing import write_checkpoint

    s = dict(SHAPES[name])
    if layers:
        s["layers"] = layers
    out = Path(out)
    write_checkpoint(out, family="qwen3_moe", layout="mlx", hidden=64, layers=1, heads=2, kv_heads=1,
                     intermediate=64, moe_intermediate=64)       # tokenizer / template files
    for f in out.glob("*.safetensors"):
        f.unlink()
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
               num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
               intermediate_size=s["intermediate"], moe_intermediate_size=s["moe_intermediate"],
               num_experts=s["experts"], num_experts_per_tok=s["topk"], decoder_sparse_step=1,
               mlp_only_layers=[], norm_topk_prob=True, vocab_size=s["vocab"],
               tie_word_embeddings=False, max_position_embeddings=131072, rope_theta=1000000.0)
    quant = {"group_size": group_size, "bits": bits, "mode": "affine"}
    for i in range(s["layers"]):
        quant[f"model.layers.{i}.mlp.gate"] = {"group_size": 64, "bits": 8}
    cfg["quantization"] = cfg["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    mx.random.seed(seed)
    d, hd, f, E = s["hidden"], s["head_dim"], s["moe_intermediate"], s["experts"]

    sys.path.insert(0, str(Path(__file__).parent))
    from shapes import ShardWriter, layer_norms, random_linear
    lin = lambda shape, std, b=bits: random_linear(shape, std, b, group_size)  # noqa: E731
    w = ShardWriter(out)
    w.put("model.embed_tokens", lin((s["vocab"], d), 1.0))
    for i in range(s["layers"]):
        p = f"model.layers.{i}"
        w.put(f"{p}.self_attn.q_proj", lin((s["heads"] * hd, d), d ** -0.5))
        w.put(f"{p}.self_attn.k_proj", lin((s["kv_heads"] * hd, d), d ** -0.5))
        w.put(f"{p}.self_attn.v_proj", lin((s["kv_heads"] * hd, d), d ** -0.5))
        w.put(f"{p}.self_attn.o_proj", lin((d, s["heads"] * hd), (s["heads"] * hd) ** -0.5 / 4))
        w.put(f"{p}.mlp.gate", lin((E, d), 2 * d ** -0.5, b=8))
        w.put(f"{p}.mlp.switch_mlp.gate_proj", lin((E, f, d), d ** -0.5))
        w.put(f"{p}.mlp.switch_mlp.up_proj", lin((E, f, d), d ** -0.5))
        w.put(f"{p}.mlp.switch_mlp.down_proj", lin((E, d, f), f ** -0.5 / 4))
        w.put("", layer_norms(p, d, hd))
        w.flush()
    w.put("lm_head", lin((s["vocab"], d), d ** -0.5 * 4))
    w.finish({"model.norm.weight": mx.ones((d,), mx.bfloat16)})
    return out


def mlx_lm_run(model, tok, prompt, n_decode):
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    last, pre, t_first = None, None, None
    for r in stream_generate(model, tok, prompt, max_tokens=n_decode, sampler=make_sampler(0.0)):
        if pre is None:                  # the prompt and the first token
            t_first = time.perf_counter()
            pre = mx.get_peak_memory()
            mx.reset_peak_memory()
        last = r
    t_last = time.perf_counter()
    n = last.generation_tokens
    # as ours: (tokens - 1) / (last - first); mlx-lm's generation_tps counts one token too many
    decode_tps = (n - 1) / (t_last - t_first) if n > 1 and t_last > t_first else last.generation_tps
    peak = max(pre, mx.get_peak_memory())
    return dict(prompt_tps=last.prompt_tps, decode_tps=decode_tps, peak_gb=peak / 1e9,
                extra_gb=(peak - before) / 1e9, prefill_extra_gb=(pre - before) / 1e9,
                decode_extra_gb=(mx.get_peak_memory() - before) / 1e9, snapshot_gb=0.0)


def ours_run(eng, prompt, n_decode):
    from tensorfold.engine import SamplingParams

    eng.snapshots._entries.clear()          # a fresh prefill every time
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    pre = []
    inner = eng._prefill

    def prefill(*args, **kw):             # the prompt's peak apart from the decode's
        out = inner(*args, **kw)
        pre.append(mx.get_peak_memory())
        mx.reset_peak_memory()
        return out

    eng._prefill = prefill
    try:
        _, ids, st = eng.generate_text(prompt=prompt, max_tokens=n_decode, draft=False, ignore_eos=True,
                                       sampling=SamplingParams(temperature=0.0))
    finally:
        del eng._prefill
    peak = max(pre[0], mx.get_peak_memory())
    return dict(prompt_tps=len(prompt) / st.prefill_s, decode_tps=st.decode_tps, peak_gb=peak / 1e9,
                extra_gb=(peak - before) / 1e9, prefill_extra_gb=(pre[0] - before) / 1e9,
                decode_extra_gb=(mx.get_peak_memory() - before) / 1e9,
                snapshot_gb=eng.snapshots.nbytes / 1e9)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="an existing qwen3_moe checkpoint")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="write a random checkpoint of this shape")
    ap.add_argument("--layers", type=int, help="shrink the shape to this many layers")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--out", help="where to write the checkpoint (default: a temp dir)")
    ap.add_argument("--prompts", help="prompt lengths, comma separated "
                                      "(default 2048,16384,65536 on a GPU, 2048,8192 on the CPU)")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--skip-mlx-lm", action="store_true")
    a = ap.parse_args(argv)
    gpu = mx.default_device().type == mx.gpu
    prompts = [int(p) for p in (a.prompts or ("2048,16384,65536" if gpu else "2048,8192")).split(",")]
    tmp = None
    if a.model:
        path = Path(a.model)
    else:
        shape = a.shape or ("qwen3-30b-a3b" if gpu else "small")
        if a.out:
            path = Path(a.out)
        else:
            tmp = tempfile.TemporaryDirectory()
            path = Path(tmp.name) / shape
        t = time.perf_counter()
        write_moe(shape, path, bits=a.bits, layers=a.layers)
        print(f"# wrote {shape} ({a.layers or SHAPES[shape]['layers']} layers, {a.bits}-bit) "
              f"in {time.perf_counter() - t:.0f} s", file=sys.stderr)

    from tensorfold.engine import Engine
    from tensorfold.models.config import ModelConfig

    cfg = ModelConfig.from_dir(path)
    eng = Engine(path, drafts=False, context=max(prompts) + a.decode + 16)
    ref = tok = None
    if not a.skip_mlx_lm:
        import mlx_lm
        ref, tok = mlx_lm.load(str(path))
    vocab = min(cfg.vocab_size, eng.tokenizer.vocab_size)
    # compile / first-use costs, for both: a 64-token prompt, and one past a whole 2,048-row chunk
    # (its shapes were first used inside the timed 2k runs, where mlx-lm ran second: its 2k
    # prompt rate came out below its 16k and 64k ones, session 50's review)
    for size in sorted({64, min(max(prompts), 2048 + 64)}):
        warm = np.random.default_rng(size).integers(3, vocab, size=size).tolist()
        ours_run(eng, warm, 4)
        if ref is not None:
            mlx_lm_run(ref, tok, warm, 4)
    rows = []
    for n in prompts:
        prompt = np.random.default_rng(n).integers(3, vocab, size=n).tolist()
        ours = ours_run(eng, prompt, a.decode)
        theirs = mlx_lm_run(ref, tok, prompt, a.decode) if ref is not None else None
        rows.append((n, ours, theirs))
        print(f"# {n}: ours {ours} mlx-lm {theirs}", file=sys.stderr)
    weights_gb = cfg.weight_bytes() / 1e9
    kv = lambda n: cfg.kv_bytes(n) / 1e9  # noqa: E731
    dev = "GPU" if gpu else "CPU"
    print(f"\n{dev}, {path.name}: {cfg.num_layers} layers, {cfg.num_experts} experts "
          f"({cfg.num_experts_per_tok} active), weights {weights_gb:.2f} GB, {a.decode} decode tokens\n")
    # peak: everything resident (both models' weights when mlx-lm runs too); extra: the
    # request's own peak above what was resident before it (KV cache, activations, snapshots)
    # snapshot: the prompt-cache entry ours keeps of the prompt's last grid point (a feature
    # mlx-lm does not have; part of "extra"). prefill / decode: the extra peak of each phase
    print("| prompt | peak GB ours | peak GB mlx-lm | extra GB ours | extra GB mlx-lm | KV GB "
          "| snapshot GB ours | prefill / decode extra GB ours | mlx-lm "
          "| prompt tok/s ours | mlx-lm | decode tok/s ours | mlx-lm |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, o, t in rows:
        f = (lambda k, fmt: fmt.format(t[k]) if t else "-")
        print(f"| {n} | {o['peak_gb']:.3f} | {f('peak_gb', '{:.3f}')} | {o['extra_gb']:.3f} | "
              f"{f('extra_gb', '{:.3f}')} | {kv(n):.3f} | {o['snapshot_gb']:.3f} | "
              f"{o['prefill_extra_gb']:.3f} / {o['decode_extra_gb']:.3f} | "
              f"{f('prefill_extra_gb', '{:.3f}')} / {f('decode_extra_gb', '{:.3f}')} | {o['prompt_tps']:.0f} | "
              f"{f('prompt_tps', '{:.0f}')} | {o['decode_tps']:.1f} | {f('decode_tps', '{:.1f}')} |")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
