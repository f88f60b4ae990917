#!/usr/bin/env python
"""Plan-only runs of the command line at the paper's sizes: wall time and
peak resident memory of each, one at a time, each in its own process.

    .venv/bin/python experiments/dry_run.py [--out experiments/dry_run.json]

Each row runs ``scripts/run_schedule.py ... --dry-run -q`` as a subprocess
and reads its peak RSS from ``resource.getrusage(RUSAGE_CHILDREN)`` (the
largest child so far: rows are run from the lightest, so each row's figure
is its own, checked against /usr/bin/time -v where available) and the table
it printed. Targets: resnet152 under 60 s and 2 GB RSS; unet and
pspnet under 3 min and 4 GB.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: (label, arguments, time limit in s, RSS limit in bytes), lightest first.
ROWS = [
    ("resnet152 --budget 8G (batch 32)", ["--model", "resnet152", "--budget", "8G"], 60, 2e9),
    ("unet --budget least (batch 8, 572x572)", ["--model", "unet"], 180, 4e9),
    ("pspnet --budget least (batch 1, 713x713)", ["--model", "pspnet"], 180, 4e9),
]


def run_row(args: List[str]) -> Dict[str, Any]:
    """One dry run in a child process: seconds, peak RSS, its output."""
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "run_schedule.py")] + args + \
        ["--dry-run", "-q"]
    timed = os.path.exists("/usr/bin/time")
    if timed:
        cmd = ["/usr/bin/time", "-f", "MAXRSS_KB %M"] + cmd
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    m = re.search(r"MAXRSS_KB (\d+)", res.stderr)
    if m:
        rss = int(m.group(1)) * 1024
    return {"command": "chainer-recompute " + " ".join(args + ["--dry-run"]),
            "returncode": res.returncode, "wall_s": wall, "peak_rss_bytes": rss,
            "stdout": res.stdout, "stderr": res.stderr if res.returncode else ""}


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the rows as JSON")
    p.add_argument("--only", default=None, help="run the rows whose label contains this")
    a = p.parse_args(argv)
    rows = []
    print(f"{'run':<44} {'wall':>8} {'peak RSS':>10} {'target':>16}  ok")
    for label, args, t_lim, rss_lim in ROWS:
        if a.only and a.only not in label:
            continue
        r = run_row(args)
        ok = r["returncode"] == 0 and r["wall_s"] < t_lim and r["peak_rss_bytes"] < rss_lim
        r.update(label=label, ok=ok, time_limit_s=t_lim, rss_limit_bytes=rss_lim)
        rows.append(r)
        print(f"{label:<44} {r['wall_s']:>7.1f}s {r['peak_rss_bytes'] / 1e9:>8.2f}GB "
              f"{'< %ds, < %.0fGB' % (t_lim, rss_lim / 1e9):>16}  {'yes' if ok else 'NO'}",
              flush=True)
    for r in rows:
        print(f"\n$ {r['command']}\n{r['stdout']}{r['stderr']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"load_average": os.getloadavg(), "rows": rows}, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
