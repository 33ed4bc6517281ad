"""One NVRTC compile through ctypes, and a worker process that runs a list of them (standard library only).

The kernel cache (_kcache.py) compiles the CUDA face's kernel instances with the NVRTC library MLX loaded.
NVRTC serializes most of a compile inside one process: on the 2-core CI host, two threads compiling the
decode step's 13 instances took 2.8 s an instance against 1.7 s one after another (1.14x in all), and on
the H200's 16 cores eight threads gained nothing on a first start (session 49, bench/gpu_cold_start.py).
Separate processes share no NVRTC state, so ``_kcache.batched`` deals its queued compiles to worker
processes running this file as a script. It imports nothing but the standard library (no MLX, no CUDA
context): a worker starts in tens of milliseconds, and is fed by a pickle on stdin:

    {"lib": libnvrtc's path (None: by its soname), "preload": [its builtins' path, ...], "opts": [...],
     "headers": {name: bytes}, "jobs": [(module, text, full_name), ...]}

and answers with a pickle on stdout: one (cubin, mangled name) or ("error", message) a job, in order;
exit status 3 where it cannot load NVRTC.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import sys


class NvrtcError(RuntimeError):
    pass


def load(path: str | None, preload=()):
    """The NVRTC library at `path` (else by its soname), with its argument types; `preload` first (its
    builtins library, already loaded in the parent, so NVRTC's own dlopen of it finds it by soname)."""
    for p in preload:
        try:
            ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass
    lib = ctypes.CDLL(path or "libnvrtc.so")
    vp, cp, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
    lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(vp), cp, cp, ctypes.c_int, ctypes.POINTER(cp),
                                       ctypes.POINTER(cp)]
    lib.nvrtcAddNameExpression.argtypes = [vp, cp]
    lib.nvrtcCompileProgram.argtypes = [vp, ctypes.c_int, ctypes.POINTER(cp)]
    lib.nvrtcGetLoweredName.argtypes = [vp, cp, ctypes.POINTER(cp)]
    lib.nvrtcGetCUBINSize.argtypes = [vp, ctypes.POINTER(sz)]
    lib.nvrtcGetCUBIN.argtypes = [vp, ctypes.c_char_p]
    lib.nvrtcGetProgramLogSize.argtypes = [vp, ctypes.POINTER(sz)]
    lib.nvrtcGetProgramLog.argtypes = [vp, ctypes.c_char_p]
    lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(vp)]
    lib.nvrtcVersion.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    return lib


def version(lib) -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise NvrtcError(f"{what} failed ({rc})")


def compile_cubin(lib, opts: list[str], headers: dict[str, bytes], module: str, text: str,
                  full_name: str) -> tuple[bytes, str]:
    """NVRTC as MLX's compile() calls it: (cubin, mangled name of full_name)."""
    names = (ctypes.c_char_p * len(headers))(*[n.encode() for n in headers])
    bodies = (ctypes.c_char_p * len(headers))(*headers.values())
    prog = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), (module + ".cu").encode(),
                                  len(headers), bodies, names), "nvrtcCreateProgram")
    try:
        _check(lib.nvrtcAddNameExpression(prog, full_name.encode()), "nvrtcAddNameExpression")
        copts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), copts)
        if rc != 0:
            n = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            log = ctypes.create_string_buffer(n.value + 1)
            lib.nvrtcGetProgramLog(prog, log)
            raise NvrtcError(f"NVRTC: {log.value.decode(errors='replace')[:2000]}")
        mangled = ctypes.c_char_p()
        _check(lib.nvrtcGetLoweredName(prog, full_name.encode(), ctypes.byref(mangled)), "nvrtcGetLoweredName")
        n = ctypes.c_size_t()
        _check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(n)), "nvrtcGetCUBINSize")
        buf = ctypes.create_string_buffer(n.value)
        _check(lib.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
        return buf.raw, mangled.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def main() -> None:
    req = pickle.load(sys.stdin.buffer)
    try:
        lib = load(req["lib"], req["preload"])
    except (OSError, AttributeError) as e:     # the parent compiles in its own process instead
        print(f"tensorfold NVRTC worker: cannot load NVRTC ({e})", file=sys.stderr)
        sys.exit(3)
    out = []
    for module, text, full in req["jobs"]:
        try:
            out.append(compile_cubin(lib, req["opts"], req["headers"], module, text, full))
        except Exception as e:          # reported to the parent, which leaves that instance to MLX
            out.append(("error", f"{type(e).__name__}: {e}"))
    sys.stdout.buffer.write(pickle.dumps(out))
    sys.stdout.buffer.flush()
    os._exit(0)                         # no interpreter teardown: the parent is waiting


if __name__ == "__main__":
    main()
