"""Instruction counts of one kernel's SASS, offline (no GPU): where an issue-bound kernel spends
its instructions, and what a change that keeps the arithmetic saves.

    python csrc/cuda/sass_count.py row_attn_tcg NW=4 SPB=16 IL=False [--from 0x1ec0 --to 0x5d80] [--dump F]

The kernel is built as nvcc_check.py builds it (MLX's wrapper, the package's sources) from the
first nvcc_check case of that name with T = bf16 and D = 128, the template values given on the
command line replacing the case's, compiled with `nvcc -gencode arch=compute_90a,code=sm_90a -cubin` (the JIT's target) and disassembled by
cuobjdump (not in the CUDA toolkit this image has: `pip download --no-deps nvidia-cuda-cuobjdump`
and unzip it; CUOBJDUMP names the binary). Without --from / --to it prints the block barriers,
copy waits and backward branches with their addresses (a loop runs from a backward branch's
target to the branch), then the opcode counts of the address range [from, to).
Session 29: row_attn_tcg's span loop at D = 128, 4 warps, SPB 16 went ~1,070 -> ~680
instructions a warp (bench/gpu_attn_rows.py: 1k keys at one row 47.8 -> 32.9 us).
"""

import collections
import os
import re
import subprocess
import sys
import tempfile

sys.argv, _args = sys.argv[:1], sys.argv[1:]   # nvcc_check reads sys.argv only in main()
import nvcc_check as nc  # noqa: E402  (this folder is on sys.path when run as a script)

LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s*(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass(name: str, overrides: dict) -> str:
    base = next(c for c in nc.CASES if c[0] == name and str(c[1].get("T")).endswith("bfloat16")
                and c[1].get("D", 128) == 128)
    tmpl = dict(base[1])
    for k, v in overrides.items():
        tmpl[k] = v == "True" if v in ("True", "False") else int(v)
    tool = os.environ.get("CUOBJDUMP", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.cu"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(nc.standalone_source(name, tmpl, base[2], base[3]))
        subprocess.run(["nvcc", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-cubin", src, "-o", cubin], check=True)
        return subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout


def main():
    args = [a for a in _args if "=" in a and not a.startswith("-")]
    opts = dict(zip(_args, _args[1:] + [""]))    # "--from X" -> opts["--from"] = "X"
    text = sass(_args[0], dict(a.split("=", 1) for a in args))
    if "--dump" in opts:
        with open(opts["--dump"], "w") as f:
            f.write(text)
    rows = [(int(m.group(1), 16), m.group(3), m.group(4).strip())
            for m in map(LINE.match, text.splitlines()) if m]
    if "--from" not in opts:
        for addr, op, rest in rows:
            back = op == "BRA" and int(rest.split()[-1], 16) < addr
            if op.startswith(("BAR", "DEPBAR", "EXIT")) or back:
                print(f"{addr:#06x} {op} {rest}")
    lo, hi = int(opts.get("--from", "0"), 16), int(opts.get("--to", "0xffffffff"), 16)
    ops = collections.Counter(op.split(".")[0] for addr, op, _ in rows if lo <= addr < hi)
    print(sum(ops.values()), "instructions:", ", ".join(f"{k} {v}" for k, v in ops.most_common()))


if __name__ == "__main__":
    main()
