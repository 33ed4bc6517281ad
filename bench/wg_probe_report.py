"""Device times of bench/wg_probe.cu's wgmma launches from ncu's CSV.

    python3 bench/wg_probe_report.py EVENTS.txt NCU.csv

EVENTS.txt is the probe's stdout under ncu (its "mismatches" lines, in launch order); each maximal
run of consecutive wg_q4 launches in the CSV is one of those lines: the first launch is the bit
check, the rest are the timed ones (median reported, µs)."""
import re
import statistics
import sys

from ncu_csv import ncu_rows, ncu_us


def main(events: str, path: str) -> None:
    lines = [l.rstrip() for l in open(events) if "mismatches" in l]
    rows = [(r["Kernel Name"], ncu_us(r)) for r in ncu_rows(path)
            if r["Metric Name"] == "gpu__time_duration.sum"]
    runs, last = [], None
    for name, us in rows:
        if name.startswith(("void wg_q4", "wg_q4", "void wg_comp", "wg_comp")):
            if last == name and runs:
                runs[-1][1].append(us)
            else:
                runs.append((name, [us]))
            last = name
        else:
            last = None
    if len(runs) != len(lines):
        print(f"(warning: {len(runs)} wg_q4 runs in the CSV, {len(lines)} result lines)")
    for line, (name, ts) in zip(lines, runs):
        timed = ts[1:] or ts
        bad = re.search(r"mismatches (\d+)", line).group(1)
        bad += " (timing only)" if "not the GEMM" in line else ""
        print(f"{line.split(': mismatches')[0]}: {bad} bad; "
              f"ncu median {statistics.median(timed):.2f} us (n={len(timed)}, min {min(timed):.2f})")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
