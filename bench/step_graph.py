"""What one exact decode step of the CUDA face is made of, counted on any machine (no GPU needed).

    python bench/step_graph.py                      # qwen3_moe and qwen3, 8 layers
    python bench/step_graph.py --family qwen3_moe --layers 8

MLX's CUDA backend spends host time on every node of the step's graph: the compiled step replays
each one, then each is dispatched (a kernel launch for the custom kernels and MLX's own kernels,
less for views). On the H200 the decode step is bound by that host time (docs/benchmarks.md,
sessions 9-11), so the node count per layer is the quantity to cut. This script traces the
model's compiled-step body (`DenseModel._exact_body`, in-place KV writes) with the kernel faces
switched to CUDA and every CUDA kernel, and MLX's fused `rms_norm`, replaced by a stand-in
(zeros of the declared output shapes that depend on the inputs: the graph keeps its shape and
its edges), then counts the graph's nodes: kernel launches by name, and every other primitive
by type (the stand-ins' own nodes are subtracted). The small checkpoint's shapes do not change
the counts.
"""

from __future__ import annotations

import argparse
import collections
import re
import tempfile
from pathlib import Path

import mlx.core as mx

FAKE_NODES = {"Full", "Depends"}       # a stand-in: Full + Broadcast per output, one Depends


def trace(family: str, layers: int) -> tuple[collections.Counter, collections.Counter]:
    import tensorfold.kernels as K
    from tensorfold.kernels import _cuda
    from tensorfold.models import load_model
    from tensorfold.models.dense import _fence0
    from tensorfold.testing import write_checkpoint

    launches: collections.Counter = collections.Counter()
    outputs = [0]

    def stand_in(name, inputs, shapes, dtypes):
        launches[name] += 1
        outputs[0] += len(shapes)
        return mx.depends([mx.zeros(tuple(s), d) for s, d in zip(shapes, dtypes)], list(inputs))

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __call__(self, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **kw):
            return stand_in(self.name, inputs, output_shapes, output_dtypes)

    clear_caches = _cuda.clear_kernel_caches    # launch plans cache the kernel objects they were made with
    clear_caches()
    saved = (_cuda._kernel, _cuda._const_array, K._face_of, K.backend_face, K._gpu_stream, mx.fast.rms_norm)
    _cuda._kernel = lambda name, smem, unused_out=False: Kernel(name)
    _cuda._const_array = lambda v, d: mx.array(list(v), dtype=d)
    K._face_of = lambda gpu: "cuda"
    K.backend_face = lambda stream=None: "cuda"
    K._gpu_stream = lambda s: mx.default_stream(mx.cpu)
    mx.fast.rms_norm = lambda x, w, eps: stand_in("rms_norm (MLX)", [x, w], [x.shape], [x.dtype])[0]
    try:
        d = Path(tempfile.mkdtemp())
        kw = dict(layout="mlx", bits=4, layers=layers, hidden=256, heads=4, kv_heads=2, head_dim=64,
                  intermediate=512)
        if family == "qwen3_moe":
            kw.update(moe_intermediate=128, num_experts=16, experts_per_tok=8)
        m = load_model(write_checkpoint(d / "m", family=family, **kw))
        mx.eval(m.parameters())
        c = m.new_cache()
        c.reserve(2304)
        fences = [_fence0(m.dtype) for _ in range(layers)]
        off = c.step_offset()
        mx.eval(fences, off)
        launches.clear()
        outputs[0] = 0
        out = m._exact_body(mx.array([[5]]), off, c.keys, c.values, fences)
        flat = [out[0], *out[1], *out[2], out[3], *out[4]]
        mx.export_to_dot(str(d / "g.dot"), *flat)
        nodes = collections.Counter(re.findall(r'\[label ="([^"]*)", shape=rectangle\]',
                                               (d / "g.dot").read_text()))
    finally:
        (_cuda._kernel, _cuda._const_array, K._face_of, K.backend_face, K._gpu_stream,
         mx.fast.rms_norm) = saved
        clear_caches()
    for name in FAKE_NODES:
        nodes.pop(name, None)
    nodes["Broadcast"] -= outputs[0]
    return launches, +nodes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default=None, help="qwen3 | qwen3_moe (default: both)")
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    for fam in ([a.family] if a.family else ["qwen3", "qwen3_moe"]):
        launches, nodes = trace(fam, a.layers)
        n_l, n_o = sum(launches.values()), sum(nodes.values())
        print(f"{fam}, {a.layers} layers: {n_l} launches ({n_l / a.layers:.1f} per layer), "
              f"{n_o} other nodes ({n_o / a.layers:.1f} per layer)")
        print("  launches: " + ", ".join(f"{k} {v}" for k, v in launches.most_common()))
        print("  other:    " + ", ".join(f"{k} {v}" for k, v in nodes.most_common()))


if __name__ == "__main__":
    main()
