"""Helpers shared by tests/test_kernels.py and tests/test_sparse_attention.py (random
inputs, exact bit patterns, NaN-poisoned allocator cache, KV buffers, the device fixture).
Imported by both; pytest puts tests/ on sys.path (rootdir-relative, no package)."""

from __future__ import annotations

import os
import secrets
import zlib

import mlx.core as mx
import numpy as np
import pytest

DEVICES = [mx.default_device()]


@pytest.fixture(params=DEVICES, ids=lambda d: f"{d.type}".split(".")[-1])
def device(request):
    prev = mx.default_device()
    mx.set_default_device(request.param)
    yield request.param
    mx.set_default_device(prev)


# Fresh inputs every run, reproducible: the run's seed is random unless TF_TEST_SEED is set, and
# every failure report prints it (tests/conftest.py). Before session 44 the seed was Python's
# salted hash(key), so an H200 failure (s44b) could not be rerun on its inputs.
TEST_SEED = int(os.environ.get("TF_TEST_SEED") or secrets.randbelow(2**31))


def _rng(*key):
    """A generator for the test identified by `key`, from the run's TEST_SEED."""
    return np.random.default_rng([TEST_SEED, zlib.crc32(repr(key).encode())])


def rand(rng, shape, dtype, scale=1.0):
    """Fresh random values (never zeros)."""
    a = rng.standard_normal(shape).astype(np.float32) * scale
    a[a == 0] = 0.5
    return mx.array(a).astype(dtype)


def garbage(rng, shape, dtype):
    """Large finite values."""
    big = 100.0 if dtype == mx.float16 else 1e4
    return mx.array(rng.uniform(-big, big, shape).astype(np.float32)).astype(dtype)


def bits(a: mx.array) -> np.ndarray:
    """Exact bit pattern of an array (for bitwise comparisons; NaN == NaN)."""
    mx.eval(a)
    if a.dtype in (mx.bfloat16, mx.float16):
        return np.array(a.view(mx.uint16))
    return np.array(a.astype(mx.float32)).view(np.uint32)


def f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def poison(nbytes: int):
    """Leave NaN-filled buffers of this size in MLX's allocator cache, so an output whose
    kernel skips elements shows garbage instead of lucky zeros."""
    for _ in range(2):
        p = mx.full((max(1, nbytes // 4),), float("nan"), dtype=mx.float32)
        mx.eval(p)
        del p


def run(fn, *args, **kw):
    out = fn(*args, **kw)
    poison(out.nbytes)
    out = fn(*args, **kw)
    mx.eval(out)
    return out


def out_eps(dtype):
    return {mx.bfloat16: 2.0**-8, mx.float16: 2.0**-11, mx.float32: 2.0**-22}[dtype]


def make_kv(rng, B, Hkv, cap, D, dtype, valid):
    """KV buffers of capacity `cap`: random keys at 0..valid-1, NaN beyond (never read)."""
    k = rng.standard_normal((B, Hkv, cap, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, cap, D)).astype(np.float32)
    k[:, :, valid:] = np.nan
    v[:, :, valid:] = np.nan
    return mx.array(k).astype(dtype), mx.array(v).astype(dtype)


def with_capacity(a: mx.array, valid: int, cap: int, fill=np.nan) -> mx.array:
    B, H, _, D = a.shape
    pad = mx.full((B, H, cap - valid, D), fill, dtype=a.dtype)
    return mx.concatenate([a[:, :, :valid], pad], axis=2)
