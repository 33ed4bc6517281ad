"""Model configuration read from a checkpoint's config.json, validated before any weight is touched."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError

log = logging.getLogger("tensorfold")

DENSE_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
MOE_FAMILIES = {"qwen3_moe": "qwen3_moe"}     # Qwen3-30B-A3B layout (mlx-lm's qwen3_moe)
DSA_FAMILIES = {"deepseek_v32": "deepseek_v32"}   # MLA + lightning indexer + MoE (mlx-lm's deepseek_v32)
FAMILIES = {**DENSE_FAMILIES, **MOE_FAMILIES, **DSA_FAMILIES}
SUPPORTED_BITS = {2, 3, 4, 5, 6, 8}
MAX_LAYERS = 4096      # num_hidden_layers past this is a corrupt config (real models: up to ~128)
SUPPORTED_GROUPS = {32, 64, 128}
DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}


YARN_TYPES = ("yarn", "deepseek_yarn")


def rope_type_of(scaling: dict | None) -> str:
    """A rope_scaling's type as mlx-lm's initialize_rope reads it: "type" before "rope_type"."""
    sc = scaling or {}
    return sc.get("type") or sc.get("rope_type", "default")


def _quant_entry(e: dict) -> tuple:
    """(group_size, bits) of a quantization entry; null or absent values are MLX affine's defaults
    (64, 4), as nn.quantize reads them (mlx-lm's mixed recipes write "group_size": null)."""
    gs, bits = e.get("group_size"), e.get("bits")
    return (64 if gs is None else gs), (4 if bits is None else bits)


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: its index's, else model*.safetensors, else *.safetensors
    (what the loader reads, and what the prompt-cache key hashes)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: unreadable index ({type(e).__name__}: {e})") from None
        if not isinstance(wmap, dict) or not all(isinstance(f, str) for f in wmap.values()):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names")
        files = sorted({path / f for f in wmap.values()})
    else:   # mlx-lm's pattern (an adapter or a stray copy next to the weights is not merged in)
        files = sorted(f for f in path.glob("model*.safetensors") if f.is_file()) or \
            sorted(f for f in path.glob("*.safetensors") if f.is_file())
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weight files")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{path}: weight file {f.name} listed in the index is missing")
    return files


def checkpoint_has(path: Path, name: str) -> bool:
    """Whether the checkpoint at `path` stores tensor `name`: from the index's weight_map, else from
    the weight files' safetensors headers (8-byte length + JSON; no tensor data read). False where
    unreadable or absent (a directory with config.json only)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    try:
        if index.is_file():
            wmap = json.loads(index.read_text()).get("weight_map")
            return isinstance(wmap, dict) and name in wmap
        for f in weight_files(path):
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if not 0 < n < 1 << 28:
                    continue
                header = json.loads(fh.read(n))
            if isinstance(header, dict) and name in header:
                return True
    except (OSError, ValueError, AttributeError, CheckpointError):
        pass
    return False


# config.json's checked readers (null or absent: the default; a bad value a CheckpointError naming the key)
def _opt_int(raw: dict, key: str, default, low: int = 1):
    """An integer >= low (1: "a positive integer"). Sizes stay within what the kernels index (int32)
    and layer counts within MAX_LAYERS: a corrupt num_hidden_layers of 10^9 made `info` and `serve`
    list 10^9 layers' shapes (a hang), and a 10^30 max_position_embeddings was served as the context."""
    v = raw.get(key)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise CheckpointError(f"config.json: {key!r} must be {what}, got {v!r}"[:200])
    hi = MAX_LAYERS if key == "num_hidden_layers" else 2 ** 31 - 1
    if v > hi:
        raise CheckpointError(f"config.json: {key!r} is {v if v < 10 ** 12 else f'{v:.3g}'}, past "
                              f"{hi:,} (a corrupt config?)")
    return v


def _opt_num(d: dict, key: str, default):
    """A finite positive number, as a float."""
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf"):
        raise CheckpointError(f"config.json: {key!r} must be a positive number, got {v!r}"[:200])
    return float(v)


def _opt_bool(raw: dict, key: str, default):
    """true or false ("yes" was read as true)."""
    v = raw.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise CheckpointError(f"config.json: {key!r} must be true or false, got {v!r}"[:200])
    return v


@dataclass
class ModelConfig:
    path: Path
    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position: int
    tie_embeddings: bool
    attention_bias: bool               # q/k/v (and, for llama, o) projections carry a bias
    qk_norm: bool
    dtype: str
    quantization: dict | None          # {"group_size", "bits", <module path>: {...} | False}
    raw: dict = field(repr=False, default_factory=dict)
    mlp_bias: bool = False             # llama's mlp_bias: gate/up/down carry a bias
    rope_traditional: bool = False     # llama / qwen2: RoPE on interleaved pairs (mlx-lm's key)
    # MoE (qwen3_moe); num_experts == 0 for dense families
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()
    norm_topk_prob: bool = False
    # deepseek_v32 (models/dsa.py): MLA, the lightning indexer, group-limited sigmoid routing
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    indexer_rope_interleave: bool = False
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def trained_positions(self) -> int:
        """The context the model is made for: max_position_embeddings, or under yarn factor x
        original_max_position_embeddings where that is more (Qwen's long-context recipe adds yarn
        and leaves max_position_embeddings at the original 40,960)."""
        sc = self.rope_scaling or {}
        if rope_type_of(sc) in YARN_TYPES and sc.get("factor"):   # deepseek_yarn is yarn too
            scaled = int(sc["factor"] * sc.get("original_max_position_embeddings", self.max_position))
            return max(self.max_position, scaled)
        return self.max_position

    @property
    def is_dsa(self) -> bool:
        return self.family in DSA_FAMILIES

    def moe_layer(self, i: int) -> bool:
        """Whether layer i is a sparse MoE block (mlx-lm's rule), else a dense MLP."""
        if self.is_dsa:
            return (self.num_experts > 0 and i >= self.first_k_dense_replace
                    and i % self.moe_layer_freq == 0)
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_dir(cls, path) -> "ModelConfig":
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"model directory not found: {path}")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{path}: no config.json")
        try:
            raw = json.loads(cfg_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{cfg_file}: expected a JSON object")
        return cls.from_dict(raw, path)

    @classmethod
    def from_dict(cls, raw: dict, path: Path) -> "ModelConfig":
        mt = raw.get("model_type")
        if not isinstance(mt, str) or mt not in FAMILIES:
            raise CheckpointError(
                f"unsupported model_type {mt!r} (supported: {', '.join(sorted(FAMILIES))})")

        def need(key):
            """A positive integer that must be there."""
            if key not in raw:
                raise CheckpointError(f"config.json: missing {key!r}")
            if raw[key] is None:
                raise CheckpointError(f"config.json: {key!r} must be a positive integer, got None")
            return _opt_int(raw, key, None)

        def opt_int(key, default):
            return _opt_int(raw, key, default)

        def opt_num(key, default, d=raw):
            return _opt_num(d, key, default)

        def opt_bool(key, default):
            return _opt_bool(raw, key, default)

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = opt_int("num_key_value_heads", heads)
        if heads % kv_heads:
            raise CheckpointError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        head_dim = opt_int("head_dim", hidden // heads)
        rope_params = raw.get("rope_parameters") or {}
        if not isinstance(rope_params, dict):
            raise CheckpointError(f"config.json: 'rope_parameters' must be an object, got {rope_params!r}")
        types = raw.get("layer_types")
        if mt == "llama" and types is not None and (
                not isinstance(types, list) or any(t != "full_attention" for t in types)):
            # mlx-lm's llama masks "sliding_attention" layers to sliding_window (and keeps a
            # rotating cache for them); every layer here attends to the whole context
            raise CheckpointError(f"config.json: llama layer_types {sorted(set(map(str, types)))!r}: "
                                  "sliding-window layers are not supported")
        # mlx-lm's defaults: qwen2 1e6, the others 10000 (qwen3's requires it)
        default_theta = 1e6 if mt == "qwen2" else 10000.0
        rope_theta = opt_num("rope_theta", opt_num("rope_theta", default_theta, rope_params))
        rope_scaling = raw.get("rope_scaling") or (rope_params if rope_params else None)
        if rope_params and mt != "qwen3":
            # transformers 5 nests RoPE under rope_parameters (and may keep rope_theta at the top
            # level too); of mlx-lm 0.32's families here only qwen3 reads it: the others run the
            # top-level keys' RoPE, another model. Read here (the checkpoint's RoPE), said where
            # it changes anything mlx-lm would compute
            scaled = not raw.get("rope_scaling") and mt not in MOE_FAMILIES and (
                rope_type_of(rope_params) != "default" or set(rope_params) - {"rope_theta", "rope_type", "type"})
            if scaled or rope_theta != opt_num("rope_theta", default_theta):
                log.warning("config.json: RoPE read from rope_parameters (mlx-lm 0.32's %s ignores it: "
                            "its logits differ from these)", mt)
        if mt in MOE_FAMILIES and rope_scaling:
            # mlx-lm's qwen3_moe builds plain RoPE and never reads rope_scaling (so Qwen's yarn
            # recipe loads and runs unscaled there): the same here, or prefill != mlx-lm's
            log.warning("config.json: rope_scaling %r is ignored for qwen3_moe, as mlx-lm ignores it",
                        rope_type_of(rope_scaling) if isinstance(rope_scaling, dict) else rope_scaling)
            rope_scaling = None
        if rope_scaling is not None and not isinstance(rope_scaling, dict):
            raise CheckpointError(f"config.json: 'rope_scaling' must be an object, got {rope_scaling!r}")
        if rope_scaling:
            # a key set to null is the key left out (transformers reads `get(key) or default`):
            # kept, it reached the checks below and the model's RoPE as None (a TypeError at load)
            rope_scaling = {k: v for k, v in rope_scaling.items() if v is not None}
        if rope_scaling and (mt in DSA_FAMILIES or rope_type_of(rope_scaling) in YARN_TYPES):
            # deepseek_v32's, and YarnRoPE as mlx-lm's initialize_rope builds it for every family
            # (Qwen's long-context recipe: {"rope_type": "yarn", "factor": 4.0, ...: 32768})
            rope_scaling = cls._yarn_rope_scaling(rope_scaling, mt)
        elif rope_scaling:
            rtype = rope_type_of(rope_scaling)
            if rtype not in ("default", "linear", "llama3"):
                raise CheckpointError(f"unsupported rope_scaling type {rtype!r} (default, linear, "
                                      "llama3, yarn)")
            if rtype == "default":
                rope_scaling = None
            else:
                if opt_num("factor", None, rope_scaling) is None:
                    raise CheckpointError(f"config.json: rope_scaling of type {rtype!r} needs 'factor'")
                if rtype == "llama3":
                    for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                        opt_num(k, None, rope_scaling)
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
        if not isinstance(dtype, str) or dtype not in DTYPES:
            # only `info`'s estimates read it (the model computes in its weights' dtypes)
            log.warning("config.json: torch_dtype %r is not one of %s; estimates assume bfloat16",
                        dtype, "/".join(DTYPES))
            dtype = "bfloat16"
        quant = raw.get("quantization")
        qc = raw.get("quantization_config")
        if quant is None and isinstance(qc, dict) and qc.get("quant_method"):
            # AWQ, GPTQ, bitsandbytes, FP8, ...: not MLX affine (mlx-community's "quantization")
            raise CheckpointError(f"quantization_config quant_method {qc['quant_method']!r} is not "
                                  "supported; convert the checkpoint with mlx_lm.convert first")
        if quant is not None:
            cls._check_quant(quant)
        family = FAMILIES[mt]
        inter = need("intermediate_size")
        sizes = [("hidden_size", hidden), ("intermediate_size", inter)]
        if family not in DSA_FAMILIES:    # deepseek_v32's head sizes: _dsa_fields
            sizes.append(("head_dim", head_dim))
        for key, size in sizes:
            if size % 16:
                # every decode step runs the row-exact kernels (row_matmul's K, row_attention's
                # head size: multiples of 16); served, such a model failed each request with a 500
                raise CheckpointError(f"config.json: {key} {size} is not a multiple of 16 "
                                      "(the row-exact decode kernels need it)")
        moe = cls._moe_fields(raw, need, hidden) if family in MOE_FAMILIES else {}
        if family in DSA_FAMILIES:
            moe = cls._dsa_fields(raw, need, hidden, heads)
            head_dim = moe["qk_nope_head_dim"] + moe["qk_rope_head_dim"]
        return cls(
            path=path, family=family, hidden_size=hidden, num_layers=need("num_hidden_layers"),
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            intermediate_size=inter, vocab_size=need("vocab_size"),
            rms_norm_eps=opt_num("rms_norm_eps", 1e-6), rope_theta=rope_theta,
            rope_scaling=rope_scaling, max_position=opt_int("max_position_embeddings", 4096),
            # deepseek_v32 always has its own lm_head (mlx-lm's has no tie_word_embeddings)
            tie_embeddings=False if family in DSA_FAMILIES else cls._tied(raw.get("tie_word_embeddings"), path),
            attention_bias=family == "qwen2" or opt_bool("attention_bias", False),
            mlp_bias=family == "llama" and opt_bool("mlp_bias", False),
            # mlx-lm's qwen3 / qwen3_moe build RoPE with traditional=False whatever it says
            rope_traditional=family in ("llama", "qwen2") and opt_bool("rope_traditional", False),
            qk_norm=family in ("qwen3", "qwen3_moe"), dtype=dtype, quantization=quant, raw=raw,
            **moe)

    @staticmethod
    def _tied(v, path: Path) -> bool:
        """tie_word_embeddings: as given (a boolean); where config.json does not say, tied exactly
        when the checkpoint has no lm_head.weight (mlx-lm's llama / qwen2 default is tied, Hugging
        Face's llama default untied: each agrees with the weights it would load)."""
        if v is None:
            if checkpoint_has(path, "lm_head.weight"):
                log.warning("config.json does not set tie_word_embeddings and the checkpoint has "
                            "lm_head.weight: using it (mlx-lm 0.32 ties the embedding and ignores it, "
                            "so its logits differ from these)")
                return False
            return True
        if not isinstance(v, bool):
            raise CheckpointError(f"config.json: 'tie_word_embeddings' must be true or false, got {v!r}")
        return v

    @staticmethod
    def _moe_fields(raw: dict, need, hidden: int) -> dict:
        layers = need("num_hidden_layers")
        E, k = need("num_experts"), need("num_experts_per_tok")
        if k > E:
            raise CheckpointError(f"config.json: num_experts_per_tok {k} exceeds num_experts {E}")
        inter = need("moe_intermediate_size")
        step = raw.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
            raise CheckpointError(f"config.json: 'decoder_sparse_step' must be a positive integer, got {step!r}")
        only = raw.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise CheckpointError(f"config.json: 'mlp_only_layers' must be a list of layer indices, got {only!r}")
        bad = [i for i in only if not 0 <= i < layers]
        if bad:
            raise CheckpointError(f"config.json: mlp_only_layers {bad} outside 0..{layers - 1}")
        for key, size in (("hidden_size", hidden), ("moe_intermediate_size", inter)):
            if size % 16:
                raise CheckpointError(f"config.json: {key} {size} is not a multiple of 16 "
                                      "(the row-exact expert kernels need it)")
        return dict(num_experts=E, num_experts_per_tok=k, moe_intermediate_size=inter,
                    decoder_sparse_step=step, mlp_only_layers=tuple(sorted(set(only))),
                    norm_topk_prob=_opt_bool(raw, "norm_topk_prob", False))

    @staticmethod
    def _yarn_rope_scaling(sc, family: str = "deepseek_v32") -> dict:
        """A rope_scaling read as mlx-lm's initialize_rope reads it ("type" before "rope_type"):
        deepseek_v32's (default, linear, or yarn / deepseek_yarn: YarnRoPE; the dict is kept even
        for "default": mlx-lm's attention applies ``mscale_all_dim`` whatever the type), and the
        yarn types of the dense families. The returned dict's "type" is the type read."""
        if not isinstance(sc, dict):
            raise CheckpointError("config.json: rope_scaling must be an object")
        rtype = rope_type_of(sc)
        if rtype not in ("default", "linear", *YARN_TYPES):
            raise CheckpointError(f"{family}: unsupported rope_scaling type {rtype!r} "
                                  "(default, linear, yarn, deepseek_yarn)")
        num = (int, float)
        if rtype != "default" or "factor" in sc or sc.get("mscale_all_dim"):
            f = sc.get("factor")
            if not isinstance(f, num) or isinstance(f, bool) or not f > 0:
                raise CheckpointError(f"{family}: rope_scaling factor must be a positive number, got {f!r}")
        if rtype in YARN_TYPES:
            for key in ("original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                        "mscale_all_dim"):
                v = sc.get(key)
                if v is not None and (not isinstance(v, num) or isinstance(v, bool)):
                    raise CheckpointError(f"{family}: rope_scaling {key} must be a number, got {v!r}")
            if not sc.get("original_max_position_embeddings", 4096) > 0:
                raise CheckpointError(f"{family}: rope_scaling original_max_position_embeddings must be > 0")
            if not sc.get("beta_fast", 32) > 0 or not sc.get("beta_slow", 1) > 0:
                raise CheckpointError(f"{family}: rope_scaling beta_fast / beta_slow must be > 0")
        mad = sc.get("mscale_all_dim", 0)
        if mad is not None and (not isinstance(mad, num) or isinstance(mad, bool)):
            raise CheckpointError(f"{family}: rope_scaling mscale_all_dim must be a number, got {mad!r}")
        return dict(sc, type=rtype)

    @staticmethod
    def _dsa_fields(raw: dict, need, hidden: int, heads: int) -> dict:
        """deepseek_v32's own keys (mlx-lm's ModelArgs names), validated."""
        need("num_hidden_layers")
        f = {k: need(k) for k in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                  "v_head_dim", "index_n_heads", "index_head_dim", "index_topk")}
        if f["qk_rope_head_dim"] % 2 or f["index_head_dim"] < f["qk_rope_head_dim"]:
            raise CheckpointError("config.json: qk_rope_head_dim must be even and <= index_head_dim")
        if (f["kv_lora_rank"] + f["qk_rope_head_dim"]) % 16:
            raise CheckpointError(
                f"config.json: kv_lora_rank + qk_rope_head_dim = {f['kv_lora_rank'] + f['qk_rope_head_dim']} "
                "is not a multiple of 16 (the row-exact / sparse attention kernels need it)")
        if raw.get("topk_method", "noaux_tc") != "noaux_tc":
            raise CheckpointError(f"config.json: topk_method {raw.get('topk_method')!r} unsupported (noaux_tc only)")
        if raw.get("scoring_func", "sigmoid") != "sigmoid":
            raise CheckpointError(f"config.json: scoring_func {raw.get('scoring_func')!r} unsupported (sigmoid only)")
        def count(key, default):     # an integer >= 0 (0 / null: none)
            return _opt_int(raw, key, default, low=0)

        E = count("n_routed_experts", 0)
        moe = dict(num_experts=0)
        if E:
            k, inter = need("num_experts_per_tok"), need("moe_intermediate_size")
            if k > E:
                raise CheckpointError(f"config.json: num_experts_per_tok {k} exceeds n_routed_experts {E}")
            ng, tg = count("n_group", 1) or 1, count("topk_group", 1) or 1     # 0: none, as 1
            if E % ng or not 1 <= tg <= ng or (ng > 1 and E // ng < 2):
                raise CheckpointError(f"config.json: n_group {ng} / topk_group {tg} do not fit {E} experts")
            for key, size in (("hidden_size", hidden), ("moe_intermediate_size", inter)):
                if size % 16:
                    raise CheckpointError(f"config.json: {key} {size} is not a multiple of 16 "
                                          "(the row-exact expert kernels need it)")
            moe = dict(num_experts=E, num_experts_per_tok=k, moe_intermediate_size=inter,
                       norm_topk_prob=_opt_bool(raw, "norm_topk_prob", True), n_group=ng, topk_group=tg,
                       n_shared_experts=count("n_shared_experts", 0),
                       routed_scaling_factor=_opt_num(raw, "routed_scaling_factor", 1.0),
                       first_k_dense_replace=count("first_k_dense_replace", 0),
                       moe_layer_freq=count("moe_layer_freq", 1) or 1)
        return dict(f, indexer_rope_interleave=_opt_bool(raw, "indexer_rope_interleave", False), **moe)

    @staticmethod
    def _check_quant(q):
        if not isinstance(q, dict):
            raise CheckpointError("config.json: 'quantization' must be an object")
        entries = [("default", q)] + [(k, v) for k, v in q.items() if isinstance(v, dict)]
        for name, e in entries:
            mode = e.get("mode") or "affine"
            if mode != "affine":
                raise CheckpointError(f"unsupported quantization mode {mode!r} for {name} (only MLX affine)")
            gs, bits = _quant_entry(e)
            if bits not in SUPPORTED_BITS:
                raise CheckpointError(f"unsupported quantization bits {bits!r} for {name}")
            if gs not in SUPPORTED_GROUPS:
                raise CheckpointError(f"unsupported quantization group_size {gs!r} for {name}")

    def quant_of_stored(self, module: str, in_dim: int, weight, scales):
        """(group_size, bits) of a module the checkpoint stores quantized, as mlx-lm 0.32 loads it:
        its own entry in config.json's quantization, or else what the tensors' widths say
        (mlx_lm.utils.infer_quant_config: the top-level values are not read for it, so an 8-bit
        lm_head without an entry of its own is 8-bit). None where the config has no quantization
        or sets the module false."""
        q = self.quantization
        own = q.get(module) if q else None
        if not q or own is False:
            return None
        if isinstance(own, dict):
            return _quant_entry(own)
        cols = scales.shape[-1]
        gs = in_dim // cols if cols and in_dim % cols == 0 else None
        bits = weight.shape[-1] * 32 // in_dim if in_dim and weight.shape[-1] * 32 % in_dim == 0 else None
        if gs not in SUPPORTED_GROUPS or bits not in SUPPORTED_BITS:
            raise CheckpointError(f"{self.path}: {module}'s tensors (weight {tuple(weight.shape)}, scales "
                                  f"{tuple(scales.shape)}) are no supported quantization of {in_dim} inputs")
        return gs, bits

    def quant_for(self, module: str):
        """(group_size, bits) for a module path like 'model.layers.0.mlp.down_proj', or None.

        A module without an entry of its own is quantized with the top-level settings where MLX's
        nn.quantize would have quantized it (mlx-lm's convert): its input width a multiple of the
        group size. The loader goes by the tensors (a module with scales is quantized)."""
        q = self.quantization
        if not q:
            return None
        if self.is_dsa and module.endswith(".mlp.gate"):
            return None     # deepseek_v32's router (mlx-lm's MoEGate) is never quantized
        own = q.get(module)
        if own is False:
            return None
        if isinstance(own, dict):
            return _quant_entry(own)
        gs, bits = _quant_entry(q)
        in_dim = self._in_dims().get(module)
        if in_dim is not None and in_dim % gs:
            return None
        return gs, bits

    def _in_dims(self) -> dict[str, int]:
        d = self.__dict__.get("_in_dims_cache")
        if d is None:
            d = {name: shape[-1] for name, shape in self._matrices().items()}
            self.__dict__["_in_dims_cache"] = d
        return d

    # ---- module inventory (shapes as stored before quantization) -------------------------
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Every matmul weight as (out, in), by module path."""
        if self.is_dsa:
            return self._dsa_linear_shapes()
        d, hd = self.hidden_size, self.head_dim
        out = {}
        for i in range(self.num_layers):
            p = f"model.layers.{i}"
            out[f"{p}.self_attn.q_proj"] = (self.num_heads * hd, d)
            out[f"{p}.self_attn.k_proj"] = (self.num_kv_heads * hd, d)
            out[f"{p}.self_attn.v_proj"] = (self.num_kv_heads * hd, d)
            out[f"{p}.self_attn.o_proj"] = (d, self.num_heads * hd)
            if self.moe_layer(i):
                out[f"{p}.mlp.gate"] = (self.num_experts, d)           # the router
                continue
            out[f"{p}.mlp.gate_proj"] = (self.intermediate_size, d)
            out[f"{p}.mlp.up_proj"] = (self.intermediate_size, d)
            out[f"{p}.mlp.down_proj"] = (d, self.intermediate_size)
        out["model.embed_tokens"] = (self.vocab_size, d)
        if not self.tie_embeddings:
            out["lm_head"] = (self.vocab_size, d)
        return out

    def _dsa_linear_shapes(self) -> dict[str, tuple[int, int]]:
        d, H = self.hidden_size, self.num_heads
        out = {}
        for i in range(self.num_layers):
            p = f"model.layers.{i}.self_attn"
            out[f"{p}.q_a_proj"] = (self.q_lora_rank, d)
            out[f"{p}.q_b_proj"] = (H * self.head_dim, self.q_lora_rank)
            out[f"{p}.kv_a_proj_with_mqa"] = (self.kv_lora_rank + self.qk_rope_head_dim, d)
            out[f"{p}.o_proj"] = (d, H * self.v_head_dim)
            out[f"{p}.indexer.wq_b"] = (self.index_n_heads * self.index_head_dim, self.q_lora_rank)
            out[f"{p}.indexer.wk"] = (self.index_head_dim, d)
            out[f"{p}.indexer.weights_proj"] = (self.index_n_heads, d)
            p = f"model.layers.{i}.mlp"
            if self.moe_layer(i):
                out[f"{p}.gate"] = (self.num_experts, d)           # the router (never quantized)
                if self.n_shared_experts:
                    f = self.moe_intermediate_size * self.n_shared_experts
                    out[f"{p}.shared_experts.gate_proj"] = (f, d)
                    out[f"{p}.shared_experts.up_proj"] = (f, d)
                    out[f"{p}.shared_experts.down_proj"] = (d, f)
                continue
            out[f"{p}.gate_proj"] = (self.intermediate_size, d)
            out[f"{p}.up_proj"] = (self.intermediate_size, d)
            out[f"{p}.down_proj"] = (d, self.intermediate_size)
        out["model.embed_tokens"] = (self.vocab_size, d)
        if not self.tie_embeddings:
            out["lm_head"] = (self.vocab_size, d)
        return out

    def multilinear_shapes(self) -> dict[str, tuple[int, int, int]]:
        """deepseek_v32's per-head MLA weights (mlx-lm's MultiLinear) as (heads, out, in)."""
        if not self.is_dsa:
            return {}
        H, out = self.num_heads, {}
        for i in range(self.num_layers):
            p = f"model.layers.{i}.self_attn"
            out[f"{p}.embed_q"] = (H, self.kv_lora_rank, self.qk_nope_head_dim)
            out[f"{p}.unembed_out"] = (H, self.v_head_dim, self.kv_lora_rank)
        return out

    def expert_shapes(self) -> dict[str, tuple[int, int, int]]:
        """Every stacked expert weight as (experts, out, in), by module path (MoE layers only)."""
        d, f, E = self.hidden_size, self.moe_intermediate_size, self.num_experts
        out = {}
        for i in range(self.num_layers):
            if self.moe_layer(i):
                p = f"model.layers.{i}.mlp.switch_mlp"
                out[f"{p}.gate_proj"] = (E, f, d)
                out[f"{p}.up_proj"] = (E, f, d)
                out[f"{p}.down_proj"] = (E, d, f)
        return out

    def _matrices(self) -> dict[str, tuple[int, int]]:
        """Every matmul weight as (rows, in): linears, and experts with rows = experts * out."""
        out = dict(self.linear_shapes())
        for name, (e, o, i) in self.expert_shapes().items():
            out[name] = (e * o, i)
        for name, (h, o, i) in self.multilinear_shapes().items():
            out[name] = (h * o, i)
        return out

    def active_param_count(self) -> int:
        """Parameters one token uses: all but the unrouted experts (== param_count when dense)."""
        n = self.param_count()
        for e, o, i in self.expert_shapes().values():
            n -= (e - self.num_experts_per_tok) * o * i
        return n

    def param_count(self) -> int:
        n = sum(a * b for a, b in self._matrices().values())
        n += self.num_layers * 2 * self.hidden_size + self.hidden_size
        if self.is_dsa:   # q_a / kv_a RMSNorms, the indexer's LayerNorm (weight + bias), router biases
            n += self.num_layers * (self.q_lora_rank + self.kv_lora_rank + 2 * self.index_head_dim)
            n += sum(self.num_experts for i in range(self.num_layers) if self.moe_layer(i))
            return n
        if self.attention_bias:
            n += self.num_layers * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
            if self.family == "llama":      # o_proj too
                n += self.num_layers * self.hidden_size
        if self.mlp_bias:
            n += sum(2 * self.intermediate_size + self.hidden_size
                     for i in range(self.num_layers) if not self.moe_layer(i))
        if self.qk_norm:
            n += self.num_layers * 2 * self.head_dim
        return n

    def weight_bytes(self) -> int:
        elt = DTYPES[self.dtype]
        total = 0
        mats = self._matrices()
        for name, (o, i) in mats.items():
            q = self.quant_for(name)
            if q is None:
                total += o * i * elt
            else:
                gs, bits = q
                total += o * i * bits // 8 + 2 * (o * (i // gs)) * elt
        total += (self.param_count() - sum(a * b for a, b in mats.values())) * elt
        if self.is_dsa:     # the routers' score-correction biases are float32 in the checkpoint
            total += sum(self.num_experts for i in range(self.num_layers) if self.moe_layer(i)) * (4 - elt)
        return total

    def kv_bytes(self, tokens: int) -> int:
        if self.is_dsa:   # the MLA latent + rotary key, and the indexer's key, per layer
            width = self.kv_lora_rank + self.qk_rope_head_dim + self.index_head_dim
            return self.num_layers * width * tokens * DTYPES[self.dtype]
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * tokens * DTYPES[self.dtype]
