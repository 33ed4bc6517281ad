"""The CUDA faces compile: every kernel, wrapped exactly as MLX's cuda_kernel wraps it, for the
template configurations of csrc/cuda/nvcc_check.py (dtypes, bits 2-8, head sizes 64-576, the
tensor-core plans of real shapes), with nvcc -arch=sm_90. CI has no GPU; this is the part of
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
