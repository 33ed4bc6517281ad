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
    # the untimed calls before each case (GEMM_WARM) run under a "setup" marker: left out
    launches = [(mark.format("setup"), 1000, 0), (ours, 90_000, 9_440_000), (ours, 80_000, 9_440_000)]
    launches += [(mark.format("qmm_4096x4096_M1_ours"), 1000, 0)]
    # ours: one kernel a call, 10 / 30 / 12 us -> median 12 (the mean would be 17.3)
    launches += [(ours, ns, 9_440_000) for ns in (10_000, 30_000, 12_000)]
    launches += [(mark.format("setup"), 1000, 0), ("nvjet_gemm_bf16(x)", 99_000, 9_000_000)]
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
    bad = launches[:7] + [launches[6]] + launches[7:]    # one "ours" launch too many
    _ncu_csv(path, bad)
    with pytest.raises(SystemExit, match="kernels for 3 calls"):
        gkt.report(str(path))
    sys.modules.pop("gpu_kernel_time", None)


def test_sass_stalls_report_ranks_instructions_and_opcodes(tmp_path, monkeypatch):
    """bench/gpu_sass_stalls.py on a synthetic ncu source-page CSV: instructions by stall
    samples (numbers with thousands separators), the largest reasons, samples by opcode with
    predicates stripped."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("gpu_sass_stalls", None)
    st = importlib.import_module("gpu_sass_stalls")
    path = tmp_path / "src.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "custom_kernel_tf_row_qmm_cp"])
        w.writerow(["Address", "Source", "Warp Stall Sampling (All Samples)",
                    "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed",
                    "stall_long_sb", "stall_wait"])
        w.writerow(["0x10", "@!P0 HMMA.16816.F32.BF16 R8, R12, R16, RZ", "300", "250", "49,152", "0", "200"])
        w.writerow(["0x20", "LDSM.16.M88.4 R4, [R2]", "1,200", "1000", "1,536", "900", "100"])
        w.writerow(["0x30", "@P1 HMMA.16816.F32.BF16 R20, R12, R16, R20", "100", "90", "49,152", "0", "50"])
    header, rows = st.read(str(path))
    text = st.summarize(header, rows, top=2)
    lines = text.splitlines()
    assert lines[0] == "3 instructions, 1600 stall samples"
    assert "`LDSM.16.M88.4 R4, [R2]` | 1200 | 75.0% | 1536 | stall_long_sb 900, stall_wait 100" in lines[4]
    assert "HMMA.16816" in lines[5] and "0x30" not in text.split("| opcode")[0]   # top 2 only
    assert "| LDSM | 1200 | 75.0% |" in text and "| HMMA | 400 | 25.0% |" in text


def test_cp_floor_variants_cut_the_right_halves(tmp_path, capsys, monkeypatch):
    """bench/gpu_cp_floor.py: `mem` keeps the copies and drops every mma and group fold, `comp`
    keeps the mmas and returns from the copy lambdas first, `nox` loads no x, `even` folds even
    columns only, `full` is the kernel's text; the report pairs each tfcp launch with the marker
    before it and takes medians."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("gpu_cp_floor", None)
    fl = importlib.import_module("gpu_cp_floor")
    from tensorfold.kernels._sources import kernel_text
    assert fl.variant_text("full") == kernel_text("cuda", "row_gemm.cu", "row_qmm_cp")
    full = fl.variant_text("full")[1]
    mem = fl.variant_text("mem")[1]
    comp = fl.variant_text("comp")[1]
    assert "tf_mma(" in full and "tf_tc_fold<" in full and "tf_cp_async16" in full
    assert "tf_mma(" not in mem and "tf_tc_fold<" not in mem
    assert "tf_cp_async16" in mem and "tf_ldmatrix4(" in mem and "tf_tc_finish<" in mem
    assert "tf_mma(" in comp and "auto issue=[&](int ci){return;" in comp
    assert "auto scp=[&](){return;" in comp
    assert mem.count("{") == mem.count("}") and comp.count("{") == comp.count("}")
    path = tmp_path / "floor.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value"])
        rows = [("tfmark_12288x4096_M1_full", 3.0), ("tfcp_full", 12.0), ("tfcp_full", 13.0),
                ("tfcp_full", 12.5), ("tfmark_12288x4096_M1_mem", 3.0), ("tfcp_mem", 9.0),
                ("tfmark_12288x4096_M1_comp", 3.0), ("tfcp_comp", 5000.0)]
        for i, (name, us) in enumerate(rows):
            unit, val = ("ns", f"{us:,.0f}") if us > 100 else ("us", str(us))
            w.writerow([str(i), f"custom_kernel_{name}(float*)", "gpu__time_duration.sum", unit, val])
    fl.report(str(path))
    out = capsys.readouterr().out
    assert "| shape | rows | full | mem | comp | full - mem | full - comp |" in out
    assert "| 12288 x 4096 | 1 | 12.50 | 9.00 | 5.00 | 3.50 | 7.50 |" in out
    nox = fl.variant_text("comp+nox+even")
    assert "__ldg(" not in nox[1].split("auto loadx")[1].split("};")[0] and "tf_mma(" in nox[1]
    assert "i+=2" in nox[0] and "i+=2" not in fl.variant_text("full")[0]
    tail = fl.variant_text("notail")[1]
    assert "if(ci+1<CPW){" in tail and tail.count("{") == tail.count("}")
    # hi / hi2: the same pairs, shifted as the high word of a multiply (j = 1, 3 / every j > 0)
    hi, hi2 = fl.variant_text("hi")[0], fl.variant_text("hi2")[0]
    assert "__umulhi(" not in fl.variant_text("full")[0]
    assert "j&1?__umulhi(w,1u<<(32-4*j)):w>>(4*j)" in hi and "j?__umulhi(" in hi2
    assert {"full", "hi", "hi2", "xp1", "xp2", "xp3", "fs2", "fs4", "fd2", "fd4"} == fl.EXACT
    # fsN / fdN (session 58): stage 0 committed in N parts, chunk 0's reads and groups after each part's wait
    for cut in ("fs2", "fd4"):
        fs = fl.variant_text(cut)[1]
        assert fs.startswith(f"constexpr int FSP={cut[2]};") and fs.count("{") == fs.count("}")
        assert "waitn(ci==0?FSP-1:0);" in fs and "ldw(0,ci==0?CB/FSP:CB);" in fs
        assert "ldw(gi*BPG,gi*BPG+CB/FSP);" in fs and "tf_cp_async_wait<NS-2>" not in fs
        assert ("constexpr bool FSD=true;" in fs) == (cut[1] == "d")
    # xpD (session 57): chunk ci + D's x lines asked of L1 at the top of chunk ci, nothing else changed
    xp = fl.variant_text("xp2")[1]
    assert "const int cn=ci+2;" in xp and "prefetch.global.L1 [%0];" in xp and "prefetch" not in fl.variant_text("full")[1]
    assert xp.count("{") == xp.count("}")
    # nxm: no X = sum x mma left, the X values set from the x pairs instead (timing only)
    nxm = fl.variant_text("comp+nox+nxm")[1]
    assert "tf_mma(X[" in full and "tf_mma(X[" not in nxm and "tf_mma(P[" in nxm
    assert "X[0][s]=__uint_as_float(xb[0][s]&0x3f7fffffu);" in nxm and "nxm" not in fl.EXACT
    xw0 = fl.variant_text("xw0")[1]
    assert "xrow[0]+=(size_t)blkw*32;" in full and "xrow[0]+=(size_t)blkw*32;" not in xw0
    il = fl.variant_text("mem+il")[1]
    assert "blkw=warp*CB;" in il and il.count("ci*SPLIT*CB*") == 3 and "tf_mma(" not in il
    monkeypatch.setenv("FLOOR_VARIANTS", "full,notail_cb4_ns4,comp+nox_ns3_xe2_nt1_sp8,hi_on0")
    assert fl.cases() == [("full", "full", {}), ("notail_cb4_ns4", "notail", {"cb": 4, "ns": 4}),
                          ("comp+nox_ns3_xe2_nt1_sp8", "comp+nox",
                           {"ns": 3, "xe": 2, "nt": 1, "sp": 8}), ("hi_on0", "hi", {"on": 0})]


def test_cp_timeline_stamps_and_summary(monkeypatch):
    """bench/gpu_cp_timeline.py: the shipped text with clock stamps at entry, after each stage
    wait, after each chunk's arithmetic (pinned behind the accumulators) and after the loop; the
    summary's per-chunk waits and arithmetic come from those stamps."""
    import numpy as np
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("gpu_cp_timeline", None)
    tlm = importlib.import_module("gpu_cp_timeline")
    header, body = tlm.timeline_text("full")
    assert body.count("%%clock64") == 5 and body.count("%%globaltimer") == 2
    assert body.count("{") == body.count("}")
    assert body.index("tl[TLB+3+ci]") < body.index("tl[TLB+3+CPW+ci]") < body.index("tf_tc_finish<")
    # two warps on one SM, two chunks: entry 0 / 100, stages land 1000 / 3000 after entry, ...
    cpw = 2
    rows = []
    for e in (0, 1980):
        rows.append([7, 0, e, e + 1980, e + 5940, e + 3960, e + 7920, e + 7920, e + 9900, 4000])
    out = "\n".join(tlm.summarize(np.array(rows, dtype=np.uint64), cpw, 4))
    assert "| chunk 0: entry -> stage landed |   1.00 /   1.00 |" in out
    assert "| chunk 0: arithmetic |   1.00 /   1.00 |" in out
    assert "| chunk 1: arithmetic 0 done -> stage landed (wait) |   1.00 /   1.00 |" in out
    assert "| SM: first entry -> last loop done |   5.00 /   5.00 |" in out
    assert "| SM: last stage landed -> last loop done (tail) |   1.00 /   1.00 |" in out
    assert "SM clock 1.98 GHz" in out      # 7920 cycles over the timers' 4000 ns
    assert "| global: first entry -> last loop done (ns timer) | 4.00 |" in out


def test_wg_probe_report_pairs_runs_with_lines(tmp_path, capsys, monkeypatch):
    """bench/wg_probe_report.py: each run of consecutive wg_q4 / wg_comp launches in ncu's CSV is
    one of the probe's result lines, in order; the first launch (the bit check) is left out of the
    median; other kernels (ref_q4, ref_sum) end a run."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("wg_probe_report", None)
    rep = importlib.import_module("wg_probe_report")
    events = tmp_path / "events.txt"
    events.write_text("H200\n"
                      "12288x4096 N 12288 K 4096 split 4 QPB 2 R  1: mismatches 0 of 12288, 30.0 us (events)\n"
                      "12288x4096 N 12288 K 4096 split 4 QPB 2 R 16: mismatches 3 of 196608, 40.0 us (events)\n")
    path = tmp_path / "wg.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value"])
        rows = [("ref_q4<4096, 4>", 90.0), ("ref_sum<4>", 3.0),
                ("wg_q4<4096, 4, 2, 8, 4, false, 1, 0>", 99.0), ("wg_q4<4096, 4, 2, 8, 4, false, 1, 0>", 24.0),
                ("wg_q4<4096, 4, 2, 8, 4, false, 1, 0>", 26.0), ("wg_q4<4096, 4, 2, 8, 4, false, 1, 0>", 25.0),
                ("ref_q4<4096, 4>", 90.0), ("ref_sum<4>", 3.0),
                ("wg_q4<4096, 4, 2, 16, 4, false, 1, 0>", 99.0), ("wg_q4<4096, 4, 2, 16, 4, false, 1, 0>", 32.0)]
        for i, (name, us) in enumerate(rows):
            w.writerow([str(i), f"void {name}(const __nv_bfloat16 *)", "gpu__time_duration.sum", "us", str(us)])
    rep.main(str(events), str(path))
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "warning" not in " ".join(out)
    assert out[0].endswith("R  1: 0 bad; ncu median 25.00 us (n=3, min 24.00)")
    assert out[1].endswith("R 16: 3 bad; ncu median 32.00 us (n=1, min 32.00)")


def test_attn_rows_report_sums_a_calls_kernels(tmp_path, capsys, monkeypatch):
    """bench/gpu_attn_rows.py --report: a call is its kernels up to the first one's next launch
    (partials + merge for ours, cuDNN's kernels for MLX), the case the median call; stray kernels
    outside the cases (inputs made between markers) are left out, and a case short of calls is
    NaN, never a partial sum."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("ATTN_REPS", "3")
    sys.modules.pop("gpu_attn_rows", None)
    gar = importlib.import_module("gpu_attn_rows")
    mark = "mlx::custom_kernel_tfmark_{}(float const*, float*)"
    part, merge = "mlx::custom_kernel_tf_row_attn_tc_bf16(x)", "mlx::custom_kernel_tf_row_attn_merge_bf16(x)"
    tcg = "mlx::custom_kernel_tf_row_attn_tcg_bf16(x)"
    sdpa = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop(x)"
    L = [(mark.format("setup"), 1000, 0), ("mlx::rbitsc(x)", 50_000, 0)]
    L += [(mark.format("L1024_M1_ours"), 1000, 0)]
    for a, b in ((7_000, 5_000), (6_000, 4_000), (9_000, 9_000)):      # calls 12 / 10 / 18 -> 12
        L += [(part, a, 0), (merge, b, 0)]
    L += [("void mlx::copy_s<float>(x)", 3_000, 0)]                    # the next marker's input
    L += [(mark.format("L1024_M1_g4b3"), 1000, 0)]
    for a in (40_000, 41_000):                                          # 2 calls of 3: NaN
        L += [(tcg, a, 0), (merge, 3_000, 0)]
    L += [(mark.format("L1024_M1_sdpa"), 1000, 0)]
    for a in (8_000, 9_000, 8_500):
        L += [(sdpa, a, 0), ("void cudnn::lean_reduction_kernel(x)", 3_000, 0)]
    L += [(mark.format("end"), 1000, 0)]
    _ncu_csv(tmp_path / "a.csv", L)
    gar.report(str(tmp_path / "a.csv"))
    out = capsys.readouterr().out
    row = [ln for ln in out.splitlines() if ln.startswith("| 1024 | 1 |")][0].split("|")
    head = [c.strip() for c in out.splitlines()[0].split("|")]
    cell = lambda name: row[head.index(name)].strip()  # noqa: E731
    assert cell("ours us") == "12.0" and cell("g4b3 us") == "nan" and cell("sdpa us") == "11.5"
    assert "row_attn_tc_bf16 7.0 + row_attn_merge_bf16 5.0" in out


def test_step_graph_counts_a_dense_decode_steps_launches(monkeypatch):
    """bench/step_graph.py (the CUDA decode step's nodes, counted on any machine) still traces the
    step (its kernel stand-in had lost track of _kernel's signature), and pins the launches a layer:
    q|k|v, o, gate|up and down GEMMs, the fused q/k norm + RoPE + KV write, the attention partials
    and merge, two MLX rms_norms; the LM head and the final norm once a step."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("step_graph", None)
    sg = importlib.import_module("step_graph")
    launches, nodes = sg.trace("qwen3", 2)
    assert dict(launches) == {"row_qmm_cp": 4 * 2 + 1, "rms_norm (MLX)": 2 * 2 + 1, "qk_norm_rope_kv": 2,
                              "row_attn_tcg": 2, "row_attn_merge": 2}
    assert nodes["CompiledSigmoidBroadcastBroadcastMultiplyBroadcastBroadcastMultiply"] == 2  # SwiGLU, MLX's
