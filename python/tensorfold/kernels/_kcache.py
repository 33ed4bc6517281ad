"""Compiled CUDA kernels kept on disk between processes (the CUDA face's start-up time).

MLX compiles every ``mx.fast.cuda_kernel`` instance with NVRTC at its first launch, in every process,
and never writes the result to its PTX cache: custom kernels pass ``use_disk_cache = false``
(mlx/backend/cuda/custom_kernel.cpp). But MLX *reads* that cache for every module before compiling
(``JitModule::JitModule`` in mlx/backend/cuda/jit_module.cpp, MLX 0.32). On the H200 a new process
spent 25-35 s compiling our kernels before its first reply even with MLX's own kernels cached, and a
first drafted reply 7-11 s more (session 48, ``bench/gpu_cold_start.py``).

So before an instance's first launch, ``ensure`` works out the module MLX will look up, and where the
cache lacks it, compiles that module itself and writes it there:

- the text: what ``build_kernel`` makes of our header and body (``mlx_text``: MLX's default header,
  the signature from the inputs' and outputs' dtypes, the template constants, the body);
- the module name: ``custom_kernel_<name><template suffix>_<std::hash(text) in hex>``, the hash taken
  by the same libstdc++ function MLX calls (``tensorfold._ext.std_hash``);
- the compile: NVRTC (the library MLX itself loaded) on that text, with MLX's options
  (``--device-as-default-execution-space``, ``--gpu-architecture=sm_XYa``), MLX's include paths,
  and MLX's own embedded device headers (``utils.cuh``, ``complex.cuh``, ``config.h``, read from
  ``libmlx.so``): the same inputs, so the same cubin MLX would have built;
- the files: ``<module>.txt`` (the kernel's mangled name) first, then ``<module>.ptx`` (the cubin),
  each written atomically, in MLX's cache directory (``MLX_PTX_CACHE_DIR``, else
  ``<temp dir>/mlx/<version>/ptx``).

MLX then loads the cubin instead of compiling. Each compiled module is also kept in TensorFold's own
cache directory (``own_dir``), from which a later process copies it into MLX's directory where that
lacks it. Anything that does not fit (no NVRTC found, a header not found, a compile error, an
unwritable directory) leaves MLX to compile as before, with one warning: the cache only ever saves
time. ``TENSORFOLD_KERNEL_CACHE=0`` turns it off.
Tests: tests/test_kcache.py (the text and the files on the CPU; on CUDA, that MLX loads what this
writes and that every kernel family gives the bits of MLX's own compile).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import pickle
import re
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import mlx.core as mx

from . import _nvrtc as _nvrtc_mod
from ._sources import atomic_write as _write
from ._sources import cache_dir

# MLX's default header and namespace lines (custom_kernel.cpp, build_kernel)
_DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
_NAMESPACE = "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
# dtype_to_cuda_type (the signature, `using` lines) and get_type_string (the name's suffix)
_CUDA_TYPE = {"bool": "bool", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
              "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
              "float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double",
              "complex64": "mlx::core::cu::complex64_t"}
_TYPE_STRING = {"float32": "float", "float16": "float16_t", "bfloat16": "bfloat16_t", "float64": "double",
                "complex64": "complex64_t", "bool": "bool", "int8": "int8_t", "int16": "int16_t",
                "int32": "int32_t", "int64": "int64_t", "uint8": "uint8_t", "uint16": "uint16_t",
                "uint32": "uint32_t", "uint64": "uint64_t"}
# the device headers MLX's default header pulls in, by a line only each of them holds
_HEADERS = {
    "mlx/backend/cuda/device/utils.cuh": b"using Shape = cuda::std::array<int32_t, MAX_NDIM>;",
    "mlx/backend/cuda/device/complex.cuh": b"using complex64_t = complex_t<float>;",
    "mlx/backend/cuda/device/config.h": b"#define MAX_NDIM ",
}

log = logging.getLogger("tensorfold")
stats = {"hits": 0, "copied": 0, "compiled": 0, "failed": 0}
_told = []      # the one log line a process: why its start takes minutes
_warned = []
_off = []       # set once the cache cannot work in this process (no NVRTC, headers, or a writable directory)


class Unusable(RuntimeError):
    """What the cache needs is missing here: off for the rest of the process."""


def enabled() -> bool:
    return os.environ.get("TENSORFOLD_KERNEL_CACHE", "1") != "0"


def _dtype_name(d) -> str:
    return str(d).rsplit(".", 1)[-1]


def cuda_type(d) -> str:
    """MLX's dtype_to_cuda_type: the C++ type a kernel's text names for an MLX dtype."""
    return _CUDA_TYPE[_dtype_name(d)]


def kernel_name(name: str, template) -> str:
    """MLX's name for one instance: custom_kernel_<name> and template_arguments_hash's suffix."""
    s = "custom_kernel_" + name
    for _, v in template:
        if isinstance(v, bool):
            s += "_t" if v else "_f"
        elif isinstance(v, int):
            s += f"_{v}"
        else:
            s += "_" + _TYPE_STRING[_dtype_name(v)]
    return s


def mlx_text(kname: str, header: str, source: str, input_names, inputs, output_names, output_dtypes,
             template) -> str:
    """The text MLX's build_kernel makes (custom_kernel.cpp, MLX 0.32). inputs: (dtype, ndim) per
    input, in order; an input's shape / strides / ndim parameters follow it where the source names
    them and the input has dimensions."""
    t = _DEFAULT_HEADER + header + _NAMESPACE + "__global__ void " + kname + "(\n"
    for n, (dt, ndim) in zip(input_names, inputs):
        t += f"    const {cuda_type(dt)}* {n},\n"
        if ndim > 0:
            if n + "_shape" in source:
                t += f"    const __grid_constant__ Shape {n}_shape,\n"
            if n + "_strides" in source:
                t += f"    const __grid_constant__ Strides {n}_strides,\n"
            if n + "_ndim" in source:
                t += f"    const __grid_constant__ int {n}_ndim,\n"
    for i, (n, dt) in enumerate(zip(output_names, output_dtypes)):
        t += f"    {cuda_type(dt)}* {n}" + (",\n" if i < len(output_names) - 1 else ") {\n")
    if template:
        t += template_lines(template) + "\n"
    return t + source + "\n}\n\n} // namespace mlx::core::cu\n"


def template_lines(template) -> str:
    """build_kernel's compile-time constants: `constexpr int / bool` and `using` lines, in order."""
    t = ""
    for k, v in template:
        if isinstance(v, bool):
            t += f"  constexpr bool {k} = {'true' if v else 'false'};\n"
        elif isinstance(v, int):
            t += f"  constexpr int {k} = {v};\n"
        else:
            t += f"  using {k} = {cuda_type(v)};\n"
    return t


def std_hash(text: str) -> int:
    from .. import _ext
    return _ext.std_hash(text.encode())


def module_name(kname: str, text: str) -> str:
    return f"{kname}_{std_hash(text):x}"


def mlx_cache_dir() -> Path:
    """MLX's ptx_cache_dir(): MLX_PTX_CACHE_DIR, else std::filesystem::temp_directory_path() (TMPDIR,
    TMP, TEMP, TEMPDIR, else /tmp) / mlx / <version> / ptx."""
    d = os.environ.get("MLX_PTX_CACHE_DIR")
    if d:
        return Path(d).absolute()
    tmp = next((os.environ[k] for k in ("TMPDIR", "TMP", "TEMP", "TEMPDIR") if os.environ.get(k)), "/tmp")
    return Path(tmp) / "mlx" / mx.__version__ / "ptx"


def ptx_path(cache: Path, module: str) -> Path:
    """get_ptx_path: names past 245 characters become directories of 245."""
    n, p, off = 245, cache, 0
    while len(module) - off > n:
        p, off = p / module[off:off + n], off + n
    return p / (module[off:] + ".ptx")


def store(path: Path, full_name: str, mangled: str, cubin: bytes, text: str) -> None:
    """The files MLX's read_cached_ptx reads: the names first (MLX reads them once the .ptx exists),
    then the cubin; the text as MLX writes it for its own modules (.cu), for whoever reads the cache."""
    _write(path.with_suffix(".txt"), f"{full_name}\t{mangled}\n".encode())
    _write(path.with_suffix(".cu"), text.encode())
    _write(path, cubin)


def _mlx_dir() -> Path:
    return Path(mx.__file__).parent


@functools.lru_cache(maxsize=1)
def device_headers() -> dict[str, bytes]:
    """MLX's embedded device headers our texts include (MLX compiles with them in memory; the wheel
    ships no .cuh files): each the one NUL-terminated string in libmlx.so holding its marker line."""
    data = (_mlx_dir() / "lib" / "libmlx.so").read_bytes()
    out = {}
    for name, marker in _HEADERS.items():
        hits = set()
        for m in re.finditer(re.escape(marker), data):
            s = data.rfind(b"\0", 0, m.start()) + 1
            e = data.find(b"\0", m.start())
            if b"#pragma once" in data[s:e]:
                hits.add(data[s:e])
        if len(hits) != 1:
            raise Unusable(f"{len(hits)} candidates for {name} in libmlx.so")
        out[name] = hits.pop()
    return out


def include_args(nvrtc_major: int) -> list[str]:
    """MLX's include_path_args(): its bundled headers, CCCL, then the CUDA runtime headers (the
    nvidia python package next to MLX, else CUDA_HOME / CUDA_PATH / /usr/local/cuda)."""
    root = _mlx_dir()
    args, inc = [], root / "include"
    if inc.exists():
        args.append(f"--include-path={inc}")
    if not (inc / "cccl").exists():
        raise Unusable(f"no CCCL headers at {inc / 'cccl'}")
    args.append(f"--include-path={inc / 'cccl'}")
    p = root.parent / "nvidia" / ("cu13" if nvrtc_major >= 13 else "cuda_runtime") / "include"
    if not p.exists():
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        p = Path(home) / "include"
    args.append(f"--include-path={p}")
    return args


def _nvrtc_libs() -> tuple[str | None, list[str]]:
    """(libnvrtc, the other NVRTC libraries) that MLX loaded (libmlx.so links NVRTC; NVRTC loads its
    builtins library at the first compile), from /proc/self/maps; a worker process preloads the others."""
    paths = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split()[-1]
                if os.path.basename(p).startswith("libnvrtc") and p not in paths:
                    paths.append(p)
    except OSError:
        pass
    main = next((p for p in paths if os.path.basename(p).startswith("libnvrtc.so")), None)
    return main, [p for p in paths if p != main]


@functools.lru_cache(maxsize=1)
def _nvrtc():
    """(library, major, minor) of the NVRTC MLX loaded."""
    try:
        lib = _nvrtc_mod.load(_nvrtc_libs()[0])
    except OSError as e:
        raise Unusable(f"no NVRTC library ({e})") from None
    major, minor = _nvrtc_mod.version(lib)
    if (major, minor) < (11, 8):     # MLX compiles PTX there, not a cubin
        raise Unusable(f"NVRTC {major}.{minor} (< 11.8)")
    return lib, major, minor


def _arch() -> str:
    """MLX's --gpu-architecture for this device: sm_<major><minor>, "a" from compute capability 9."""
    info = mx.device_info()
    cc = (int(info["compute_capability_major"]), int(info.get("compute_capability_minor", 0)))
    return f"sm_{cc[0]}{cc[1]}{'a' if cc[0] >= 9 else ''}"


@functools.lru_cache(maxsize=1)
def target() -> str:
    """What a cubin was built for: the architecture and the NVRTC version (e.g. sm_90a-nvrtc13.0)."""
    _, major, minor = _nvrtc()
    return f"{_arch()}-nvrtc{major}.{minor}"


def own_dir() -> Path:
    """TensorFold's own copy of each module it compiled, under TENSORFOLD_CACHE_DIR (default
    ~/.cache/tensorfold/cuda): it outlives the temp directory MLX's cache is in by default (a reboot, a
    container's /tmp), serves processes that each have their own MLX_PTX_CACHE_DIR, and is keyed by MLX's
    version, the architecture and NVRTC's version (MLX's directory by MLX's version only)."""
    return cache_dir() / "cubin" / mx.__version__ / target()


def lasting_mlx_dir() -> Path | None:
    """For a server process, before anything runs on the GPU: where MLX_PTX_CACHE_DIR is unset, point it at
    TENSORFOLD_CACHE_DIR/cuda/mlx-ptx/<MLX version>/<architecture>-nvrtc<version> (default under
    ~/.cache/tensorfold) and return that directory. MLX's default, <temp dir>/mlx/<version>/ptx, is cleaned
    by reboots, and on the H200 a first start spends ~65 s compiling MLX's own JIT kernels (which MLX writes
    there) besides ours; this directory lasts, and is keyed by the GPU architecture as MLX's is not (a home
    directory shared by machines with different GPUs). MLX reads the variable once, at its first JIT
    compile (ptx_cache_dir() in mlx/backend/cuda/jit_module.cpp), so this must run before any GPU work:
    `tensorfold serve` calls it first thing. None (nothing changed) off CUDA, with the kernel cache off,
    with MLX_PTX_CACHE_DIR already set, or where the directory cannot be made."""
    if os.environ.get("MLX_PTX_CACHE_DIR") or not enabled() or not mx.cuda.is_available():
        return None
    try:
        d = cache_dir() / "mlx-ptx" / mx.__version__ / target()
        d.mkdir(parents=True, exist_ok=True)
        if not os.access(d, os.W_OK | os.X_OK):
            return None
    except (Unusable, OSError, RuntimeError) as e:
        log.debug("MLX's PTX cache left at its default (%s)", e)
        return None
    os.environ["MLX_PTX_CACHE_DIR"] = str(d)
    return d


def _options() -> list[str]:
    """MLX's NVRTC options: --device-as-default-execution-space, the architecture, its include paths."""
    return ["--device-as-default-execution-space", f"--gpu-architecture={_arch()}"] + include_args(_nvrtc()[1])


def compile_cubin(module: str, text: str, full_name: str) -> tuple[bytes, str]:
    """NVRTC as MLX's compile() calls it, in this process: (cubin, mangled name of full_name)."""
    return _nvrtc_mod.compile_cubin(_nvrtc()[0], _options(), device_headers(), module, text, full_name)


def compile_in_worker(module: str, text: str, full_name: str) -> tuple[bytes, str]:
    """The same compile in a worker process (_nvrtc.py run as a script): NVRTC serializes compiles within
    a process, so batched() runs its queue side by side this way. Where no worker can start or load NVRTC,
    the compile runs in this process; any other failure is the compile's (MLX then compiles it itself)."""
    lib, preload = _nvrtc_libs()
    req = {"lib": lib, "preload": preload, "opts": _options(), "headers": device_headers(),
           "jobs": [(module, text, full_name)]}
    try:
        r = subprocess.run([sys.executable, "-I", "-S", _nvrtc_mod.__file__], input=pickle.dumps(req),
                           capture_output=True, timeout=300)
    except OSError as e:             # no interpreter to start
        r = None
        log.debug("no NVRTC worker process (%s); compiling in this process", e)
    if r is None or r.returncode == 3:
        return compile_cubin(module, text, full_name)
    if r.returncode != 0:
        raise RuntimeError(f"NVRTC worker exited {r.returncode}: {r.stderr.decode(errors='replace')[-500:]}")
    got = pickle.loads(r.stdout)[0]
    if got[0] == "error":
        raise RuntimeError(got[1])
    return got


def _read(path: Path, full_name: str) -> tuple[bytes, str] | None:
    """(cubin, mangled name) of a module store() wrote (its names file is written before its cubin)."""
    try:
        cubin = path.read_bytes()
        name, _, mangled = path.with_suffix(".txt").read_text().rstrip("\n").partition("\t")
    except OSError:
        return None
    return (cubin, mangled) if cubin and name == full_name and mangled else None


# test hook: where set, ensure records each module's text here (tests compare it with MLX's own)
texts: dict | None = None


def ensure(name: str, header: str, source: str, input_names, output_names, template, inputs,
           output_dtypes) -> None:
    """Make sure MLX's cache holds this instance's module (see the module's docstring): a hit, a copy
    from our own directory, or a compile (inside ``batched()``, one queued for the block's end). Never
    raises: a failure leaves MLX to compile it, with one warning a process; where the environment lacks
    what the cache needs (Unusable, or a directory it cannot write), the cache is off for the rest of the
    process, so that no instance is compiled twice."""
    if _off:
        return
    job = _guarded(_lookup, name, header, source, input_names, output_names, template, inputs, output_dtypes)
    if job is None:
        return
    if _pending is not None:
        _pending.append(job)
    else:
        _guarded(_build, *job)


def _lookup(name, header, source, input_names, output_names, template, inputs, output_dtypes):
    """None where MLX's directory has the module or it was copied there from ours; else the compile job."""
    kname = kernel_name(name, template)
    text = mlx_text(kname, header, source, input_names, inputs, output_names, output_dtypes, template)
    module = module_name(kname, text)
    if texts is not None:
        texts[module] = text
    path = ptx_path(mlx_cache_dir(), module)
    if path.exists() and path.with_suffix(".txt").exists():
        _count("hits")
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Unusable(f"cannot write {path.parent} ({e})") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise Unusable(f"cannot write {path.parent}")
    full = "mlx::core::cu::" + kname
    own = ptx_path(own_dir(), module)
    got = _read(own, full)
    if got:                       # compiled by an earlier process: copied into MLX's directory
        store(path, full, got[1], got[0], text)
        _count("copied")
        return None
    return module, text, full, path, own


def _build(module, text, full, path, own, in_worker: bool = False) -> None:
    if not _told:
        _told.append(True)
        log.info("compiling the CUDA kernels with NVRTC (seconds each, a few minutes on a first start); "
                 "kept in %s and %s for later starts", path.parent, own_dir())
    cubin, mangled = (compile_in_worker if in_worker else compile_cubin)(module, text, full)
    store(path, full, mangled, cubin, text)
    _count("compiled")
    try:
        store(own, full, mangled, cubin, text)
    except OSError:               # our own copy is a convenience; MLX's directory has the module
        pass


def _guarded(f, *args):
    try:
        return f(*args)
    except Exception as e:       # the cache only saves time: MLX compiles this instance itself
        _count("failed")
        if isinstance(e, (Unusable, OSError)):
            _off.append(e)
        if not _warned:
            _warned.append(e)
            warnings.warn(f"tensorfold: CUDA kernels compiled by MLX at each start, not cached "
                          f"({type(e).__name__}: {e})", RuntimeWarning, stacklevel=4)
        return None


_lock = threading.Lock()
_pending: list | None = None      # inside batched(): the compiles queued for its end


def _count(key: str) -> None:
    with _lock:
        stats[key] += 1


def compile_threads() -> int:
    """TENSORFOLD_KERNEL_COMPILE_THREADS, default min(8, cores): how many compiles batched() runs at once,
    each in a worker process (NVRTC within one process serializes them; see _nvrtc.py). Worker processes
    give the cubins of compiles in this process byte for byte (tests/test_kcache.py; on the H200 32 modules,
    and NVRTC 13.0 on the CPU host, bench/kcache_nvrtc_probe.py). H200, session 49: a new process whose
    kernels were not cached waited 11.1 s with 8 workers, 55.4 s with 1. 1: one after another in this
    process."""
    try:
        return max(1, int(os.environ.get("TENSORFOLD_KERNEL_COMPILE_THREADS") or min(8, os.cpu_count() or 1)))
    except ValueError:
        return 1


@contextlib.contextmanager
def batched():
    """The compiles that the kernel calls made inside the block need, run together when it ends, up to
    compile_threads() at once in worker processes, before the caller evaluates what it built. For a
    block that builds a whole graph first, as row_check does: a first start on a machine compiles its
    ~20 instances side by side instead of one after another. Where something inside evaluates early, MLX
    compiles that kernel itself (the same code, only slower). One thread: the block changes nothing."""
    global _pending
    # every exact forward enters this (models/dense.py): the cheap checks first, the environment last
    if _pending is not None or not mx.cuda.is_available() or not enabled() or (n := compile_threads()) <= 1:
        yield
        return
    _pending = []
    try:
        yield
    finally:
        jobs, _pending = list({job[0]: job for job in _pending}.values()), None    # one job a module
        if len(jobs) == 1:
            _guarded(_build, *jobs[0])
        elif jobs and _guarded(_options) is not None and _guarded(device_headers) is not None:
            # each thread waits on its worker process (the GIL released)
            with concurrent.futures.ThreadPoolExecutor(min(n, len(jobs))) as pool:
                list(pool.map(lambda job: _guarded(_build, *job, True), jobs))


class CachedKernel:
    """An mx.fast.cuda_kernel whose instances go through ``ensure`` at their first launch (the key:
    template, inputs' dtypes and ranks, output dtypes; looked up at every call, a few µs in Python,
    which the compiled decode step pays only while tracing)."""

    __slots__ = ("kernel", "spec", "seen")

    def __init__(self, kernel, name, header, source, input_names, output_names):
        self.kernel, self.spec, self.seen = kernel, (name, header, source, input_names, output_names), set()

    def __call__(self, **kw):
        template = tuple(kw.get("template") or ())
        try:
            key = (template, tuple((a.dtype, a.ndim) for a in kw["inputs"]), tuple(kw["output_dtypes"]))
        except (AttributeError, KeyError, TypeError):   # a Python scalar input (MLX converts it), or no inputs
            key = None
        if key is not None and key not in self.seen:
            self.seen.add(key)
            name, header, source, input_names, output_names = self.spec
            ensure(name, header, source, input_names, output_names, template, key[1], key[2])
        return self.kernel(**kw)
