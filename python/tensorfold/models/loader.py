"""Read a model directory's weights (Hugging Face or mlx-community layout) lazily through MLX."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..errors import CheckpointError
from .config import ModelConfig, weight_files


class TrackedWeights(dict):
    """A checkpoint's tensors that remember which names the model read (get, [], pop), so that
    load_model can refuse the others: a tensor no module takes means config.json describes
    another model (fewer layers, another family), as mlx-lm's strict load refuses it. `copy`
    shares the record (deepseek_v32 splits kv_b_proj in a copy)."""

    def __init__(self, *args, used: set | None = None):
        super().__init__(*args)
        self.used = set() if used is None else used

    def get(self, key, default=None):
        if key in self:
            self.used.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        v = super().__getitem__(key)
        self.used.add(key)
        return v

    def pop(self, key, *default):
        if key in self:
            self.used.add(key)
        return super().pop(key, *default)

    def copy(self) -> "TrackedWeights":
        return TrackedWeights(self, used=self.used)

    def unused(self, cfg: ModelConfig) -> list[str]:
        """The names no module read, less what mlx-lm's sanitize drops for these families:
        precomputed RoPE frequencies, a tied model's lm_head, deepseek_v32's multi-token
        prediction layers (model.layers.N and up)."""
        def dropped(k: str) -> bool:
            if "rotary_emb.inv_freq" in k or (cfg.tie_embeddings and k.startswith("lm_head.")):
                return True
            parts = k.split(".")
            return (cfg.is_dsa and len(parts) >= 3 and parts[:2] == ["model", "layers"]
                    and parts[2].isdigit() and int(parts[2]) >= cfg.num_layers)
        return sorted(k for k in self if k not in self.used and not dropped(k))


def load_weights(path: Path) -> dict[str, mx.array]:
    """All tensors of the checkpoint, lazily (MLX maps them on first use)."""
    weights: dict[str, mx.array] = {}
    for f in weight_files(path):
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # MLX raises RuntimeError/ValueError for bad files
            raise CheckpointError(f"{f}: cannot read safetensors ({e})") from None
    return weights


class Linear:
    """A matmul weight, quantized (MLX affine) or not, with an optional bias.

    `__call__` is MLX's own op, exactly as mlx.nn.Linear / QuantizedLinear compute it (the prefill
    path). `exact` is the row-exact kernel (the decode path)."""

    __slots__ = ("weight", "scales", "biases", "bias", "group_size", "bits", "shape")

    def __init__(self, weight, scales=None, biases=None, bias=None, group_size=None, bits=None, shape=None):
        self.weight, self.scales, self.biases, self.bias = weight, scales, biases, bias
        self.group_size, self.bits, self.shape = group_size, bits, shape

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    def __call__(self, x):
        if self.quantized:
            y = mx.quantized_matmul(x, self.weight, self.scales, self.biases, transpose=True,
                                    group_size=self.group_size, bits=self.bits)
            return y + self.bias if self.bias is not None else y
        if self.bias is not None:
            return mx.addmm(self.bias, x, self.weight.T)
        return x @ self.weight.T

    def exact(self, x, residual=None):
        """The row-exact product (+ bias), plus `residual` where given (the layer's residual add:
        fused into the CUDA 4-bit kernel's store, kernels.row_quantized_matmul)."""
        from .. import kernels
        if self.quantized and self.bias is None:
            return kernels.row_quantized_matmul(x, self.weight, self.scales, self.biases,
                                                self.group_size, self.bits, residual=residual)
        if self.quantized:
            y = kernels.row_quantized_matmul(x, self.weight, self.scales, self.biases,
                                             self.group_size, self.bits)
        else:
            y = kernels.row_matmul(x, self.weight)
        y = y + self.bias if self.bias is not None else y
        return y if residual is None else y + residual

    def embed(self, ids):
        """Rows of the weight (an embedding table), as mlx.nn.(Quantized)Embedding computes them."""
        if self.quantized:
            return mx.dequantize(self.weight[ids], scales=self.scales[ids], biases=self.biases[ids],
                                 group_size=self.group_size, bits=self.bits)
        return self.weight[ids]


def take_linear(cfg: ModelConfig, weights: dict, name: str, *, bias: bool = False) -> Linear:
    out_dim, in_dim = cfg.linear_shapes()[name]
    w = weights.get(f"{name}.weight")
    if w is None:
        raise CheckpointError(f"{cfg.path}: missing tensor {name}.weight")
    b = weights.get(f"{name}.bias")
    if bias and b is None:
        raise CheckpointError(f"{cfg.path}: missing tensor {name}.bias")
    if b is not None and not bias:    # never dropped silently: the outputs would be wrong
        raise CheckpointError(f"{cfg.path}: {name}.bias is not used by this family's config "
                              f"({cfg.family}: attention_bias {cfg.attention_bias}, mlp_bias {cfg.mlp_bias})")
    if b is not None and tuple(b.shape) != (out_dim,):
        raise CheckpointError(f"{cfg.path}: {name}.bias has shape {tuple(b.shape)}, expected {(out_dim,)}")
    scales = weights.get(f"{name}.scales")
    if scales is None:
        if tuple(w.shape) != (out_dim, in_dim):
            raise CheckpointError(
                f"{cfg.path}: {name}.weight has shape {tuple(w.shape)}, expected {(out_dim, in_dim)}")
        if w.dtype not in (mx.bfloat16, mx.float16, mx.float32):
            raise CheckpointError(f"{cfg.path}: {name}.weight has unsupported dtype {w.dtype}")
        return Linear(w, bias=b, shape=(out_dim, in_dim))
    q = cfg.quant_of_stored(name, in_dim, w, scales)
    if q is None:
        raise CheckpointError(f"{cfg.path}: {name} is quantized but config.json has no quantization for it")
    gs, bits = q
    biases = weights.get(f"{name}.biases")
    want_w = (out_dim, in_dim * bits // 32)
    want_s = (out_dim, in_dim // gs)
    if w.dtype != mx.uint32 or tuple(w.shape) != want_w or tuple(scales.shape) != want_s \
            or biases is None or tuple(biases.shape) != want_s:
        raise CheckpointError(
            f"{cfg.path}: {name} does not match {bits}-bit group-{gs} quantization of a "
            f"{out_dim}x{in_dim} weight (weight {tuple(w.shape)} {w.dtype}, scales {tuple(scales.shape)})")
    check_scales(cfg, name, scales, biases)
    return Linear(w, scales, biases, bias=b, group_size=gs, bits=bits, shape=(out_dim, in_dim))


def check_scales(cfg: ModelConfig, name: str, scales, biases) -> None:
    """Quantization scales and biases: one float dtype (what MLX's ops and ours read)."""
    if scales.dtype not in (mx.bfloat16, mx.float16, mx.float32) or biases.dtype != scales.dtype:
        raise CheckpointError(f"{cfg.path}: {name} has scales {scales.dtype} and biases {biases.dtype}; "
                              "expected one of bfloat16, float16, float32 for both")


def fuse_linears(weights: dict, names: list[str], lins: list[Linear]) -> Linear | None:
    """One Linear whose output rows are `lins`' stacked in order (same input, same quantization),
    for the decode path: one row-exact launch instead of len(lins). Each of `lins` is rebound to
    row slices of the fused arrays (views: no second copy; MLX's own ops see the same values,
    so the prefill path is unchanged), and the checkpoint's tensors are dropped from `weights`.
    None (nothing changed) when the linears cannot share one matmul."""
    first = lins[0]
    fields = ("weight", "scales", "biases", "bias")

    def kind(lin):   # what must agree for the rows to share one matmul
        return (lin.group_size, lin.bits, lin.shape[1],
                tuple(None if getattr(lin, f) is None else getattr(lin, f).dtype for f in fields))
    if any(kind(lin) != kind(first) for lin in lins):
        return None
    cat = {f: (None if getattr(first, f) is None else
               mx.concatenate([getattr(l, f) for l in lins], axis=0)) for f in fields}
    fused = Linear(cat["weight"], cat["scales"], cat["biases"], cat["bias"], first.group_size,
                   first.bits, shape=(sum(l.shape[0] for l in lins), first.shape[1]))
    mx.eval([a for a in cat.values() if a is not None])
    o = 0
    for lin in lins:
        n = lin.shape[0]
        for f in fields:
            if cat[f] is not None:
                setattr(lin, f, cat[f][o: o + n])
        o += n
    for name in names:
        for f in fields:
            weights.pop(f"{name}.{f}", None)
    return fused


def take_vector(cfg: ModelConfig, weights: dict, name: str, size: int):
    t = weights.get(name)
    if t is None:
        raise CheckpointError(f"{cfg.path}: missing tensor {name}")
    if tuple(t.shape) != (size,):
        raise CheckpointError(f"{cfg.path}: {name} has shape {tuple(t.shape)}, expected {(size,)}")
    if t.dtype not in (mx.bfloat16, mx.float16, mx.float32):
        # an integer norm weight would have been promoted through the layer (float32 activations)
        raise CheckpointError(f"{cfg.path}: {name} has unsupported dtype {t.dtype}")
    return t


def mlx_cuda_qmm_overreads(cfg: ModelConfig) -> list[str]:
    """The quantized modules whose prefill products MLX's CUDA quantized matmul computes by reading
    past the end of its operands.

    MLX 0.32's tensor-core kernel for 8 rows and more (qmm_sm80_kernel, mlx/backend/cuda/device/
    qmm_sm80.cuh) fetches K tiles 0 and 1 ahead, then tile 2 before it clamps the tile index, so
    where K <= 2 x its K tile (max(64, group size)) it reads up to two tiles past the last row of
    x and of the weight. compute-sanitizer on the H200 caught it (docs/benchmarks.md, "Session 45").
    Inside MLX's memory pool that read lands on a neighbour; at the pool's end it is an illegal
    address (CUDA error 700), which ends the process's use of the GPU. MLX takes that kernel where
    N % 128 == 0 and K % max(64, group size) == 0. Most real checkpoints' K (hidden, intermediate,
    heads x head_dim, LoRA ranks) are far above 128; small test models' are not, and neither is
    DeepSeek-V3.2's embed_q (per head 512 x 128: K = qk_nope_head_dim = 128), which its sparse
    prefill chunks multiply by (models/dsa.py, the absorbed q; unembed_out's K is 512)."""
    shapes = cfg.linear_shapes()        # the embedding is a gather, unless it is the tied head
    if not cfg.tie_embeddings:
        shapes.pop("model.embed_tokens")
    shapes.update({n: s[1:] for n, s in cfg.expert_shapes().items()})
    shapes.update({n: s[1:] for n, s in cfg.multilinear_shapes().items()})   # per head (out, in)
    out = []
    for name, (n, k) in shapes.items():
        q = cfg.quant_for(name)
        if q is not None:
            tile = max(64, q[0])
            if n % 128 == 0 and k % tile == 0 and k <= 2 * tile:
                out.append(name)
    return out
