"""Print the first collected pytest id of each test function in the files given (stdin: `pytest --co -q`
lines): one case a function, for runs that cannot afford every case (compute-sanitizer, session 45)."""
import sys

seen = {}
for line in sys.stdin:
    line = line.strip()
    if "::" in line:
        seen.setdefault(line.split("[")[0], line)
print("\n".join(seen.values()))
