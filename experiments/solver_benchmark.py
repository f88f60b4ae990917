"""Solver benchmark: the exact and approximate DPs on the authors' graphs,
side by side with the authors' C++ solver when a build of it is given.

Usage (from the repository root):

    .venv/bin/python experiments/solver_benchmark.py [--authors-bin DIR]
        [--graphs DIR] [--names vgg19,resnet50,...] [--repeat N]

``--authors-bin DIR``: a directory holding ``exact`` and ``approx`` built
from the authors' ``mksch/`` sources (pfnet-research/recompute; see
experiments/solver_benchmark.md for where to get it and how to build it;
their code is never copied here). Both programs then run on the same graph
files and budgets, interleaved (ours, theirs, ours, ...), each solve in its
own process, and the table gives both times and their ratio. Without it,
our figures only.

Budgets, for every graph: each solver's least feasible budget (ours exact
to the byte; theirs by bisection on their binary, to 0.1%, starting from
ours), 1.25 x our least, and 8 GiB. Times: ours is the wall time of
loading the graph file and solving it (family, DP and plan) inside a
warm process (Python, NumPy and numba already imported, kernels compiled);
theirs is the wall time of their process. Peak RSS: each process's own.

Prints Markdown; experiments/solver_benchmark.md holds a run.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NAMES = ["vgg19", "resnet50", "unet", "densenet", "resnet152", "pspnet", "googlenet"]
GIB8 = 8 << 30


def _graphs_dir(args: argparse.Namespace) -> Path:
    if args.graphs:
        return Path(args.graphs)
    if args.authors_bin:
        for cand in (Path(args.authors_bin) / "computational_graphs",
                     Path(args.authors_bin).parent / "computational_graphs"):
            if cand.is_dir():
                return cand
    return ROOT.parent / "shared" / "graphs"


# ------------------------------------------------------------------ ours
def one(path: str, budget: int, solver: str, strategy: str) -> Dict:
    """Load and solve once in this process; the figures as a dict."""
    from chainer_recompute.core.io import load_authors_graph
    from chainer_recompute.core.planner import solve
    t0 = time.perf_counter()
    g = load_authors_graph(path)
    p = solve(g, budget, solver, strategy, raise_infeasible=False)
    dt = time.perf_counter() - t0
    return {"time_s": dt, "rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "feasible": p.feasible, "overhead": p.overhead,
            "peak_bytes": p.predicted_peak_bytes, "n_lower_sets": p.info.get("n_lower_sets")}


def warm_up() -> None:
    """Import everything and compile the kernels on a tiny graph."""
    from chainer_recompute.core.graph import Graph
    from chainer_recompute.core.planner import solve
    from chainer_recompute.core.solvers._dp import numba_available
    g = Graph.from_edges([4, 4, 4, 4], [(0, 1), (1, 2), (0, 2), (2, 3)])
    engines = ["numba"] if numba_available() else ["numpy"]
    for e in engines:
        for s in ("tc", "mc"):
            solve(g, 20, "exact", s, engine=e)
            solve(g, 1000, "exact", s, engine=e)
            solve(g, 20, "approx", s, engine=e)


def ours(path: Path, budget: int, solver: str, strategy: str) -> Dict:
    """One solve in a fresh, warmed-up process (its own time and RSS)."""
    code = ("import json, sys; sys.path.insert(0, %r); "
            "import experiments.solver_benchmark as b; b.warm_up(); "
            "print(json.dumps(b.one(%r, %d, %r, %r)))"
            % (str(ROOT), str(path), budget, solver, strategy))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=str(ROOT))
    return json.loads(out.stdout.strip().splitlines()[-1])


def our_least(path: Path, solver: str) -> int:
    from chainer_recompute.core.io import load_authors_graph
    from chainer_recompute.core.search import least_feasible_budget
    return least_feasible_budget(load_authors_graph(path), solver)


# ---------------------------------------------------------------- theirs
def theirs_rss(binary: Path, path: Path, budget: int, strategy: str,
               timeout_s: Optional[float] = None) -> Dict:
    """One run of the authors' solver: its wall time and own peak RSS. It
    runs in a scratch directory (it writes .dot files there), under
    /usr/bin/time when present (a child forked from this Python process
    would report this process's RSS as its own)."""
    with tempfile.TemporaryDirectory() as tmp, open(path, "rb") as fin:
        argv = [str(binary), "-b", str(budget)] + (["-t", "M"] if strategy == "mc" else [])
        timer = shutil.which("time") or ("/usr/bin/time" if Path("/usr/bin/time").exists()
                                          else None)
        rss_file = Path(tmp) / "rss.txt"
        if timer:
            argv = [timer, "-f", "%M", "-o", str(rss_file)] + argv
        out_path = Path(tmp) / "out.txt"
        with open(out_path, "wb") as fout:
            t0 = time.perf_counter()
            proc = subprocess.Popen(argv, stdin=fin, stdout=fout, stderr=subprocess.DEVNULL,
                                    cwd=tmp, start_new_session=True)
            timed_out = False
            while True:
                pid, _, ru = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if timeout_s is not None and time.perf_counter() - t0 > timeout_s:
                    os.killpg(proc.pid, 9)  # the timer and the solver
                    _, _, ru = os.wait4(proc.pid, 0)
                    timed_out = True
                    break
                time.sleep(0.002)
            dt = time.perf_counter() - t0
            proc.returncode = 0
        rss = ru.ru_maxrss * 1024
        words = rss_file.read_text().split() if timer and rss_file.exists() else []
        if words and words[-1].isdigit():
            rss = int(words[-1]) * 1024
        elif timer:
            rss = None
        feasible = b"IMPOSSIBLE" not in out_path.read_bytes()[:100]
    return {"time_s": dt, "rss_bytes": rss, "feasible": feasible, "timed_out": timed_out}


def their_least(binary: Path, path: Path, start: int, rel_tol: float = 1e-3) -> int:
    """Their least feasible budget by bisection on their binary, from ours
    (their sizes are divided by 10 or 100 and rounded down, so theirs can
    come out a little below ours; then ours is taken)."""
    if theirs_rss(binary, path, start, "tc")["feasible"]:
        return start
    lo, hi = start, int(start * 1.02)
    while not theirs_rss(binary, path, hi, "tc")["feasible"]:
        lo, hi = hi, int(hi * 1.1)
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) // 2
        if theirs_rss(binary, path, mid, "tc")["feasible"]:
            hi = mid
        else:
            lo = mid
    return hi


# ------------------------------------------------------------------ main
def gb(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / 1e9:.3f}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--authors-bin", help="directory with the authors' 'exact' and 'approx'")
    ap.add_argument("--graphs", help="directory of cg_<name>.txt files (default: the authors' "
                    "checkout next to --authors-bin, else ../shared/graphs)")
    ap.add_argument("--names", default=",".join(NAMES))
    ap.add_argument("--repeat", type=int, default=1, help="runs of each solve (the least kept)")
    ap.add_argument("--authors-least", help="JSON cache of their least budgets (read/written)")
    ap.add_argument("--authors-timeout", type=float, default=None,
                    help="stop one run of theirs after this many seconds (reported as '> T')")
    ap.add_argument("--skip-captured", action="store_true",
                    help="skip the approximate DP on experiments/graphs/*.json")
    args = ap.parse_args(argv)
    gdir = _graphs_dir(args)
    abin = Path(args.authors_bin) if args.authors_bin else None
    cache: Dict[str, int] = {}
    if args.authors_least and Path(args.authors_least).exists():
        cache = json.loads(Path(args.authors_least).read_text())
    warm_up()

    def best(fn, *a) -> Dict:
        runs = [fn(*a) for _ in range(max(1, args.repeat))]
        return min(runs, key=lambda r: r["time_s"])

    rows: List[Tuple] = []
    head = ("| graph | solver | strategy | budget | budget GB (ours / theirs) | ours s | "
            "theirs s | ratio | ours peak RSS GB | theirs peak RSS GB | ours overhead |")
    print(head)
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.names.split(","):
        path = gdir / f"cg_{name}.txt"
        if not path.exists():
            print(f"| {name} | missing {path} |", flush=True)
            continue
        for solver in ("exact", "approx"):
            least = our_least(path, solver)
            tbin = None if abin is None else abin / solver
            key = f"{name}/{solver}"
            if tbin is not None and key not in cache:
                cache[key] = their_least(tbin, path, least)
                if args.authors_least:
                    Path(args.authors_least).write_text(json.dumps(cache, indent=1))
            for label, b_ours in (("least", least), ("1.25 x least", int(least * 1.25)),
                                  ("8 GiB", GIB8)):
                b_theirs = cache.get(key, least) if label == "least" else b_ours
                for strategy in ("tc", "mc"):
                    o = best(ours, path, b_ours, solver, strategy)
                    t = None if tbin is None else best(theirs_rss, tbin, path, b_theirs,
                                                       strategy, args.authors_timeout)
                    ratio = "-" if t is None else f"{o['time_s'] / t['time_s']:.3f}"
                    t_s = "-" if t is None else f"{t['time_s']:.3f}"
                    if t is not None and t["timed_out"]:
                        ratio, t_s = f"< {ratio}", f"> {t['time_s']:.0f} (stopped)"
                    budgets = gb(b_ours) + ("" if t is None else f" / {gb(b_theirs)}")
                    ov = "infeasible" if not o["feasible"] else f"{o['overhead']:g}"
                    line = (f"| {name} | {solver} | {strategy} | {label} | {budgets} | "
                            f"{o['time_s']:.3f} | "
                            f"{t_s} | {ratio} | "
                            f"{o['rss_bytes'] / 1e9:.2f} | "
                            f"{'-' if t is None or t['rss_bytes'] is None else format(t['rss_bytes'] / 1e9, '.2f')} | "
                            f"{ov} |")
                    if t is not None and not t["feasible"] and not t["timed_out"]:
                        line += " (theirs: IMPOSSIBLE)"
                    print(line, flush=True)
    if not args.skip_captured:
        print()
        print("Graphs captured by this project (experiments/graphs/*.json), approximate DP, "
              "measured costs, one solve in a warm process:")
        print()
        print("| graph | #V | budget | tc s | mc s |")
        print("|---|---|---|---|---|")
        from chainer_recompute.core.io import load_graph
        from chainer_recompute.core.planner import solve
        from chainer_recompute.core.search import least_feasible_budget
        for p in sorted((ROOT / "experiments" / "graphs").glob("*.json")):
            g = load_graph(p).with_cost_model("measured")
            la = least_feasible_budget(g, "approx")
            for label, b in (("least", la), ("1.25 x least", int(la * 1.25)),
                             ("3 x least", 3 * la), ("8 GiB", GIB8)):
                ts = []
                for s in ("tc", "mc"):
                    t0 = time.perf_counter()
                    solve(g, b, "approx", s, raise_infeasible=False)
                    ts.append(time.perf_counter() - t0)
                print(f"| {p.stem} | {g.n} | {label} ({gb(b)} GB) | {ts[0]:.3f} | "
                      f"{ts[1]:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
