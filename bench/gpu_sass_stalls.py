"""Where a kernel's warps stall, per SASS instruction, from Nsight Compute's source page:

    ncu --section SourceCounters --import-source no -o rep python3 bench/gpu_gemm_prof.py ...
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python3 bench/gpu_sass_stalls.py rep.csv [--top 40]

Prints the instructions with the most warp-stall samples (address, SASS, samples, share, and
the largest stall reasons where the export has a column per reason), then the samples summed by
opcode. Column names are found by what they contain, not by position, since they move between
Nsight Compute versions."""

from __future__ import annotations

import argparse
import csv
import re
from collections import Counter


def _num(v: str) -> float:
    v = (v or "").replace(",", "").strip()
    try:
        return float(v)
    except ValueError:
        return 0.0


def read(path: str):
    """(header, rows) of the export's instruction table: the first row naming a Source column."""
    with open(path, newline="") as f:
        table = list(csv.reader(f))
    for i, row in enumerate(table):
        if any(c.strip() == "Source" for c in row):
            return row, [r for r in table[i + 1:] if len(r) == len(row)]
    raise SystemExit(f"{path}: no instruction table (no 'Source' column)")


def summarize(header, rows, top: int = 40) -> str:
    col = {name: i for i, name in enumerate(header)}
    src = col["Source"]
    addr = next((i for n, i in col.items() if "Address" in n), None)
    allc = next((i for n, i in col.items() if "Sampling" in n and "All" in n), None)
    if allc is None:
        allc = next(i for n, i in col.items() if "Sampling" in n)
    execd = next((i for n, i in col.items() if n.strip() == "Instructions Executed"), None)
    reasons = [(n, i) for n, i in col.items() if "stall" in n.lower() and "Sampling" not in n]
    total = sum(_num(r[allc]) for r in rows) or 1.0
    out = [f"{len(rows)} instructions, {total:.0f} stall samples", "",
           "| address | SASS | samples | share | executed | top reasons |", "|---|---|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: -_num(r[allc]))[:top]:
        rs = sorted(((n, _num(r[i])) for n, i in reasons), key=lambda t: -t[1])[:3]
        why = ", ".join(f"{n} {v:.0f}" for n, v in rs if v > 0)
        out.append(f"| {r[addr] if addr is not None else ''} | `{r[src].strip()}` | {_num(r[allc]):.0f} | "
                   f"{100 * _num(r[allc]) / total:.1f}% | {_num(r[execd]) if execd is not None else 0:.0f} | {why} |")
    by_op = Counter()
    for r in rows:
        op = re.sub(r"^@!?U?P\w+\s+", "", r[src].strip()).split(" ")[0]
        by_op[op.split(".")[0]] += _num(r[allc])
    out += ["", "| opcode | samples | share |", "|---|---:|---:|"]
    out += [f"| {op} | {v:.0f} | {100 * v / total:.1f}% |" for op, v in by_op.most_common(20)]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args(argv)
    header, rows = read(a.csv)
    print(summarize(header, rows, a.top))


if __name__ == "__main__":
    main()
