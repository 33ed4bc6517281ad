"""Where a MoE prefill's peak memory sits, layer by layer (issue 7's open memory item).

    python3 bench/gpu_moe_mem_trace.py --model PATH --prompts 2048,65536
    MLX_MAX_MB_PER_BUFFER=200 python3 bench/gpu_moe_mem_trace.py --model PATH ...

Prefills each prompt through the engine's own path (engine/prefill.py: grid chunks, the
LayerQueue) on a fresh cache and records, at every layer the queue takes (BoundedPrefill's
_layer_done), MLX's active memory and the peak since the previous record, less the weights and
the reserved KV cache. Prints per prompt: the highest peak, the chunk and layer where it was
reached, and the active memory there. H200 session 13: with the dequantized expert path, peak
above weights + KV was 4.63 GB at 2k and 6.17 GB at 64k on 48 layers, flat (3.08 GB) on 2
layers, and flat with gather_qmm (1.31 / 1.34 GB) or queue depth 1 (3.10 / 4.64 GB, the same
+1.54 GB) -- this trace says at which layer of which chunk the extra appears. Session 14: every
chunk's median was 4.61 GB; the extra was a spike at one (chunk, layer) a run. With each
dequantized projection queued on its own: 1.64 GB, spikes to 2.11 GB at 64k and 128k alike."""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", default="2048,65536")
    a = ap.parse_args()
    from tensorfold.engine.prefill import PrefillMode, prefill
    from tensorfold.models import load_model
    from tensorfold.models.bounded import BoundedPrefill

    model = load_model(a.model)
    mx.eval(model.parameters())
    vocab = model.cfg.vocab_size
    rec = []
    base = [0]
    chunk = [0]
    inner = BoundedPrefill._layer_done

    def layer_done(self, i, h, cache, exact):
        inner(self, i, h, cache, exact)
        if not exact:
            rec.append((mx.get_peak_memory() - base[0], mx.get_active_memory() - base[0], chunk[0], i))
            mx.reset_peak_memory()

    BoundedPrefill._layer_done = layer_done
    print("| prompt | KV GB | peak above weights + KV GB | at chunk | layer | active there GB | "
          "peak per chunk (GB, first / median / last) |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for n in (int(p) for p in a.prompts.split(",")):
        ids = np.random.default_rng(n).integers(3, min(vocab, 30000), size=n).tolist()
        cache = model.new_cache()
        cache.reserve(n + 16)
        mx.eval(cache.arrays())
        mx.synchronize()
        mx.clear_cache()
        base[0] = mx.get_active_memory()          # weights + the reserved KV
        kv = sum(x.nbytes for x in cache.arrays())
        rec.clear()
        mx.reset_peak_memory()

        def progress(e, total):
            chunk[0] += 1

        chunk[0] = 0
        prefill(model, cache, ids, PrefillMode(), progress=progress, reserve=n + 16)
        peak, act, c, i = max(rec)
        per_chunk = {}
        for p, _, ch, _ in rec:
            per_chunk[ch] = max(per_chunk.get(ch, 0), p)
        pc = [per_chunk[k] / 1e9 for k in sorted(per_chunk)]
        print(f"| {n} | {kv / 1e9:.3f} | {peak / 1e9:.3f} | {c} | {i} | {act / 1e9:.3f} | "
              f"{pc[0]:.2f} / {float(np.median(pc)):.2f} / {pc[-1]:.2f} |", flush=True)
        del cache


if __name__ == "__main__":
    main()
