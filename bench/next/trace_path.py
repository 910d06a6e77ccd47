"""Here, on a Chrome trace from bench/profile_decode.py --trace: each GPU kernel's share of the
critical path (how far its end lies past the latest end before it: what it adds to the step
with dependent launches overlapping kernels), its busy time and the idle gap before it, by
kernel name and grid, per decode step (the trace's ten steps).

    python3 bench/next/trace_path.py trace-fp8.json
"""

import argparse
import collections
import json
import re
from pathlib import Path

STEPS = 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="a Chrome trace (profile_decode.py --trace)")
    trace = parser.parse_args().trace
    try:
        events = json.loads(trace.read_text())["traceEvents"]
    except (OSError, ValueError, KeyError) as exc:
        parser.error(f"{trace}: not a readable Chrome trace ({type(exc).__name__}: {exc})")
    kernels = sorted(
        (e for e in events if e.get("cat") == "kernel" and "dur" in e), key=lambda e: e["ts"]
    )
    if not kernels:
        parser.error(f"{trace}: no GPU kernels in it (profiled on a CUDA device?)")
    path: dict[str, float] = collections.defaultdict(float)
    busy: dict[str, float] = collections.defaultdict(float)
    gaps: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    first = prev_end = kernels[0]["ts"]
    for e in kernels:
        name = f"{re.sub(r'_[0-9]+$', '', e['name'])[:40]} {e.get('args', {}).get('grid')}"
        start, end = e["ts"], e["ts"] + e["dur"]
        gaps[name] += max(0.0, start - prev_end)
        path[name] += max(0.0, end - max(prev_end, start))
        busy[name] += e["dur"]
        count[name] += 1
        prev_end = max(prev_end, end)
    print(f"span {(prev_end - first) / STEPS:.1f} us a step, idle {sum(gaps.values()) / STEPS:.1f}")
    print(
        f"{'kernel grid':58s} {'a step':>6s} {'path/call':>9s} {'busy/call':>9s} {'gap/call':>8s}"
    )
    for name, share in sorted(path.items(), key=lambda kv: -kv[1])[:16]:
        n = count[name]
        print(f"{name:58s} {n / STEPS:6.1f} {share / n:9.2f} {busy[name] / n:9.2f} "
              f"{gaps[name] / n:8.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
