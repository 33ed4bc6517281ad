"""Run this project's Metal kernels on the CPU: a stand-in for ``mx.fast.metal_kernel``.

No Apple GPU exists here, so the Metal faces (metal/*.metal) are never compiled by Apple's
compiler nor run on a GPU. This module is the next best thing: it builds each kernel the way
MLX's ``metal_kernel`` does (mlx/backend/metal/custom_kernel + mlx/fast.cpp's
``write_signature``: the header, a template over the template arguments, one parameter per
input with ``<name>_shape`` / ``_strides`` / ``_ndim`` where the source names them, the outputs,
then the thread-position attributes the source names), compiles it as C++20 with g++ against a
small <metal_stdlib> (``metal_stdlib`` here) and runs it on emu_runtime.h's fibers: one fiber a
thread, simdgroups of 32 meeting at every simd_* operation and barrier, every buffer index
checked. A launch error (an index out of a buffer, a simdgroup that diverges at a shuffle, a
barrier not all reach) raises ``EmulatedLaunchError``.

``metal_kernel(...)`` has MLX's signature and returns a callable with MLX's keyword arguments
(inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value, stream), so a
test can monkeypatch ``mx.fast.metal_kernel`` and drive the project's own Metal launch code.

Floating point: IEEE float32, ``fma`` exact, no contraction. Apple's compiler may make other
choices where the source leaves them open (MLX builds custom kernels in its default math mode);
the row-exact contract does not rest on them, which is what the tests here check.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent

# mlx/fast.cpp's metal_attributes (name, type), in its order
METAL_ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]
SUPPORTED_ATTRIBUTES = {
    "simdgroup_index_in_threadgroup", "thread_execution_width", "thread_index_in_simdgroup",
    "thread_index_in_threadgroup", "thread_position_in_grid", "thread_position_in_threadgroup",
    "threadgroup_position_in_grid", "threadgroups_per_grid", "threads_per_grid",
    "threads_per_simdgroup", "threads_per_threadgroup", "simdgroups_per_threadgroup",
}

# MLX's get_type_string (mlx/backend/metal/utils.cpp) and the numpy storage of each dtype
_TYPES = {
    mx.float32: ("float", np.float32), mx.float16: ("float16_t", np.float16),
    mx.bfloat16: ("bfloat16_t", np.uint16), mx.int32: ("int32_t", np.int32),
    mx.uint32: ("uint32_t", np.uint32), mx.int64: ("int64_t", np.int64),
    mx.uint64: ("uint64_t", np.uint64), mx.int16: ("int16_t", np.int16),
    mx.uint16: ("uint16_t", np.uint16), mx.int8: ("int8_t", np.int8),
    mx.uint8: ("uint8_t", np.uint8), mx.bool_: ("bool", np.bool_),
}


class EmulatedLaunchError(RuntimeError):
    """The emulated launch found an error (an index out of a buffer, divergence, deadlock)."""


def _type(dtype) -> str:
    try:
        return _TYPES[dtype][0]
    except KeyError:
        raise NotImplementedError(f"metal_emu: dtype {dtype}") from None


def _to_numpy(a: mx.array) -> np.ndarray:
    """The array's bytes, row-contiguous, in its own dtype (bfloat16 as uint16 bits)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a, copy=True))


def _from_numpy(a: np.ndarray, dtype) -> mx.array:
    out = mx.array(a)
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


def _targ(v) -> tuple[str, str]:
    """(parameter kind, argument text) of one template argument, as MLX writes them."""
    if isinstance(v, mx.Dtype):
        return "typename", _type(v)
    if isinstance(v, bool):
        return "bool", "true" if v else "false"
    if isinstance(v, int):
        return "int", str(v)
    raise TypeError(f"metal_emu: template argument {v!r}")


_TG_DECL = re.compile(r"\bthreadgroup\s+([A-Za-z_][\w:]*)\s+([A-Za-z_]\w*)\s*\[([^\]]+)\]\s*;")
# C++ a g++ build accepts and Metal does not (the standard library is visible to the kernels here)
_NOT_METAL = re.compile(r"\bdouble\b|\bstd::|\b(?:expf|exp2f|logf|sqrtf|fabsf|powf|fmaf|fmaxf|fminf|"
                        r"printf|malloc|free|long\s+double)\b|#include\s*[<\"](?!metal_stdlib>)")


def _metal_text(text: str, what: str) -> str:
    """The kernel text with its threadgroup arrays as emu::tg_array; what Metal lacks refused."""
    text = re.sub(r"//[^\n]*", "", text)      # comments (the kernels hold no string with //)
    bad = _NOT_METAL.search(text)
    if bad:
        raise NotImplementedError(f"metal_emu: {what} uses {bad.group(0)!r}, which Metal lacks")
    text = _TG_DECL.sub(r"static emu::tg_array<\1, (\3)> \2;", text)
    if re.search(r"\bthreadgroup\b", text):
        raise NotImplementedError(f"metal_emu: {what}: only threadgroup arrays (`threadgroup T a[N];`) "
                                  "are emulated")
    return text


def render(name, input_names, output_names, source, header, inputs, output_dtypes, template):
    """The C++ text of one kernel instantiation and its launcher."""
    header = _metal_text(header, "the header")
    source = _metal_text(source, "the kernel")
    attrs = [(a, t) for a, t in METAL_ATTRIBUTES if a in source]
    for a, _ in attrs:
        if a not in SUPPORTED_ATTRIBUTES:
            raise NotImplementedError(f"metal_emu: attribute {a}")
    fn = f"emu_kernel_{name}"
    lines = ['#include "emu_runtime.h"', header]
    if template:
        lines.append("template <" + ", ".join(f"{_targ(v)[0]} {k}" for k, v in template) + ">")
    params = []
    # the launcher's arguments for each parameter, in order
    args = []
    for i, (n, a) in enumerate(zip(input_names, inputs)):
        t = _type(a.dtype)
        if a.ndim == 0:
            params.append(f"  const {t}& {n}")
            args.append(f"*(const {t}*)bufs[{i}]")
            continue
        params.append(f"  emu::dptr<const {t}> {n}")
        args.append(f"emu::dptr<const {t}>{{(const {t}*)bufs[{i}], counts[{i}], \"{n}\"}}")
        if f"{n}_shape" in source:
            params.append(f"  emu::dptr<const int> {n}_shape")
            args.append(f"emu::dptr<const int>{{shapes[{i}], ndims[{i}], \"{n}_shape\"}}")
        if f"{n}_strides" in source:
            params.append(f"  emu::dptr<const int64_t> {n}_strides")
            args.append(f"emu::dptr<const int64_t>{{strides[{i}], ndims[{i}], \"{n}_strides\"}}")
        if f"{n}_ndim" in source:
            params.append(f"  const int {n}_ndim")
            args.append(f"ndims[{i}]")
    for j, (n, d) in enumerate(zip(output_names, output_dtypes)):
        i = len(inputs) + j
        t = _type(d)
        params.append(f"  emu::dptr<{t}> {n}")
        args.append(f"emu::dptr<{t}>{{({t}*)bufs[{i}], counts[{i}], \"{n}\"}}")
    for a, t in attrs:
        params.append(f"  {t} {a}")
        args.append(f"ids.{a}")
    lines.append(f"void {fn}(\n" + ",\n".join(params) + ") {")
    lines.append(source)
    lines.append("}")
    inst = fn + ("<" + ", ".join(_targ(v)[1] for _, v in template) + ">" if template else "")
    lines.append(LAUNCHER.replace("@CALL@", f"{inst}({', '.join(args)});"))
    return "\n".join(lines) + "\n"


LAUNCHER = r"""
#undef device
#undef constant
#undef thread
#undef threadgroup
#undef kernel
namespace {
struct Ids {
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid,
      threadgroups_per_grid, threads_per_grid, threads_per_threadgroup;
  uint thread_index_in_simdgroup, thread_index_in_threadgroup, simdgroup_index_in_threadgroup,
      simdgroups_per_threadgroup, threads_per_simdgroup, thread_execution_width;
};
struct Ctx {
  void** bufs; const long long* counts; const int* const* shapes; const int64_t* const* strides;
  const int* ndims; uint3 grid, group, tgs, tg, size;
};
void body(void* c, int t) {
  Ctx& k = *(Ctx*)c;
  void** bufs = k.bufs; const long long* counts = k.counts; const int* const* shapes = k.shapes;
  const int64_t* const* strides = k.strides; const int* ndims = k.ndims;
  (void)bufs; (void)counts; (void)shapes; (void)strides; (void)ndims;
  Ids ids;
  const uint lx = t % k.size.x, ly = (t / k.size.x) % k.size.y, lz = t / (k.size.x * k.size.y);
  ids.thread_position_in_threadgroup = {lx, ly, lz};
  ids.threadgroup_position_in_grid = k.tg;
  ids.thread_position_in_grid = {k.tg.x * k.group.x + lx, k.tg.y * k.group.y + ly, k.tg.z * k.group.z + lz};
  ids.threadgroups_per_grid = k.tgs;
  ids.threads_per_grid = k.grid;
  ids.threads_per_threadgroup = k.size;
  ids.thread_index_in_threadgroup = (uint)t;
  ids.thread_index_in_simdgroup = (uint)t % 32u;
  ids.simdgroup_index_in_threadgroup = (uint)t / 32u;
  ids.simdgroups_per_threadgroup = (k.size.x * k.size.y * k.size.z + 31u) / 32u;
  ids.threads_per_simdgroup = 32u;
  ids.thread_execution_width = 32u;
  @CALL@
}
}  // namespace
extern "C" int emu_launch(void** bufs, const long long* counts, const int* const* shapes,
                          const int64_t* const* strides, const int* ndims, const unsigned* grid,
                          const unsigned* group, int order, char* err, int errlen) {
  static emu::Launch launch;
  emu::L = &launch;
  launch.err[0] = 0;
  launch.order = order;
  const int gsize = (int)(group[0] * group[1] * group[2]);
  if (gsize > emu::MAX_THREADS) {
    std::snprintf(err, errlen, "threadgroup of %d threads (at most %d)", gsize, emu::MAX_THREADS);
    return 1;
  }
  if (!launch.stacks) launch.stacks = (char*)std::malloc(emu::STACK * emu::MAX_THREADS);
  Ctx k{bufs, counts, shapes, strides, ndims, {grid[0], grid[1], grid[2]},
        {group[0], group[1], group[2]}, {}, {}, {}};
  k.tgs = {(grid[0] + group[0] - 1) / group[0], (grid[1] + group[1] - 1) / group[1],
           (grid[2] + group[2] - 1) / group[2]};
  launch.body = body;
  launch.ctx = &k;
  for (uint z = 0; z < k.tgs.z; ++z)
    for (uint y = 0; y < k.tgs.y; ++y)
      for (uint x = 0; x < k.tgs.x; ++x) {
        k.tg = {x, y, z};
        // dispatchThreads: the threadgroups at the grid's far edges are cut to the grid
        k.size = {std::min(group[0], grid[0] - x * group[0]), std::min(group[1], grid[1] - y * group[1]),
                  std::min(group[2], grid[2] - z * group[2])};
        if (!emu::run_group((int)(k.size.x * k.size.y * k.size.z))) {
          std::snprintf(err, errlen, "threadgroup (%u, %u, %u): %s", x, y, z, launch.err);
          return 1;
        }
      }
  return 0;
}
"""

# IEEE float32 as written (no contraction, no fast math); ISO C++ with its extensions refused
# (a variable-length array, which Metal lacks, among them); frame pointers for emu::call_site
FLAGS = ["-std=c++20", "-O1", "-ffp-contract=off", "-fno-fast-math", "-pedantic-errors", "-Werror=vla",
         "-Wno-unused", "-fno-omit-frame-pointer", "-shared", "-fPIC"]
_BUILD_LOCK = threading.Lock()
_RUN_LOCK = threading.Lock()   # a library's launch state is one static: one launch at a time
# emulated launches so far, in all and by kernel name (a test can check its kernels really ran)
LAUNCHES = {"count": 0}
# the threads' order between meeting points: 0 first to last, 1 last to first, 2 shuffled each
# round (emu_runtime.h's run_group); a kernel whose bits change with it has a data race
ORDER = {"order": 0}
_LIBS: dict[str, ctypes.CDLL] = {}


def cache_dir() -> Path:
    d = Path(os.environ.get("TF_METAL_EMU_CACHE") or
             Path(tempfile.gettempdir()) / f"tensorfold-metal-emu-{os.getuid()}")
    d.mkdir(parents=True, exist_ok=True)
    return d


def build(text: str) -> ctypes.CDLL:
    """Compile one rendered kernel (cached by its text and the emulator's headers)."""
    deps = "".join((HERE / f).read_text() for f in ("emu_runtime.h", "metal_stdlib")) + " ".join(FLAGS)
    key = hashlib.sha256((deps + text).encode()).hexdigest()[:24]
    with _BUILD_LOCK:
        if key in _LIBS:
            return _LIBS[key]
        so = cache_dir() / f"{key}.so"
        if not so.exists():
            src = cache_dir() / f"{key}.cpp"
            src.write_text(text)
            tmp = so.with_suffix(f".{os.getpid()}.tmp")
            cmd = ["g++", *FLAGS, f"-I{HERE}", str(src), "-o", str(tmp)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"metal_emu: the kernel did not compile ({src}):\n{r.stderr[-4000:]}")
            os.replace(tmp, so)
        lib = ctypes.CDLL(str(so))
        lib.emu_launch.restype = ctypes.c_int
        _LIBS[key] = lib
        return lib


def metal_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False, **_):
    """mx.fast.metal_kernel's stand-in (see the module's text)."""
    if atomic_outputs:
        raise NotImplementedError("metal_emu: atomic outputs")
    if not output_names:
        raise ValueError("[metal_kernel] Must specify at least one output.")

    def call(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
             init_value=None, verbose=False, stream=None):
        if len(inputs) != len(input_names):
            raise ValueError(f"[metal_kernel] Expected `inputs` to have size {len(input_names)}")
        tmpl = list(template or [])
        if len(grid) != 3 or min(grid) < 1 or len(threadgroup) != 3 or min(threadgroup) < 1:
            # (MLX passes them on as they are: min(threadgroup, grid) of 0 threads to Metal)
            raise EmulatedLaunchError(f"{name}: a launch of grid {tuple(grid)}, threadgroup "
                                      f"{tuple(threadgroup)}: no thread to run")
        text = render(name, input_names, output_names, source, header, inputs, output_dtypes, tmpl)
        if verbose:
            print(text)
        lib = build(text)
        host = [_to_numpy(a) for a in inputs]
        outs = []
        for shp, d in zip(output_shapes, output_dtypes):
            np_t = _TYPES[d][1]
            if init_value is not None:
                o = _to_numpy(mx.full(tuple(shp), init_value, dtype=d))
            else:   # uninitialized memory: NaN / all-ones bytes, so an unwritten element shows
                o = np.full(int(np.prod(shp)) * np.dtype(np_t).itemsize, 0xFF, np.uint8).view(np_t).reshape(tuple(shp))
            outs.append(o)
        arrs = host + outs
        n = len(arrs)
        bufs = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrs])
        counts = (ctypes.c_longlong * n)(*[a.size for a in arrs])
        shape_arrs = [np.array(a.shape or (1,), dtype=np.int32) for a in host]
        stride_arrs = [np.array([s // a.itemsize for s in a.strides] or [1], dtype=np.int64) for a in host]
        shapes = (ctypes.c_void_p * max(1, len(host)))(*[s.ctypes.data for s in shape_arrs])
        strides = (ctypes.c_void_p * max(1, len(host)))(*[s.ctypes.data for s in stride_arrs])
        ndims = (ctypes.c_int * max(1, len(host)))(*[a.ndim for a in host])
        g = (ctypes.c_uint * 3)(*grid)
        tg = (ctypes.c_uint * 3)(*[min(t, x) for t, x in zip(threadgroup, grid)])
        err = ctypes.create_string_buffer(1024)
        with _RUN_LOCK:
            LAUNCHES["count"] += 1
            LAUNCHES[name] = LAUNCHES.get(name, 0) + 1
            rc = lib.emu_launch(bufs, counts, shapes, strides, ndims, g, tg, ORDER["order"], err, 1024)
        if rc != 0:
            raise EmulatedLaunchError(f"{name}: {err.value.decode()}")
        return [_from_numpy(o, d) for o, d in zip(outs, output_dtypes)]

    return call
