"""deepseek_v32 grid prefill: peak memory above weights + KV against prompt length (CPU-sized).

    python bench/dsa_prefill_memory.py [--heads 8,32] [--cells 1,2,4,6] [--grid 1024]

A random 2-layer mlx 4-bit deepseek_v32 checkpoint (tensorfold.testing, index_topk 256): each
prompt of cells x grid tokens is prefilled fresh (engine.prefill, MLX's ops); peak memory is read
with mx.get_peak_memory after clearing MLX's cache, less the memory active before and the KV cache.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="8,32")
    ap.add_argument("--cells", default="1,2,4,6")
    ap.add_argument("--grid", type=int, default=1024)
    a = ap.parse_args(argv)
    from tensorfold.engine.prefill import PrefillMode, prefill
    from tensorfold.models import load_model
    from tensorfold.testing import write_checkpoint

    print(f"# device={mx.default_device()} mlx={mx.__version__} grid={a.grid}")
    print("| index heads | prompt tokens | peak above weights + KV, MiB |")
    print("|---|---|---|")
    for hi in [int(x) for x in a.heads.split(",")]:
        p = write_checkpoint(Path(tempfile.mkdtemp()) / f"dsa{hi}", family="deepseek_v32", layout="mlx",
                             bits=4, group_size=32, seed=1, layers=2,
                             dsa=dict(index_topk=256, index_n_heads=hi))
        m = load_model(p)
        mx.eval(m.parameters())
        for cells in [int(x) for x in a.cells.split(",")]:
            n = a.grid * cells
            ids = np.random.default_rng(cells).integers(3, m.cfg.vocab_size, n).tolist()
            mx.clear_cache()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            c = m.new_cache()
            mx.eval(prefill(m, c, ids, PrefillMode(grid=a.grid)))
            extra = (mx.get_peak_memory() - base - sum(x.nbytes for x in c.arrays())) / 2**20
            print(f"| {hi} | {n} | {extra:.1f} |", flush=True)
            del c


if __name__ == "__main__":
    main()
