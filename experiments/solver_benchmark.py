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
import threading
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
TINY_AUTHORS = """4 3
0 100 0
1 400 _
2 400 _
3 4 _
forward
1 1
0 input
1
Convolution2DFunction
{"_input_indexes_to_retain": [0], "_output_indexes_to_retain": null}
forward
1 1
1 input
2
ReLU
{"_input_indexes_to_retain": null, "_output_indexes_to_retain": [0]}
forward
1 1
2 input
3
Sum
{"_input_indexes_to_retain": null, "_output_indexes_to_retain": null}
"""


def peak_rss_bytes() -> int:
    """This process's own peak RSS (VmHWM: its address space's high-water
    mark, not the parent's it was forked from)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def one(path: str, budget: int, solver: str, strategy: str) -> Dict:
    """Load and solve once in this process; the figures as a dict."""
    from chainer_recompute.core.io import load_authors_graph
    from chainer_recompute.core.planner import solve
    t0 = time.perf_counter()
    g = load_authors_graph(path)
    p = solve(g, budget, solver, strategy, raise_infeasible=False)
    dt = time.perf_counter() - t0
    return {"time_s": dt, "rss_bytes": peak_rss_bytes(),
            "feasible": p.feasible, "overhead": p.overhead,
            "peak_bytes": p.predicted_peak_bytes, "n_lower_sets": p.info.get("n_lower_sets")}


def warm_up() -> None:
    """Import everything, load the compiled kernels and run every step of a
    solve (reading an authors' file included) on a tiny graph, so that the
    measured solve pays none of the one-time costs of a process."""
    from chainer_recompute.core.io import load_authors_graph
    from chainer_recompute.core.planner import solve
    from chainer_recompute.core.solvers._dp import numba_available
    with tempfile.TemporaryDirectory() as tmp:
        tiny = Path(tmp) / "cg_tiny.txt"
        tiny.write_text(TINY_AUTHORS)
        g = load_authors_graph(tiny)
    engines = ["numba"] if numba_available() else ["numpy"]
    for e in engines:
        for s in ("tc", "mc"):
            for solver in ("exact", "approx"):
                for b in (1000, 1400, 10_000):
                    solve(g, b, solver, s, engine=e, raise_infeasible=False)


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
    """Our least feasible budget (in a child process, so that this one
    stays small: a child's peak RSS can include its parent's)."""
    code = ("import sys; sys.path.insert(0, %r); "
            "from chainer_recompute.core.io import load_authors_graph; "
            "from chainer_recompute.core.search import least_feasible_budget; "
            "print(least_feasible_budget(load_authors_graph(%r), %r))"
            % (str(ROOT), str(path), solver))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=str(ROOT))
    return int(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- theirs
def _spawn_wait(argv: List[str], stdin_path: Path, stdout_path: Path, cwd: str,
                timeout_s: Optional[float]) -> Tuple[float, bool, object]:
    """Start ``argv`` (posix_spawn: no shell, no Python in between) and
    wait for it; its wall time, whether it was stopped at ``timeout_s``,
    and its rusage."""
    fi = os.open(stdin_path, os.O_RDONLY)
    fo = os.open(stdout_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    fe = os.open(os.devnull, os.O_WRONLY)
    here = os.getcwd()
    try:
        os.chdir(cwd)  # the child starts here (they write .dot files)
        t0 = time.perf_counter()
        pid = os.posix_spawn(argv[0], argv, os.environ, setpgroup=0, file_actions=[
            (os.POSIX_SPAWN_DUP2, fi, 0), (os.POSIX_SPAWN_DUP2, fo, 1),
            (os.POSIX_SPAWN_DUP2, fe, 2)])
    finally:
        os.chdir(here)
        for fd in (fi, fo, fe):
            os.close(fd)
    stopped = []
    timer = None
    if timeout_s is not None:
        def stop() -> None:
            stopped.append(True)
            try:
                os.killpg(pid, 9)  # the solver (and /usr/bin/time's child)
            except ProcessLookupError:
                pass
        timer = threading.Timer(timeout_s, stop)
        timer.start()
    _, _, ru = os.wait4(pid, 0)
    dt = time.perf_counter() - t0
    if timer is not None:
        timer.cancel()
    return dt, bool(stopped), ru


def theirs_rss(binary: Path, path: Path, budget: int, strategy: str,
               timeout_s: Optional[float] = None, repeat: int = 1) -> Dict:
    """Runs of the authors' solver: its wall time (the least of ``repeat``
    runs started directly, from exec to exit: reading the file, their DP,
    writing their outputs) and its own peak RSS (one run under
    /usr/bin/time: a child started from this Python process would report
    this process's RSS as its own). They run in a scratch directory (they
    write .dot files there)."""
    argv = [str(binary), "-b", str(budget)] + (["-t", "M"] if strategy == "mc" else [])
    timer = shutil.which("time") or ("/usr/bin/time" if Path("/usr/bin/time").exists()
                                      else None)
    with tempfile.TemporaryDirectory() as tmp:
        rss_file = Path(tmp) / "rss.txt"
        out_path = Path(tmp) / "out.txt"
        rss = None
        times = []
        timed_out = False
        if timer:
            dt, stopped, _ = _spawn_wait([timer, "-f", "%M", "-o", str(rss_file)] + argv,
                                         path, out_path, tmp, timeout_s)
            words = rss_file.read_text().split() if rss_file.exists() else []
            if words and words[-1].isdigit() and not stopped:
                rss = int(words[-1]) * 1024
            if dt > 30 or stopped or repeat == 0:  # the wrapper's milliseconds do not matter
                times.append(dt)
                timed_out = stopped
                repeat = 0
        else:
            repeat = max(1, repeat)
        for _ in range(repeat):
            dt, stopped, ru = _spawn_wait(argv, path, out_path, tmp, timeout_s)
            times.append(dt)
            timed_out = timed_out or stopped
            if stopped:
                break
        feasible = b"IMPOSSIBLE" not in out_path.read_bytes()[:100]
    return {"time_s": min(times), "rss_bytes": rss, "feasible": feasible,
            "timed_out": timed_out}


def their_startup(binary: Path, repeat: int = 20) -> float:
    """The least wall time of their program on an empty input (it exits at
    once): process start-up, which their times include."""
    with tempfile.TemporaryDirectory() as tmp:
        return min(_spawn_wait([str(binary), "-b", "1"], Path(os.devnull), Path(tmp) / "o",
                               tmp, 10)[0] for _ in range(repeat))


def their_least(binary: Path, path: Path, start: int, rel_tol: float = 1e-3) -> int:
    """Their least feasible budget by bisection on their binary, from ours
    (their sizes are divided by 10 or 100 and rounded down, so theirs can
    come out a little below ours; then ours is taken)."""
    def ok(b: int) -> bool:
        return theirs_rss(binary, path, b, "tc", repeat=0)["feasible"]

    if ok(start):
        return start
    lo, hi = start, int(start * 1.02)
    while not ok(hi):
        lo, hi = hi, int(hi * 1.1)
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


# ------------------------------------------------------------ first solve
FIRST = ("import time; t0 = time.perf_counter(); import sys; sys.path.insert(0, %r); "
         "import chainer_recompute; from chainer_recompute.core.io import load_authors_graph; "
         "from chainer_recompute.core.planner import solve; t1 = time.perf_counter(); "
         "g = load_authors_graph(%r); t2 = time.perf_counter(); "
         "p = solve(g, %r, %r, 'tc', engine=%r); t3 = time.perf_counter(); "
         "print(t1 - t0, t3 - t2, 'numba' in sys.modules)")


def first_solve(path: Path, budget: str, solver: str, engine: str,
                cache_dir: Optional[str]) -> Tuple[float, float, bool]:
    """A fresh process: import time, then the first solve's time (graph
    read excluded) and whether numba got imported. ``cache_dir``: numba's
    cache directory (an empty one makes it compile)."""
    env = dict(os.environ)
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    out = subprocess.run([sys.executable, "-c", FIRST % (str(ROOT), str(path), budget, solver,
                                                         engine)],
                         capture_output=True, text=True, check=True, cwd=str(ROOT), env=env)
    a, b, c = out.stdout.split()
    return float(a), float(b), c == "True"


def first_solve_table(gdir: Path) -> None:
    """Fresh processes, no warm-up: what a user's first plan costs, by
    engine, with numba's on-disk cache warm and with an empty one."""
    print("First plan in a fresh process (import chainer_recompute, then one solve at "
          "8 GiB, tc; the graph's reading excluded; least of 3):")
    print()
    print("| graph | solver | engine | numba cache | import s | first solve s | numba imported |")
    print("|---|---|---|---|---|---|---|")
    for name, solver in (("vgg19", "exact"), ("unet", "exact"), ("resnet50", "exact"),
                         ("pspnet", "approx"), ("googlenet", "exact")):
        path = gdir / f"cg_{name}.txt"
        if not path.exists():
            continue
        for engine, cache in (("numpy", "warm"), ("auto", "warm"), ("numba", "warm"),
                              ("numba", "empty")):
            runs = []
            for _ in range(3):
                if cache == "empty":
                    with tempfile.TemporaryDirectory() as tmp:
                        runs.append(first_solve(path, "8GiB", solver, engine, tmp))
                else:
                    runs.append(first_solve(path, "8GiB", solver, engine, None))
            imp = min(r[0] for r in runs)
            sol = min(r[1] for r in runs)
            print(f"| {name} | {solver} | {engine} | {cache} | {imp:.3f} | {sol:.3f} | "
                  f"{'yes' if runs[0][2] else 'no'} |", flush=True)


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
    ap.add_argument("--solvers", default="exact,approx", help="the solvers' rows to run")
    ap.add_argument("--budgets", default="least,1.25x,8GiB",
                    help="the budgets' rows to run (of least, 1.25x, 8GiB)")
    ap.add_argument("--strategies", default="tc,mc", help="the strategies' rows to run")
    ap.add_argument("--authors-least", help="JSON cache of their least budgets (read/written)")
    ap.add_argument("--authors-timeout", type=float, default=None,
                    help="stop one run of theirs after this many seconds (reported as '> T')")
    ap.add_argument("--skip-captured", action="store_true",
                    help="skip the approximate DP on experiments/graphs/*.json")
    ap.add_argument("--first-solve", action="store_true",
                    help="also time a user's first plan in a fresh process (imports, the "
                         "compiled kernels from numba's cache or compiled anew)")
    args = ap.parse_args(argv)
    gdir = _graphs_dir(args)
    want_budgets = args.budgets.split(",")
    abin = Path(args.authors_bin) if args.authors_bin else None
    cache: Dict[str, int] = {}
    if args.authors_least and Path(args.authors_least).exists():
        cache = json.loads(Path(args.authors_least).read_text())
    if abin is not None:
        print(f"Their program's start-up (an empty input, least of 20 runs): "
              f"{1e3 * their_startup(abin / 'exact'):.1f} ms (included in their times).")
        print()
    head = ("| graph | solver | strategy | budget | budget GB (ours / theirs) | ours s | "
            "theirs s | ratio | ours peak RSS GB | theirs peak RSS GB | ours overhead |")
    print(head)
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.names.split(","):
        path = gdir / f"cg_{name}.txt"
        if not path.exists():
            print(f"| {name} | missing {path} |", flush=True)
            continue
        load_before = os.getloadavg()
        for solver in args.solvers.split(","):
            least = our_least(path, solver)
            tbin = None if abin is None else abin / solver
            key = f"{name}/{solver}"
            if tbin is not None and key not in cache:
                cache[key] = their_least(tbin, path, least)
                if args.authors_least:
                    Path(args.authors_least).write_text(json.dumps(cache, indent=1))
            for label, b_ours in (("least", least), ("1.25 x least", int(least * 1.25)),
                                  ("8 GiB", GIB8)):
                if label.replace(" x least", "x").replace(" ", "") not in want_budgets:
                    continue
                b_theirs = cache.get(key, least) if label == "least" else b_ours
                for strategy in args.strategies.split(","):
                    # Interleaved: ours, theirs, ours, theirs, ...; the least
                    # time of each (theirs once when it takes over 30 s).
                    o_runs, t_runs = [], []
                    for rep in range(max(1, args.repeat)):
                        o_runs.append(ours(path, b_ours, solver, strategy))
                        if tbin is not None and (not t_runs or t_runs[0]["time_s"] < 30):
                            t_runs.append(theirs_rss(tbin, path, b_theirs, strategy,
                                                     args.authors_timeout))
                    o = min(o_runs, key=lambda r: r["time_s"])
                    t = None if tbin is None else min(t_runs, key=lambda r: r["time_s"])
                    if t is not None:
                        rss = [r["rss_bytes"] for r in t_runs if r["rss_bytes"] is not None]
                        t = dict(t, rss_bytes=max(rss) if rss else None,
                                 timed_out=any(r["timed_out"] for r in t_runs))
                    ratio = "-" if t is None else f"{o['time_s'] / t['time_s']:.3f}"
                    t_s = "-" if t is None else f"{t['time_s']:.4f}"
                    if t is not None and t["timed_out"]:
                        ratio, t_s = f"< {ratio}", f"> {t['time_s']:.0f} (stopped)"
                    budgets = gb(b_ours) + ("" if t is None else f" / {gb(b_theirs)}")
                    ov = "infeasible" if not o["feasible"] else f"{o['overhead']:g}"
                    o_rss = max(r["rss_bytes"] for r in o_runs)
                    line = (f"| {name} | {solver} | {strategy} | {label} | {budgets} | "
                            f"{o['time_s']:.4f} | "
                            f"{t_s} | {ratio} | "
                            f"{o_rss / 1e9:.2f} | "
                            f"{'-' if t is None or t['rss_bytes'] is None else format(t['rss_bytes'] / 1e9, '.2f')} | "
                            f"{ov} |")
                    if t is not None and not t["feasible"] and not t["timed_out"]:
                        line += " (theirs: IMPOSSIBLE)"
                    print(line, flush=True)
        load_after = os.getloadavg()
        print(f"| {name} | load average {load_before[0]:.1f} before, {load_after[0]:.1f} "
              f"after | | | | | | | | | |", flush=True)
    if args.first_solve:
        print()
        first_solve_table(gdir)
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
