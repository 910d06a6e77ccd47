"""From bench/int4_rows.py's output: KVFLEET_INT4_ROWS for the layers where a rows tiling beat
the shipped kernel by at least 3% (the A/B of call 101 runs with it)."""
import re
import sys

SHAPES = {"qkv": "6144x4096", "o": "4096x4096", "gate_up": "28672x4096", "down": "4096x14336"}
picks = []
for line in open(sys.argv[1]):
    name = line.split()[0] if line.strip() else ""
    if name not in SHAPES:
        continue
    shipped = float(re.search(r"shipped\s+([\d.]+)", line).group(1))
    best = min((float(us), tiles) for tiles, us in re.findall(r"\| (\d+/\d+/\d+(?:/\d+)?)\s+([\d.]+)", line))
    if best[0] < 0.97 * shipped:
        picks.append(f"{SHAPES[name]}={best[1].replace('/', ',')}")
print(";".join(picks))
