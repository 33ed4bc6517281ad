"""Shared pytest fixtures."""

from __future__ import annotations

import os
import pathlib

import pytest

# MLX's CUDA backend runs float32 matmuls in TF32 unless MLX_ENABLE_TF32=0 (read once per
# process, mlx/utils.h): the fp32 references of the closeness tests (e.g. test_moe's
# test_exact_decode_close_to_prefill, 1e-4) would carry TF32's ~1e-3 error. No effect on the CPU.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

DEFAULT_TINYCODE = "/work/shared/models/tinycode-4bit"


def find_tinycode() -> pathlib.Path | None:
    """$TF_TINYCODE, else the shared copy, else the packaged tensorfold/data/tinycode-4bit."""
    env = os.environ.get("TF_TINYCODE")
    candidates = [pathlib.Path(env)] if env else []
    candidates.append(pathlib.Path(DEFAULT_TINYCODE))
    try:
        import tensorfold

        candidates.append(pathlib.Path(tensorfold.__file__).parent / "data" / "tinycode-4bit")
    except ImportError:
        pass
    for c in candidates:
        if (c / "config.json").is_file():
            return c
    return None


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Small random-weight checkpoints, {name: path}; see tensorfold.testing.DEFAULT_SET."""
    from tensorfold.testing import write_default_set

    return write_default_set(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def tinycode_path() -> pathlib.Path:
    """The real trained tinycode-4bit model (fails if no copy is found: the package ships one)."""
    path = find_tinycode()
    if path is None:
        pytest.fail("tinycode-4bit not found: the package ships it (tensorfold/data), or set TF_TINYCODE")
    return path


def _test_seed() -> str:
    """The random-input seed of this run (kernel_helpers.TEST_SEED), where a test module loaded it."""
    import sys
    kh = sys.modules.get("kernel_helpers")
    return f"TF_TEST_SEED={kh.TEST_SEED}" if kh is not None else "TF_TEST_SEED unused"


def pytest_runtest_logreport(report):
    """TF_FAILURES_NOW=1: print each failure's report when it happens, not at the session's end.
    The H200 runs cut long suites at a time limit, which kills pytest before its summary (session
    44's s44b lost the one failure of 157 tests that way). Every failure's report names the run's
    input seed (rerun with it: TF_TEST_SEED=<seed> pytest <id>)."""
    if report.failed:
        report.sections.append(("random inputs", _test_seed()))
        if os.environ.get("TF_FAILURES_NOW") == "1":
            print(f"\n== FAILED {report.nodeid} ({report.when}; {_test_seed()})\n{report.longreprtext}\n",
                  flush=True)


def pytest_terminal_summary(terminalreporter):
    if terminalreporter.stats.get("failed") or terminalreporter.stats.get("error"):
        terminalreporter.write_line(f"random inputs of this run: {_test_seed()}")
