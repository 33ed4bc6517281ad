"""How long a new process waits for its replies on the current device, with MLX's PTX disk cache
empty and then warm (session 47; prepared for the H200, dry-run on the CPU).

On the H200 one engine test takes 25-290 s (session 47: test_drafted_equals_serial[12-dsa] 137 s,
1.5 s on the CPU). Every kernel instance (ours through mx.fast.cuda_kernel, and MLX's own JIT
kernels) is compiled by NVRTC at its first launch and kept in MLX's PTX cache on disk. A server's
first requests on a new machine pay that. This measures it on tinycode-4bit, the model the package
ships: one child process with a new, empty MLX_PTX_CACHE_DIR, then a second child on the cache the
first one filled.

    python3 bench/gpu_cold_start.py [max_tokens]

Per child, seconds: engine init (load + row_check), one greedy reply without drafts, the same
again, one with drafts, the same again; then our kernel instances built (file mode) and the files
in the PTX cache.

Session 48 measured it (MLX compiles our kernels in every process: init 25-35 s with MLX's own
kernels cached) and added tensorfold/kernels/_kcache.py, which writes our compiled kernels into
MLX's PTX cache. Now five children: the kernel cache off (TENSORFOLD_KERNEL_CACHE=0), an empty then
a warm MLX cache; then on, an empty then a warm one (a new directory); then on, a new MLX directory
with TensorFold's own copies warm (TENSORFOLD_CACHE_DIR, a new directory for the run); then both
empty again with TENSORFOLD_KERNEL_COMPILE_THREADS=$COLD_THREADS (default: the package's, min(8,
cores)): row_check's compiles side by side. The first four children compile one after another.

Session 49: those side-by-side compiles on threads gained nothing on the H200 (NVRTC serializes compiles
within a process); they now run in worker processes (tensorfold/kernels/_nvrtc.py). COLD_SET=threads
times just that: one child with both caches empty fills an MLX directory; then children whose MLX
directory is a copy of it without our modules (MLX's own kernels warm, ours to compile), one for each
of COLD_THREADS_LIST (default 1,8: one after another in the process, then eight worker processes).
COLD_SET=lasting: two children with MLX_PTX_CACHE_DIR unset that call _kcache.lasting_mlx_dir() first, as
`tensorfold serve` does: MLX's own modules must land in that directory, and the second child start warm."""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(n: int) -> dict:
    import mlx.core as mx
    lasting = None
    if os.environ.get("COLD_LASTING") == "1":     # what `tensorfold serve` does first
        from tensorfold.kernels import _kcache
        lasting = _kcache.lasting_mlx_dir()

    import tensorfold
    from tensorfold.engine import Engine, SamplingParams
    path = Path(tensorfold.__file__).parent / "data" / "tinycode-4bit"
    msgs = [{"role": "user", "content": "Show the function dumps from json."}]
    greedy = SamplingParams(temperature=0.0, seed=0)
    out, t = {"device": str(mx.default_device())}, time.perf_counter()
    eng = Engine(path)
    out["init"] = time.perf_counter() - t
    out["row_exact"] = bool(eng.row_exact)
    replies = []
    for name, draft in (("serial", False), ("serial_again", False), ("drafted", True), ("drafted_again", True)):
        t = time.perf_counter()
        replies.append(eng.generate_text(messages=msgs, max_tokens=n, sampling=greedy, draft=draft)[1])
        out[name] = time.perf_counter() - t
    out["same_reply"] = all(r == replies[0] for r in replies)
    out["tokens"] = len(replies[0])
    try:
        from tensorfold.kernels import _cuda
        out["our_instances"] = _cuda._file_instance.cache_info().currsize
    except Exception as e:          # no CUDA face here (the CPU dry run)
        out["our_instances"] = f"n/a ({type(e).__name__})"
    d = os.environ.get("MLX_PTX_CACHE_DIR", "")
    if lasting is not None:
        out["lasting"] = str(lasting)
        out["mlx_own_modules"] = sum(1 for p in lasting.rglob("*.ptx") if not p.name.startswith("custom_kernel_"))
    out["ptx_files"] = sum(len(f) for _, _, f in os.walk(d)) if d else "n/a"
    from tensorfold.kernels import _kcache
    out["kcache"] = dict(_kcache.stats, on=_kcache.enabled())
    return out


def main():
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(child(int(sys.argv[2]))), flush=True)
        return
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    if os.environ.get("COLD_SET") == "threads":
        return threads_set(n)
    if os.environ.get("COLD_SET") == "lasting":     # session 49: serve's MLX_PTX_CACHE_DIR, two children
        env = {k: v for k, v in os.environ.items() if k != "MLX_PTX_CACHE_DIR"}
        env.update(COLD_LASTING="1", TENSORFOLD_CACHE_DIR=tempfile.mkdtemp(prefix="tf-cache-cold."))
        for run in ("lasting directory, empty", "lasting directory, warm"):
            spawn(run, env, n)
        return
    runs, own = [], tempfile.mkdtemp(prefix="tf-cache-cold.")      # TensorFold's own cache, empty at first
    for kc in ("0", "1"):        # one compile after another, as s48d measured
        env = dict(os.environ, MLX_PTX_CACHE_DIR=tempfile.mkdtemp(prefix="mlx-ptx-cold."),
                   TENSORFOLD_KERNEL_CACHE=kc, TENSORFOLD_CACHE_DIR=own, TENSORFOLD_KERNEL_COMPILE_THREADS="1")
        runs += [(f"kernel cache {'on' if kc == '1' else 'off'}, {c}", env) for c in ("empty cache", "warm cache")]
    # MLX's directory new (a reboot's /tmp, another process's MLX_PTX_CACHE_DIR): our kernels copied from ours
    runs.append(("kernel cache on, MLX's cache empty, ours warm",
                 dict(env, MLX_PTX_CACHE_DIR=tempfile.mkdtemp(prefix="mlx-ptx-cold."))))
    # both empty again, row_check's compiles side by side (kernels.compiles_batched): COLD_THREADS, else the
    # default (min(8, cores))
    threads = os.environ.get("COLD_THREADS", "")
    runs.append((f"kernel cache on, both empty, {threads or 'default'} compile threads",
                 dict(env, MLX_PTX_CACHE_DIR=tempfile.mkdtemp(prefix="mlx-ptx-cold."),
                      TENSORFOLD_CACHE_DIR=tempfile.mkdtemp(prefix="tf-cache-cold."),
                      TENSORFOLD_KERNEL_COMPILE_THREADS=threads)))
    for run, env in runs:
        spawn(run, env, n)


def threads_set(n: int) -> None:
    import shutil
    base = dict(os.environ, TENSORFOLD_KERNEL_CACHE="1")
    filled = tempfile.mkdtemp(prefix="mlx-ptx-cold.")
    spawn("both empty, 1 compile thread", dict(base, MLX_PTX_CACHE_DIR=filled, TENSORFOLD_KERNEL_COMPILE_THREADS="1",
                                               TENSORFOLD_CACHE_DIR=tempfile.mkdtemp(prefix="tf-cache-cold.")), n)
    for threads in os.environ.get("COLD_THREADS_LIST", "1,8").split(","):
        d = tempfile.mkdtemp(prefix="mlx-ptx-cold.")
        shutil.copytree(filled, d, dirs_exist_ok=True, ignore=shutil.ignore_patterns("custom_kernel_*"))
        spawn(f"MLX's own kernels warm, ours empty, {threads} compile threads",
              dict(base, MLX_PTX_CACHE_DIR=d, TENSORFOLD_KERNEL_COMPILE_THREADS=threads,
                   TENSORFOLD_CACHE_DIR=tempfile.mkdtemp(prefix="tf-cache-cold.")), n)


def spawn(run: str, env: dict, n: int) -> None:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, __file__, "--child", str(n)], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        print(f"{run}: child failed (rc {r.returncode})\n{r.stderr[-2000:]}")
        sys.exit(1)
    o = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"{run} ({o['device']}): process {wall:.1f} s; init {o['init']:.1f} s; serial {o['serial']:.2f} s, "
          f"again {o['serial_again']:.2f} s; drafted {o['drafted']:.2f} s, again {o['drafted_again']:.2f} s; "
          f"{o['tokens']} tokens, same reply {o['same_reply']}, row_exact {o['row_exact']}; "
          f"our kernel instances {o['our_instances']}; PTX cache files {o['ptx_files']}; "
          f"kernel cache {o['kcache']}" + (f"; MLX_PTX_CACHE_DIR {o['lasting']}, MLX's own modules there "
                                           f"{o['mlx_own_modules']}" if "lasting" in o else ""), flush=True)


if __name__ == "__main__":
    main()
