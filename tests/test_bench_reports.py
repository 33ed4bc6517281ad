"""The H200 GEMM table's report (bench/gpu_kernel_time.py --report) on a synthetic Nsight Compute
CSV: a case's time is the median over its calls, each call the sum of its kernels (the numbers
docs/benchmarks.md and the README publish come from this function)."""
import csv
import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _ncu_csv(path, launches):
    """launches: (kernel name, time in ns, DRAM bytes) in launch order, as ncu --csv writes them
    (one row per metric, after its log lines)."""
    with open(path, "w", newline="") as f:
        f.write("==PROF== Connected to process 1\n")
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value"])
        for i, (name, ns, byt) in enumerate(launches):
            w.writerow([i, name, "gpu__time_duration.sum", "nsecond", f"{ns:,}"])
            w.writerow([i, name, "dram__bytes_read.sum", "byte", f"{byt:,}"])


def test_gemm_report_takes_the_median_call(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("GEMM_REPS", "3")
    sys.modules.pop("gpu_kernel_time", None)
    gkt = importlib.import_module("gpu_kernel_time")
    mark = "tfmark_{}(float const*, float*)"
    ours = "custom_kernel_tf_row_qmm_cp_bfloat16_t(x)"
    launches = [(mark.format("qmm_4096x4096_M1_ours"), 1000, 0)]
    # ours: one kernel a call, 10 / 30 / 12 us -> median 12 (the mean would be 17.3)
    launches += [(ours, ns, 9_440_000) for ns in (10_000, 30_000, 12_000)]
    launches += [(mark.format("qmm_4096x4096_M1_mlx"), 1000, 0)]
    # MLX: two kernels a call (a GEMM and its split-K reduce): 20 + 4, 21 + 5, 50 + 5 -> 26
    for a, b in ((20_000, 4_000), (21_000, 5_000), (50_000, 5_000)):
        launches += [("nvjet_gemm_bf16(x)", a, 9_000_000), ("splitKreduce_kernel(x)", b, 440_000)]
    launches += [(mark.format("end"), 1000, 0)]
    path = tmp_path / "ncu.csv"
    _ncu_csv(path, launches)
    gkt.report(str(path))
    row = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| qmm |")]
    assert len(row) == 1
    cells = [c.strip() for c in row[0].strip("|").split("|")]
    assert cells[:3] == ["qmm", "4096x4096", "1"]
    assert cells[3] == "12.0" and cells[6] == "26.0" and cells[8] == "2.17", cells
    assert cells[4] == "787"     # 9.44 MB in the median call's 12 us: 787 GB/s
    # a kernel count that is not a whole number of calls is refused, not guessed at
    bad = launches[:4] + [launches[3]] + launches[4:]    # one "ours" launch too many
    _ncu_csv(path, bad)
    with pytest.raises(SystemExit, match="kernels for 3 calls"):
        gkt.report(str(path))
    sys.modules.pop("gpu_kernel_time", None)
