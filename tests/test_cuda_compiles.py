"""The CUDA faces compile: every kernel, wrapped exactly as MLX's cuda_kernel wraps it, for the
template configurations of csrc/cuda/nvcc_check.py (dtypes, bits 2-8, head sizes 64-576, the
tensor-core plans of real shapes), with nvcc -arch=sm_90, many cases a file. CI has no GPU; this is the part of
the CUDA faces it can check. Skipped where no nvcc is installed."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "csrc" / "cuda" / "nvcc_check.py"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
def test_every_cuda_kernel_compiles():
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert r.stdout.strip().splitlines()[-1].endswith("compiled")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
def test_a_failing_case_in_a_batch_is_named(tmp_path, monkeypatch):
    """The check compiles its cases in batches (a file holds many, each in a namespace of its
    own); a batch that fails is compiled again case by case, so the failure names its case and
    the others in the batch still pass."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("nvcc_check", SCRIPT)
    check = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "argv", ["nvcc_check.py"])
    spec.loader.exec_module(check)
    cases = [(i, c) for i, c in enumerate(check.CASES) if c[0] == "moe_route"][:3]
    real = check.standalone_source

    def source(name, tmpl, *args, **kw):
        src = real(name, tmpl, *args, **kw)
        if tmpl == cases[1][1][1]:
            src = src.replace("} // namespace mlx::core::cu",
                              "static_assert(false, \"bad\");\n} // namespace mlx::core::cu")
        return src
    monkeypatch.setattr(check, "standalone_source", source)
    results = check._compile_batch(str(tmp_path), cases)
    assert [ok for ok, _ in results] == [True, False, True], results
    assert results[1][1].startswith("FAIL moe_route") and str(cases[1][1][1]["E"]) in results[1][1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
def test_file_mode_gives_the_same_machine_code(tmp_path, monkeypatch):
    """TENSORFOLD_CUDA_TEXT=file (the body a device function in a file the text includes, so MLX
    hashes a short text at every launch) compiles to the PTX the inline text does. One case of six
    kernels, including shapes read from `<n>_shape` and static __shared__ locals (these are named
    after their function in the PTX, so the hash keeps only the local's own name). The whole set:
    nvcc_check.py --ptx-hash --text-file against --ptx-hash."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("nvcc_check", SCRIPT)
    check = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "argv", ["nvcc_check.py"])
    monkeypatch.setenv("TENSORFOLD_CACHE_DIR", str(tmp_path / "cache"))
    spec.loader.exec_module(check)
    picked, seen = [], set()
    for i, c in enumerate(check.CASES):
        if c[0] in ("row_qmm_cp", "row_attn_tcg", "row_attn_merge", "qk_norm_rope_kv", "moe_route", "sparse_merge") \
                and c[0] not in seen:
            seen.add(c[0])
            picked.append((i, c))
    assert len(picked) == 6
    for i, case in picked:
        ok_a, a = check._compile(str(tmp_path), i, case, True, False)
        ok_b, b = check._compile(str(tmp_path), 10_000 + i, case, True, False, "file")
        assert ok_a and ok_b, (a + b)[-3000:]
        assert a.split()[1] == b.split()[1], (a, b)      # the PTX hash
