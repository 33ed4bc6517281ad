"""The CUDA face's compiled kernels kept on disk (tensorfold/kernels/_kcache.py).

On the CPU: the text MLX's build_kernel makes, the hash it names a module with, the cache's paths and
files, and that a failure only warns. On CUDA: that MLX loads what the cache writes under the name it
computes, that the texts are MLX's own, and that every decode kernel family gives the bits of MLX's own
compile from a cold cache and from a warm one."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tensorfold import _ext
from tensorfold.kernels import _kcache

HERE = Path(__file__).parent
cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="MLX's CUDA backend loads the cache")


def hash_bytes(b: bytes, seed: int = 0xC70F6907) -> int:
    """libstdc++'s std::_Hash_bytes for a 64-bit size_t (MurmurHash64A-like; hash_bytes.cc)."""
    m64, mul = (1 << 64) - 1, (0xC6A4A793 << 32) + 0x5BD1E995
    mix = lambda v: v ^ (v >> 47)            # noqa: E731
    n, al = len(b), len(b) & ~7
    h = (seed ^ (n * mul)) & m64
    for i in range(0, al, 8):
        d = (mix((int.from_bytes(b[i:i + 8], "little") * mul) & m64) * mul) & m64
        h = ((h ^ d) * mul) & m64
    if n & 7:
        h = ((h ^ int.from_bytes(b[al:], "little")) * mul) & m64
    return mix((mix(h) * mul) & m64)


def test_std_hash_is_the_runtimes():
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 8, 9, 64, 1001):
        b = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert _ext.std_hash(b) == hash_bytes(b)
    # MLX's own cache names its compiled kernels with this hash of "" (seen in its PTX cache)
    assert _ext.std_hash(b"") == 6142509188972423790


def test_text_and_name_follow_build_kernel():
    tmpl = (("T", mx.bfloat16), ("K", 4096), ("TWO", True), ("C0", False))
    kname = _kcache.kernel_name("tf_demo", tmpl)
    assert kname == "custom_kernel_tf_demo_bfloat16_t_4096_t_f"
    src = "  out[0] = x[0] + x_shape[0];"
    text = _kcache.mlx_text(kname, "// header\n", src, ["x", "n"], [(mx.bfloat16, 2), (mx.int32, 0)],
                            ["out", "o2"], [mx.float32, mx.uint32], tmpl)
    assert text == (
        '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
        "// header\n"
        "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        "__global__ void custom_kernel_tf_demo_bfloat16_t_4096_t_f(\n"
        "    const __nv_bfloat16* x,\n"
        "    const __grid_constant__ Shape x_shape,\n"
        "    const int32_t* n,\n"
        "    float* out,\n"
        "    uint32_t* o2) {\n"
        "  using T = __nv_bfloat16;\n"
        "  constexpr int K = 4096;\n"
        "  constexpr bool TWO = true;\n"
        "  constexpr bool C0 = false;\n"
        "\n"
        "  out[0] = x[0] + x_shape[0];\n"
        "}\n\n} // namespace mlx::core::cu\n")
    # no template: no constants and no blank line; a 0-d input never gets its shape
    t2 = _kcache.mlx_text("custom_kernel_k", "", "y[0] = a_shape[0];", ["a"], [(mx.float16, 0)], ["y"],
                          [mx.float16], ())
    assert "    const __half* a,\n    __half* y) {\ny[0] = a_shape[0];\n}" in t2
    assert _kcache.module_name(kname, text) == f"{kname}_{hash_bytes(text.encode()):x}"


def test_cache_dir_and_long_names(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    assert _kcache.mlx_cache_dir() == tmp_path
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    for k in ("TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        monkeypatch.delenv(k, raising=False)
    assert _kcache.mlx_cache_dir() == Path("/tmp/mlx") / mx.__version__ / "ptx"
    monkeypatch.setenv("TEMP", "/x")
    monkeypatch.setenv("TMP", "/y")
    assert _kcache.mlx_cache_dir() == Path("/y/mlx") / mx.__version__ / "ptx"
    name = "a" * 245
    assert _kcache.ptx_path(tmp_path, name) == tmp_path / (name + ".ptx")
    assert _kcache.ptx_path(tmp_path, name + "bc") == tmp_path / name / "bc.ptx"
    assert _kcache.ptx_path(tmp_path, "b" * 500) == tmp_path / ("b" * 245) / ("b" * 245) / "bbbbbbbbbb.ptx"


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """Empty caches (MLX's directory: tmp_path / "mlx"; ours: tmp_path / "own"), counters, warnings; a
    fixed target (no NVRTC on the CPU)."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "mlx"))
    monkeypatch.setenv("TENSORFOLD_CACHE_DIR", str(tmp_path / "own"))
    monkeypatch.setattr(_kcache, "target", lambda: "sm_90a-nvrtc13.0")
    monkeypatch.setattr(_kcache, "stats", {"hits": 0, "copied": 0, "compiled": 0, "failed": 0})
    monkeypatch.setattr(_kcache, "_off", [])
    monkeypatch.setattr(_kcache, "_warned", [])
    return tmp_path


ARGS = ("tf_k", "", "out[0] = 1;", ["x"], ["out"], (("N", 3),), ((mx.float32, 1),), (mx.float32,))


def test_ensure_writes_names_then_cubin_and_hits_after(fresh, monkeypatch, caplog):
    monkeypatch.setattr(_kcache, "_told", [])
    caplog.set_level("INFO", logger="tensorfold")
    order = []
    real_write = _kcache._write
    monkeypatch.setattr(_kcache, "_write", lambda p, d: (order.append(p.suffix), real_write(p, d)))
    calls = []
    monkeypatch.setattr(_kcache, "compile_cubin",
                        lambda module, text, full: (calls.append(full), (b"\x7fELF-cubin", "_Z3fooPf"))[1])
    _kcache.ensure(*ARGS)
    (ptx,) = (fresh / "mlx").glob("*.ptx")
    assert ptx.name.startswith("custom_kernel_tf_k_3_") and ptx.read_bytes() == b"\x7fELF-cubin"
    assert ptx.with_suffix(".txt").read_text() == "mlx::core::cu::custom_kernel_tf_k_3\t_Z3fooPf\n"
    assert order == [".txt", ".cu", ".ptx"] * 2          # MLX reads the names once the .ptx exists; then ours
    assert calls == ["mlx::core::cu::custom_kernel_tf_k_3"]
    assert [r.message for r in caplog.records if "compiling the CUDA kernels" in r.message]   # why a start is slow
    own = fresh / "own" / "cuda" / "cubin" / mx.__version__ / "sm_90a-nvrtc13.0" / ptx.name
    assert own.read_bytes() == ptx.read_bytes() and own.with_suffix(".txt").read_text() == ptx.with_suffix(".txt").read_text()
    _kcache.ensure(*ARGS)
    assert _kcache.stats == {"hits": 1, "copied": 0, "compiled": 1, "failed": 0} and len(calls) == 1
    # a new MLX directory (another process's, or /tmp cleaned): copied from ours, not compiled again
    for f in (fresh / "mlx").iterdir():
        f.unlink()
    _kcache.ensure(*ARGS)
    assert ptx.read_bytes() == b"\x7fELF-cubin" and ptx.with_suffix(".txt").read_text().endswith("\t_Z3fooPf\n")
    assert _kcache.stats == {"hits": 1, "copied": 1, "compiled": 1, "failed": 0} and len(calls) == 1
    # ours damaged (no names): compiled again
    own.with_suffix(".txt").write_text("")
    for f in (fresh / "mlx").iterdir():
        f.unlink()
    _kcache.ensure(*ARGS)
    assert _kcache.stats["compiled"] == 2 and len(calls) == 2
    assert not list(fresh.rglob("*.tmp"))


def test_a_failed_compile_warns_once_and_leaves_it_to_mlx(fresh, monkeypatch):
    def fail(*a):
        raise RuntimeError("NVRTC: error in the text")
    monkeypatch.setattr(_kcache, "compile_cubin", fail)
    with pytest.warns(RuntimeWarning, match="not cached.*error in the text"):
        _kcache.ensure("tf_k", "", "a", ["x"], ["out"], (), ((mx.float32, 1),), (mx.float32,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _kcache.ensure("tf_k", "", "b", ["x"], ["out"], (), ((mx.float32, 1),), (mx.float32,))
    assert _kcache.stats["failed"] == 2 and not _kcache._off            # another text may compile
    assert not list((fresh / "mlx").iterdir())


def test_a_missing_environment_turns_the_cache_off_once(fresh, monkeypatch):
    """No NVRTC, no headers, no writable directory: one warning, then no instance tries again (each
    would otherwise be compiled twice, by the cache and by MLX)."""
    for cause in ("unusable", "unwritable"):
        monkeypatch.setattr(_kcache, "_warned", [])
        monkeypatch.setattr(_kcache, "_off", [])
        calls = []

        def compile_(*a):
            calls.append(a)
            raise _kcache.Unusable("no NVRTC library")
        monkeypatch.setattr(_kcache, "compile_cubin", compile_)
        blocker = fresh / f"{cause}-file"
        blocker.write_text("")
        monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(blocker / "ptx" if cause == "unwritable" else fresh / cause))
        with pytest.warns(RuntimeWarning, match="not cached"):
            _kcache.ensure("tf_k", "", "a", ["x"], ["out"], (), ((mx.float32, 1),), (mx.float32,))
        _kcache.ensure("tf_k", "", "b", ["x"], ["out"], (), ((mx.float32, 1),), (mx.float32,))
        assert _kcache._off and len(calls) == (1 if cause == "unusable" else 0)


def test_batched_compiles_at_the_end_side_by_side(fresh, monkeypatch):
    """Inside batched() a miss is queued; at the block's end the queue compiles in worker processes,
    TENSORFOLD_KERNEL_COMPILE_THREADS at once (compiles seen running at once), and the files are what
    one-by-one compiles write. With one thread nothing waits, and it compiles in this process."""
    import threading
    import time
    busy, peak = [0], [0]
    lock = threading.Lock()

    def compile_(module, text, full):
        with lock:
            busy[0] += 1
            peak[0] = max(peak[0], busy[0])
        time.sleep(0.3)
        with lock:
            busy[0] -= 1
        return b"cubin-" + full.encode(), "_Z" + full[-3:]
    def in_process(*a):
        raise AssertionError("a batch of compiles ran in this process")
    monkeypatch.setattr(_kcache, "compile_in_worker", compile_)
    monkeypatch.setattr(_kcache, "compile_cubin", in_process)
    monkeypatch.setattr(_kcache, "device_headers", lambda: {})
    monkeypatch.setattr(_kcache, "_options", lambda: [])
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)   # batched() does nothing off CUDA
    mlxdir = fresh / "mlx"
    one = lambda i: _kcache.ensure("tf_k", "", f"out[0] = {i};", ["x"], ["out"], (("N", i),),  # noqa: E731
                                   ((mx.float32, 1),), (mx.float32,))
    monkeypatch.setenv("TENSORFOLD_KERNEL_COMPILE_THREADS", "4")
    with _kcache.batched():
        for i in range(4):
            one(i)
        one(0)                                       # the same module again (another kernel object): once
        assert not list(mlxdir.glob("*.ptx")) and _kcache.stats["compiled"] == 0
    assert len(list(mlxdir.glob("*.ptx"))) == 4 and _kcache.stats["compiled"] == 4 and peak[0] >= 2
    for i in range(4):
        (ptx,) = mlxdir.glob(f"custom_kernel_tf_k_{i}_*.ptx")
        assert ptx.read_bytes() == f"cubin-mlx::core::cu::custom_kernel_tf_k_{i}".encode()
    monkeypatch.delenv("TENSORFOLD_KERNEL_COMPILE_THREADS")
    assert _kcache.compile_threads() == min(8, os.cpu_count())            # the default
    monkeypatch.setenv("TENSORFOLD_KERNEL_COMPILE_THREADS", "1")
    monkeypatch.setattr(_kcache, "compile_cubin", compile_)
    monkeypatch.setattr(_kcache, "compile_in_worker", in_process)
    with _kcache.batched():
        one(7)
        assert len(list(mlxdir.glob("*.ptx"))) == 5   # compiled right away


def test_worker_process_without_nvrtc_falls_back_to_this_process(monkeypatch):
    """The worker (kernels/_nvrtc.py, run as a script with only the standard library) reads its request
    from stdin; where it cannot load NVRTC it exits 3 and the same compile runs in this process."""
    from tensorfold.kernels import _nvrtc
    import pickle
    req = {"lib": "/nonexistent/libnvrtc.so.99", "preload": [], "opts": [], "headers": {"a.h": b"x"},
           "jobs": [("m", "text", "f")]}
    r = subprocess.run([sys.executable, "-I", "-S", _nvrtc.__file__], input=pickle.dumps(req),
                       capture_output=True, timeout=60)
    assert r.returncode == 3 and b"cannot load NVRTC" in r.stderr, r.stderr
    monkeypatch.setattr(_kcache, "_nvrtc_libs", lambda: ("/nonexistent/libnvrtc.so.99", []))
    monkeypatch.setattr(_kcache, "_options", lambda: [])
    monkeypatch.setattr(_kcache, "device_headers", lambda: {})
    monkeypatch.setattr(_kcache, "compile_cubin", lambda module, text, full: (b"here:" + text.encode(), "_Z1f"))
    assert _kcache.compile_in_worker("m", "text", "f") == (b"here:text", "_Z1f")


def test_cached_kernel_ensures_each_instance_once(monkeypatch):
    seen, launched = [], []
    monkeypatch.setattr(_kcache, "ensure", lambda *a: seen.append(a))
    k = _kcache.CachedKernel(lambda **kw: launched.append(kw) or "out", "tf_k", "h", "s", ["x"], ["out"])
    x, y = mx.zeros((2, 3), mx.float16), mx.zeros((4,), mx.float16)
    for inp, tmpl in ((x, [("N", 1)]), (x, [("N", 1)]), (y, [("N", 1)]), (x, [("N", 2)]), (x, [("N", 1)])):
        assert k(inputs=[inp], template=tmpl, output_dtypes=[mx.float16], grid=(1, 1, 1)) == "out"
    assert len(launched) == 5
    assert [(a[5], a[6]) for a in seen] == [((("N", 1),), ((mx.float16, 2),)), ((("N", 1),), ((mx.float16, 1),)),
                                            ((("N", 2),), ((mx.float16, 2),))]


def test_serve_keeps_mlx_ptx_cache_in_a_lasting_directory(fresh, monkeypatch):
    """tensorfold serve, before any GPU work: MLX_PTX_CACHE_DIR, where unset, becomes a directory under
    TENSORFOLD_CACHE_DIR keyed by MLX's version and the GPU target (MLX's own default is cleaned by reboots
    and is not keyed by the GPU). Never where the user set it, off CUDA, or with the kernel cache off."""
    from tensorfold import cli
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", "/mine")
    assert _kcache.lasting_mlx_dir() is None and os.environ["MLX_PTX_CACHE_DIR"] == "/mine"
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")          # restored after the test (set above first)
    monkeypatch.setenv("TENSORFOLD_KERNEL_CACHE", "0")
    assert _kcache.lasting_mlx_dir() is None and "MLX_PTX_CACHE_DIR" not in os.environ
    monkeypatch.delenv("TENSORFOLD_KERNEL_CACHE")
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    assert _kcache.lasting_mlx_dir() is None and "MLX_PTX_CACHE_DIR" not in os.environ
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    d = _kcache.lasting_mlx_dir()
    assert d == fresh / "own" / "cuda" / "mlx-ptx" / mx.__version__ / "sm_90a-nvrtc13.0" and d.is_dir()
    assert os.environ["MLX_PTX_CACHE_DIR"] == str(d) and _kcache.mlx_cache_dir() == d   # ours follow it
    # the CLI sets it first, before the model (and anything on the GPU)
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    order = []
    monkeypatch.setattr(_kcache, "lasting_mlx_dir", lambda: order.append("ptx"))

    def model(m):
        order.append("model")
        raise cli.CliError("stop here")
    monkeypatch.setattr(cli, "resolve_model", model)
    monkeypatch.setattr(cli, "_setup_logging", lambda level: None)     # leaves the logger to the other tests
    assert cli.main(["serve", "--port", "0"]) == 2 and order == ["ptx", "model"]


# ---------------------------------------------------------------- CUDA

LOADS = r'''
import sys, mlx.core as mx
from tensorfold.kernels import _kcache
def make(body):
    return mx.fast.cuda_kernel(name="tf_kcache_probe", input_names=["x"], output_names=["out"], source=body)
x = mx.ones((4,), mx.float32)
spec = dict(input_names=["x"], inputs=[(mx.float32, 1)], output_names=["out"], output_dtypes=[mx.float32],
            template=(("N", 4),))
kn = _kcache.kernel_name("tf_kcache_probe", spec["template"])
ta = _kcache.mlx_text(kn, "", "out[0] = 1.0f;", **spec)
tb = _kcache.mlx_text(kn, "", "out[0] = 2.0f;", **spec)
cubin, mangled = _kcache.compile_cubin(_kcache.module_name(kn, ta), ta, "mlx::core::cu::" + kn)
# the cubin of text A under the name of text B: MLX runs A's code when it launches B
_kcache.store(_kcache.ptx_path(_kcache.mlx_cache_dir(), _kcache.module_name(kn, tb)),
              "mlx::core::cu::" + kn, mangled, cubin, tb)
out = make("out[0] = 2.0f;")(inputs=[x], template=[("N", 4)], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                             output_shapes=[(1,)], output_dtypes=[mx.float32])[0]
print("RESULT", out.item())
'''


@cuda
def test_cuda_mlx_loads_the_module_the_cache_names(tmp_path):
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", LOADS], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RESULT 1.0" in r.stdout, r.stdout          # 2.0 would mean MLX compiled text B itself


@cuda
def test_cuda_cache_texts_are_mlx_texts(monkeypatch, capfd):
    """With verbose=True MLX prints each kernel's generated text: every one equals the cache's."""
    sys.path.insert(0, str(HERE))
    import kcache_cases
    from tensorfold.kernels import _cuda
    texts = {}
    monkeypatch.setattr(_kcache, "texts", texts)
    call = _kcache.CachedKernel.__call__
    monkeypatch.setattr(_kcache.CachedKernel, "__call__", lambda self, **kw: call(self, verbose=True, **kw))
    _cuda.clear_kernel_caches()
    try:
        capfd.readouterr()
        for f in kcache_cases.cases():
            mx.eval(f())
        printed = re.findall(r"Generated source code for `([^`]+)`:\n```\n(.*?)\n```\n", capfd.readouterr().out, re.S)
    finally:
        _cuda.clear_kernel_caches()
    assert printed and texts
    ours = set(texts.values())
    for name, text in printed:
        assert text in ours, name
    assert len({t for _, t in printed}) == len(ours)


@cuda
def test_cuda_cached_kernels_give_mlx_bits(tmp_path):
    """Five processes: MLX compiling every kernel (cache off); the cache compiling them into empty
    directories, one after another; the cache finding them in MLX's directory; a new MLX directory, filled
    from ours; and the cache compiling them side by side in worker processes (batched()) into empty
    directories, cubins byte-identical to the one-after-another compiles. The same bits in all five."""
    def run(tag, **env):
        out = tmp_path / f"{tag}.npz"
        r = subprocess.run([sys.executable, str(HERE / "kcache_cases.py"), str(out)],
                           env=dict(os.environ, **env), capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        z = np.load(out)
        return {k: z[k] for k in z.files if k != "stats"}, json.loads(str(z["stats"]))
    own = dict(TENSORFOLD_CACHE_DIR=str(tmp_path / "own"))
    mlx_own, s0 = run("off", TENSORFOLD_KERNEL_CACHE="0", MLX_PTX_CACHE_DIR=str(tmp_path / "ptx0"), **own)
    cold, s1 = run("cold", MLX_PTX_CACHE_DIR=str(tmp_path / "ptx1"), **own)
    warm, s2 = run("warm", MLX_PTX_CACHE_DIR=str(tmp_path / "ptx1"), **own)
    copy, s3 = run("copy", MLX_PTX_CACHE_DIR=str(tmp_path / "ptx2"), **own)
    # the same TENSORFOLD_CACHE_DIR (the texts include the kernel bodies' files by their paths there: another
    # directory is other texts), our cubin copies removed
    shutil.rmtree(tmp_path / "own" / "cuda" / "cubin")
    side, s4 = run("batched", MLX_PTX_CACHE_DIR=str(tmp_path / "ptx3"), KCACHE_BATCHED="1",
                   TENSORFOLD_KERNEL_COMPILE_THREADS="8", **own)
    n = s1["compiled"]
    assert s0["compiled"] == 0 and n > 0 and s1["failed"] == 0 and s1["copied"] == 0
    assert s2 == {"hits": n, "copied": 0, "compiled": 0, "failed": 0}
    assert s3 == {"hits": 0, "copied": n, "compiled": 0, "failed": 0}
    assert s4 == {"hits": 0, "copied": 0, "compiled": n, "failed": 0}
    one_by_one = {p.name: p.read_bytes() for p in (tmp_path / "ptx1").rglob("custom_kernel_*.ptx")}
    assert len(one_by_one) == n
    assert one_by_one == {p.name: p.read_bytes() for p in (tmp_path / "ptx3").rglob("custom_kernel_*.ptx")}
    assert mlx_own.keys() == cold.keys() == warm.keys() == copy.keys() == side.keys()
    for k in mlx_own:
        for other in (cold, warm, copy, side):
            assert np.array_equal(mlx_own[k], other[k]), k
