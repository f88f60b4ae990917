#!/usr/bin/env python
"""The paper's headline table at the paper's batch and input sizes, its
solver rows on the authors' graphs and ours, and the poster's runtime plots
Long-running and resumable; every finished cell is a JSON file
under experiments/results/ at once.

    # where results go: --out DIR, or a new scratch folder (said on stderr);
    # the committed experiments/results/ and experiments/README.md are
    # written only with --update-committed
    # the table: 7 networks x {vanilla, Chen, approx TC/MC, exact TC/MC}
    .venv/bin/python experiments/reproduce.py --config configs/paper.json [--networks a,b] [--resume] --out DIR
    # one cell (always re-run; overwrites its JSON in DIR), or one row
    .venv/bin/python experiments/reproduce.py --cell resnet50:approx-tc --out DIR
    .venv/bin/python experiments/reproduce.py --networks resnet50 --out DIR
    # the time estimate from small-batch runs (vanilla and approx-TC per network)
    .venv/bin/python experiments/reproduce.py --estimate
    # the solver rows: authors' graphs and our captured graphs (pure core)
    .venv/bin/python experiments/reproduce.py --solvers [--resume]
    # the runtime sweep and plots (ResNet152, DenseNet161)
    .venv/bin/python experiments/reproduce.py --sweep resnet152 [--resume]
    .venv/bin/python experiments/reproduce.py --plots
    # the Markdown tables of experiments/README.md, from the JSON files
    # (printed and written to DIR/tables.md; experiments/README.md itself
    # only with --update-committed)
    .venv/bin/python experiments/reproduce.py --report [--out DIR | --update-committed]

Measurement protocol (as experiments/memory_model.py): each cell
runs in a process of its own; tracemalloc (restricted to NumPy's domain,
``MemoryMeter``) starts before anything of the model exists, so the
measured peak is every NumPy array of the iteration: parameters, their
gradients, optimizer state, inputs, activations, temporaries (im2col). A
training loop like Chainer's StandardUpdater, ``optimizer.update(link, x,
t)``; one warm-up call, then the measured one(s): with recomputation the
warm-up is the call that records the graph (plain Chainer); the plan is
made after it (timed apart) and the next call, the first under the plan, is
measured (a re-plan after an over-budget measurement adds calls until the
plan is steady); vanilla: its first iteration is the warm-up. ``budget='least'`` in the
total scope for the DPs (the least peak each reaches, as the paper's
table); Chen et al.'s plan ignores budgets (it is solved in the paper's
scope, ``budget_scope='activations'``, which returns Chen's plan as is).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

# REPRO_ROOT: the repository, when this file runs from a frozen copy (long
# runs copy it so that edits to the working tree do not reach their workers)
ROOT = Path(os.environ.get("REPRO_ROOT") or Path(__file__).resolve().parents[1]).resolve()
HERE = ROOT / "experiments"
sys.path.insert(0, str(ROOT))

#: the committed results: written only with --update-committed
COMMITTED = HERE / "results"
#: where this run reads and writes its results (main() sets it: --out, a
#: scratch folder, or COMMITTED with --update-committed)
RESULTS = COMMITTED
#: where --report's tables.md and --plots' PNGs go (None: RESULTS, and the
#: PNGs beside experiments/README.md when RESULTS is COMMITTED)
WRITE_TO: Optional[Path] = None
#: the flags that name this run's config and results folder, as a command
#: that reproduces a cell types them (main() sets it)
RUN_FLAGS: List[str] = []
#: seconds between "still running" lines of a cell
PROGRESS_EVERY_S = 30.0
METHODS = ["vanilla", "approx-tc", "approx-mc", "chen", "exact-tc", "exact-mc"]
#: method -> apply() options
APPLY = {
    "approx-tc": dict(solver="approx", strategy="tc", budget_scope="total"),
    "approx-mc": dict(solver="approx", strategy="mc", budget_scope="total"),
    "exact-tc": dict(solver="exact", strategy="tc", budget_scope="total"),
    "exact-mc": dict(solver="exact", strategy="mc", budget_scope="total"),
    "chen": dict(solver="chen", strategy="tc", budget_scope="activations"),
    # solver auto: below the single-level least, a nested plan (docs/algorithm.md §9)
    "nested-tc": dict(solver="auto", strategy="tc", budget_scope="total"),
    # the convolutions' column buffers built in one copy where the
    # planner finds it pays (bit-identical; runtime/workspace.py)
    "approx-tc-ws": dict(solver="approx", strategy="tc", budget_scope="total",
                         workspace="auto"),
    # the same, planned from a separate capture at batch 1, scaled: no plain
    # iteration at the full batch (U-Net's is 20.7 GB)
    "approx-tc-ws-cb1": dict(solver="approx", strategy="tc", budget_scope="total",
                             workspace="auto", capture_batch=1),
    # chunked as well (workspace_exact=False): equal to rounding only
    "approx-tc-wsc": dict(solver="approx", strategy="tc", budget_scope="total",
                          workspace="auto", workspace_exact=False),
    # chunked, planned from a separate capture at batch 2, scaled (VGG19 at
    # batch 32 without its 12.3 GB plain iteration)
    "approx-tc-wsc-cb2": dict(solver="approx", strategy="tc", budget_scope="total",
                              workspace="auto", workspace_exact=False, capture_batch=2),
    "approx-tc-wsc-cb1": dict(solver="approx", strategy="tc", budget_scope="total",
                              workspace="auto", workspace_exact=False, capture_batch=1),
    # chunked at a fixed bound of 8 MiB (every large call in chunks)
    "approx-tc-wsc-8m": dict(solver="approx", strategy="tc", budget_scope="total",
                             workspace="8M", workspace_exact=False),
}


def _solver_of(method: str) -> Tuple[str, str]:
    """The solver and strategy a DP method plans with (``nested-tc``:
    ``auto``, which nests below the single-level least)."""
    opts = APPLY.get(method)
    if opts is not None:
        return opts["solver"], opts["strategy"]
    solver, strategy = method.split("-")[:2]
    return solver, strategy


def load_config(path: Optional[str]) -> Dict[str, Any]:
    with open(path or ROOT / "configs" / "paper.json") as f:
        return json.load(f)


def _meminfo(key: str) -> int:
    """A field of /proc/meminfo (``MemAvailable``, ``MemTotal``), bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def mem_available() -> int:
    return _meminfo("MemAvailable")


def mem_total() -> int:
    return _meminfo("MemTotal")


def load_avg() -> List[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> Dict[str, Any]:
    import platform
    import numpy
    info = {"cpus": os.cpu_count(), "python": platform.python_version(),
            "numpy": numpy.__version__, "platform": platform.platform()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_total_bytes"] = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    return info


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def read_json(path: Path) -> Optional[Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# ======================================================================
# One cell: a process of its own.

def step(what: str) -> None:
    """What a cell's worker is doing now, for the orchestrator's progress
    lines (a ``STEP`` line on stderr)."""
    print(f"STEP {what}", file=sys.stderr, flush=True)


def worker(net: str, method: str, batch: int, *, measured: int, optimizer: str, cost: str,
           save_graph: Optional[str], small: bool = False,
           budget: Any = "least") -> Dict[str, Any]:
    from chainer_recompute.runtime.memory import MemoryMeter
    outer = MemoryMeter()
    outer.start()  # before anything of the model exists
    t_start = time.perf_counter()
    import numpy
    import chainer
    import chainer_recompute as cr
    from chainer_recompute.models import get_model
    from chainer_recompute.runtime.capture import state_bytes

    step(f"building {net} at batch {batch}")
    numpy.random.seed(0)
    spec = get_model(net, batch_size=batch, small=small)
    link = spec.link
    x, t = spec.make_inputs(batch, seed=0)
    if method != "vanilla":
        opts = dict(APPLY[method])
        knobs = {k: opts.pop(k) for k in list(opts) if k in cr.Tuning.fields()}
        b = "least" if method == "chen" or budget == "least" else int(budget)
        cr.apply(link, budget=b, verbose=False, tuning=cr.Tuning(cost=cost, **knobs), **opts)
    opt = getattr(chainer.optimizers, optimizer)()
    opt.setup(link)
    # one warm-up call: vanilla's first iteration; with recomputation the
    # recording call (plain Chainer, the graph recorded); the plan is made
    # between it and the first measured call, outside the timing
    warm = 1
    calls: List[Dict[str, Any]] = []
    runner = cr.runner_of(link)
    n_calls = warm + measured
    extra = 0
    i = 0
    while i < n_calls:
        gc.collect()
        if runner is not None and i == 1:
            step("planning")
            try:  # plan now (the planning call), so that an infeasible budget is told
                runner.plan_for(link, x, t)
            except cr.InfeasibleBudgetError as e:
                return {"network": net, "method": method, "batch": batch, "small": small,
                        "status": "infeasible", "budget": budget, "error": str(e),
                        "least_feasible_bytes": e.least_feasible_bytes, "calls": calls}
        structure = None
        if runner is not None:
            entry = next(iter(runner.entries.values()), None)
            structure = entry.structures[0] if entry and entry.structures else None
        step(f"call {i + 1} of {n_calls} ({'warm-up' if i < warm else 'measured'})")
        with MemoryMeter() as m:
            t0 = time.perf_counter()
            opt.update(link, x, t)
            dt = time.perf_counter() - t0
        c = {"time_s": dt, "peak_bytes": m.result.absolute_peak_bytes,
             "load": load_avg()}
        if runner is not None:
            st = runner.last_stats
            entry = next(iter(runner.entries.values()))
            now = entry.structures[0] if entry.structures else None
            c.update(path=st.path, recomputed_nodes=st.recomputed_nodes,
                     runtime_measured_bytes=st.measured_peak_bytes,
                     replanned=bool(i >= warm - 1 and structure is not None
                                    and now is not structure))
            # a re-plan after an over-budget measurement: the
            # iteration it happened in is not a steady one; one more call
            if c["replanned"] and extra < 2:
                n_calls += 1
                extra += 1
        calls.append(c)
        i += 1
    steady = [c for c in calls[warm + extra:]] or calls[-1:]
    out: Dict[str, Any] = {
        "network": net, "method": method, "batch": batch, "small": small, "budget": budget,
        "input": list(spec.input_shape), "optimizer": optimizer, "cost": cost,
        "measured_peak_bytes": max(c["peak_bytes"] for c in steady),
        "time_s": sum(c["time_s"] for c in steady) / len(steady),
        "calls": calls, "state_bytes": state_bytes(link),
        "process_s": time.perf_counter() - t_start, "status": "ok"}
    if runner is not None:
        from chainer_recompute.core.replay import replay
        entry = next(iter(runner.entries.values()))
        s = entry.structures[0]
        plan, g = s.plan, s.graph
        rp = replay(g, s.program if plan.recompute else None,
                    **({"release_mode": s.program.release_mode} if plan.recompute else {}))
        van = replay(g, None)
        out.update(
            n_nodes=g.n, activation_bytes=int(g.activation_bytes),
            param_bytes=int(g.param_bytes),
            plan={"recompute": plan.recompute, "n_blocks": plan.n_blocks,
                  "overhead_fraction": plan.overhead_fraction,
                  "predicted_peak_bytes": plan.predicted_peak_bytes,
                  "budget_bytes": plan.budget_bytes, "solve_time_s": plan.solve_time_s,
                  "planning_time_s": s.planning_time_s,
                  "n_dropped": len(s.program.dropped),
                  "release_mode": s.program.release_mode,
                  "info": {k: v for k, v in plan.info.items()
                           if isinstance(v, (int, float, str, bool, type(None)))}},
            replay={"peak_bytes": rp.peak_bytes, "recomputed": rp.recomputed,
                    **peak_parts(g, rp)},
            vanilla_replay={"peak_bytes": van.peak_bytes, **peak_parts(g, van)},
            predicted_peak_bytes=rp.peak_bytes,
            structures=len(entry.structures),
            workspace_bytes=g.step.workspace_bytes,
            workspace_calls=sum(1 for n in g.nodes if n.attrs.get("workspace_chunks")))
        if save_graph:
            Path(save_graph).parent.mkdir(parents=True, exist_ok=True)
            cr.save_graph(g, save_graph)
            out["graph_file"] = os.path.relpath(save_graph, ROOT)
    return out


# ======================================================================
# The orchestrator.

def cell_path(net: str, method: str, batch: int, tag: str = "") -> Path:
    return RESULTS / "cells" / f"{net}_b{batch}{tag}__{method}.json"


def graph_path(net: str, batch: int, tag: str = "") -> Path:
    return RESULTS / "graphs" / f"{net}_b{batch}{tag}.json"


def run_cell(net: str, method: str, batch: int, cfg: Dict[str, Any], *, tag: str = "",
             small: bool = False, timeout_s: Optional[float] = None,
             save_graph: bool = True, budget: Any = "least", out: Optional[Path] = None,
             graph_out: Optional[Path] = None,
             measured: Optional[int] = None) -> Dict[str, Any]:
    """Run one cell in a subprocess; its JSON (or the error) is written at once."""
    proto = cfg["protocol"]
    small = small or bool(cfg["networks"].get(net, {}).get("small"))
    gpath = graph_out or graph_path(net, batch, tag)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", net, method,
           "--batch", str(batch),
           "--measured", str(measured or proto["measured_iterations"]),
           "--optimizer", proto["optimizer"], "--cost", proto["cost"],
           "--budget", str(budget)]
    if small:
        cmd.append("--small")
    if save_graph and method != "vanilla" and (method == "approx-tc" or not gpath.exists()):
        cmd += ["--save-graph", str(gpath)]
    env = dict(os.environ)
    t0 = time.time()
    load0 = load_avg()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=str(ROOT), start_new_session=True)
    stdout, stderr, timed_out = _follow(proc, f"{net}:{method}", timeout_s)
    wall = time.time() - t0
    lines = [ln for ln in stdout.splitlines() if ln.startswith("CELL ")]
    out_path = out
    if proc.returncode == 0 and lines:
        out = json.loads(lines[-1][5:])
    else:
        tail = [ln for ln in (stderr or "").strip().splitlines()
                if not ln.startswith("STEP ")][-5:]
        out = {"network": net, "method": method, "batch": batch, "small": small,
               "status": "timeout" if timed_out else "error", "returncode": proc.returncode,
               "error": " | ".join(tail)}
    out.update(wall_s=wall, load_start=load0, load_end=load_avg(),
               finished=time.strftime("%Y-%m-%d %H:%M:%S"),
               command=cell_command(net, method, batch, budget))
    if out.get("status") == "ok" and budget != "least":
        out["fits_budget"] = out["measured_peak_bytes"] <= int(budget)
    write_json(out_path or cell_path(net, method, batch, tag), out)
    return out


def cell_command(net: str, method: str, batch: int, budget: Any = "least") -> str:
    """The command that reproduces one cell, every flag spelled out."""
    return " ".join([".venv/bin/python", "experiments/reproduce.py", "--cell",
                     f"{net}:{method}", "--batch", str(batch), "--budget", str(budget)]
                    + RUN_FLAGS)


def _follow(proc: "subprocess.Popen[str]", label: str, timeout_s: Optional[float]
            ) -> Tuple[str, str, bool]:
    """Wait for a cell's process, printing (on stderr) what it is doing
    when that changes and every PROGRESS_EVERY_S seconds, with the time
    elapsed; kill it after ``timeout_s``. Returns stdout, stderr and
    whether it timed out."""
    import threading
    out: List[str] = []
    err: List[str] = []
    now = {"step": "starting"}

    def read_err() -> None:
        for ln in proc.stderr:  # type: ignore[union-attr]
            err.append(ln)
            if ln.startswith("STEP "):
                now["step"] = ln[5:].strip()

    def read_out() -> None:
        out.append(proc.stdout.read())  # type: ignore[union-attr]

    threads = [threading.Thread(target=read_err, daemon=True),
               threading.Thread(target=read_out, daemon=True)]
    for th in threads:
        th.start()
    t0 = time.time()
    said, said_at = None, t0
    timed_out = False
    while proc.poll() is None:
        time.sleep(min(0.5, PROGRESS_EVERY_S))
        elapsed = time.time() - t0
        if timeout_s is not None and elapsed > timeout_s:
            os.killpg(proc.pid, signal.SIGKILL)
            timed_out = True
            break
        if now["step"] != said or time.time() - said_at >= PROGRESS_EVERY_S:
            print(f"  [{label}] {now['step']}, {fmt_s(elapsed)} elapsed (load "
                  f"{load_avg()[0]})", file=sys.stderr, flush=True)
            said, said_at = now["step"], time.time()
    proc.wait()
    for th in threads:
        th.join(timeout=10)
    return "".join(out), "".join(err), timed_out


def _paper_batch(net: str) -> Optional[int]:
    return load_config(None)["networks"].get(net, {}).get("paper_batch")


def fmt_s(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{(s % 3600) // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def estimate_cell_s(net: str, method: str, cfg: Dict[str, Any]) -> float:
    """Seconds a cell should take: from the finished cells of this network
    at the paper's batch, else from the small-batch estimate."""
    ncfg = cfg["networks"][net]
    batch = ncfg["paper_batch"]
    measured = cfg["protocol"]["measured_iterations"]
    iters = 1 + measured
    done = [read_json(cell_path(net, m, batch))
            or read_json(COMMITTED / "cells" / cell_path(net, m, batch).name) for m in METHODS]
    done = [d for d in done if d and d.get("status") == "ok"]
    it = None
    if done:
        it = sum(d["time_s"] for d in done) / len(done)
    else:
        est = read_json(RESULTS / "estimate.json") or {}
        e = est.get(net)
        if e:
            it = e["per_sample_s"] * batch
    if it is None:
        it = 60.0
    record = 0.6 * it if method != "vanilla" else 0.0  # the recording call is slower
    plan = 0.0
    if method.startswith("exact"):
        chk = read_json(RESULTS / "cells" / f"{net}_b{batch}__exact-check.json") or {}
        plan = chk.get(method.split("-")[1] + "_s", 0.0)
    return record + iters * it + plan + 20


def exact_check(net: str, batch: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Whether the exact DP finds the least total budget on the recorded
    graph within the time limit, for tc and mc (each in a process with a
    timeout); written to cells/<net>_b<batch>__exact-check.json."""
    limit = cfg["protocol"]["exact_timeout_s"]
    gpath = graph_path(net, batch)
    out: Dict[str, Any] = {"network": net, "batch": batch, "limit_s": limit,
                           "graph_file": os.path.relpath(gpath, ROOT)}
    for strategy in ("tc", "mc"):
        r = call_with_timeout("exact_least_total", [str(gpath), strategy], limit)
        out[strategy] = r
        out[f"{strategy}_s"] = r.get("wall_s", limit)
    out["ok"] = all(out[s].get("status") == "ok" for s in ("tc", "mc"))
    out["load"] = load_avg()
    write_json(RESULTS / "cells" / f"{net}_b{batch}__exact-check.json", out)
    return out


# ---------------------------------------------------- timed pure-core calls
def exact_least_total(path: str, strategy: str) -> Dict[str, Any]:
    from chainer_recompute.core.budget import BudgetSearch
    from chainer_recompute.core.io import load_graph
    g = load_graph(path)
    t0 = time.perf_counter()
    search = BudgetSearch(g, "exact", strategy)
    plan = search.least_plan()
    return {"least_budget_bytes": plan.budget_bytes,
            "predicted_peak_bytes": plan.predicted_peak_bytes, "recompute": plan.recompute,
            "n_lower_sets": len(search.family) if search.family is not None else None,
            "solve_s": time.perf_counter() - t0}


def call_with_timeout(fn: str, args: List[Any], timeout_s: float) -> Dict[str, Any]:
    """Run ``fn(*args)`` of this module in a fresh process, killed after
    ``timeout_s``; its dict, with ``status`` and ``wall_s``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--call", fn, json.dumps(args)]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(ROOT), start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"status": "timeout", "wall_s": time.time() - t0, "limit_s": timeout_s}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"status": "error", "wall_s": time.time() - t0,
                "error": " | ".join((stderr or "").strip().splitlines()[-3:])}
    r = json.loads(lines[-1][7:])
    r.update(status="ok", wall_s=time.time() - t0)
    return r


def wait_for_memory(need: int, label: str, max_wait_s: float = 3600) -> bool:
    t0 = time.time()
    while mem_available() < need:
        if time.time() - t0 > max_wait_s:
            return False
        print(f"  [{label}] waiting for memory: {mem_available() / 2**30:.1f} GiB available, "
              f"{need / 2**30:.1f} GiB wanted", flush=True)
        time.sleep(60)
    return True


def table_cells(cfg: Dict[str, Any], networks: List[str], methods: List[str],
                resume: bool) -> int:
    order = [n for n in cfg["order"] if n in networks]
    todo: List[Tuple[str, str]] = []
    # phases: every network's vanilla, approx and Chen cells first, the
    # exact DP's last (cheapest network first within a phase)
    phases = cfg.get("phases", [METHODS])
    for net, method in [(n, m) for ph in phases for n in order for m in ph if m in methods]:
        batch = cfg["networks"][net]["paper_batch"]
        old = read_json(cell_path(net, method, batch))
        if resume and old and old.get("status") in ("ok", "skipped"):
            continue
        todo.append((net, method))
    t_start = time.time()
    checked: set = set()
    done: List[Dict[str, Any]] = []
    print(f"{len(todo)} cells to run: " + ", ".join(f"{n}:{m}" for n, m in todo), flush=True)
    for k, (net, method) in enumerate(todo):
        ncfg = cfg["networks"][net]
        batch = ncfg["paper_batch"]
        if method.startswith("exact"):
            chk = read_json(RESULTS / "cells" / f"{net}_b{batch}__exact-check.json")
            if chk is None or not (resume or net in checked):
                if not graph_path(net, batch).exists():
                    print(f"  {net}: no recorded graph yet (run approx-tc first); "
                          f"skipping {method}", flush=True)
                    continue
                if chk is None or chk.get("graph_file") is None or not resume:
                    print(f"  {net}: exact DP check (limit {cfg['protocol']['exact_timeout_s']}"
                          f" s per strategy)...", flush=True)
                    chk = exact_check(net, batch, cfg)
                    checked.add(net)
                    print(f"  {net}: exact DP tc {chk['tc'].get('status')} "
                          f"{chk['tc'].get('wall_s', 0):.0f} s, mc {chk['mc'].get('status')} "
                          f"{chk['mc'].get('wall_s', 0):.0f} s", flush=True)
            st = chk[method.split("-")[1]]
            if st.get("status") != "ok":
                out = {"network": net, "method": method, "batch": batch, "status": "skipped",
                       "reason": f"exact DP ({method.split('-')[1]}) did not find the least "
                                 f"total budget within {chk['limit_s']} s "
                                 f"({st.get('status')}: {st.get('error', '')})",
                       "exact_check": st}
                write_json(cell_path(net, method, batch), out)
                print(f"[{k + 1}/{len(todo)}] {net}:{method} skipped ({out['reason']})",
                      flush=True)
                continue
        van = read_json(cell_path(net, "vanilla", batch))
        need = int(1.15 * van["measured_peak_bytes"]) + (1 << 30) if van and \
            van.get("status") == "ok" else int(ncfg.get("expected_peak_gib", 8) * 2**30)
        need = min(need, int(0.9 * mem_total()))  # U-Net: a machine of its own
        wait_for_memory(need, f"{net}:{method}")
        est = estimate_cell_s(net, method, cfg)
        print(f"[{k + 1}/{len(todo)}] {net}:{method} batch {batch} (estimate {fmt_s(est)}, "
              f"load {load_avg()}, {mem_available() / 2**30:.1f} GiB available) ...", flush=True)
        r = run_cell(net, method, batch, cfg, timeout_s=cfg["protocol"]["cell_timeout_s"])
        if r["status"] == "ok":
            line = (f"    measured peak {r['measured_peak_bytes'] / 1e9:.3f} GB, "
                    f"{r['time_s']:.1f} s/iter")
            if "plan" in r:
                line += (f", predicted {r['predicted_peak_bytes'] / 1e9:.3f} GB, recomputes "
                         f"{100 * (r['plan']['overhead_fraction'] or 0):.0f}% of a forward, "
                         f"planning {r['plan']['planning_time_s']:.1f} s")
        else:
            line = f"    {r['status']}: {r.get('error', '')[-300:]}"
        remaining = sum(estimate_cell_s(n, m, cfg) for n, m in todo[k + 1:])
        print(line + f"; cell {fmt_s(r['wall_s'])}, elapsed {fmt_s(time.time() - t_start)}, "
              f"ETA {fmt_s(remaining)} (load {load_avg()})", flush=True)
        done.append(r)
    if done:
        print(summary_table(done, cfg))
    return 0


# ======================================================================
# Solver rows (pure core): the authors' graphs and our captured graphs.

AUTHORS_DIRS = [ROOT.parent / "shared" / "graphs", Path("/work/authors/computational_graphs")]
#: our registry name -> the authors' file name
AUTHORS_NAME = {"resnet50": "resnet50", "resnet152": "resnet152", "vgg19": "vgg19",
                "densenet161": "densenet", "googlenet": "googlenet", "unet": "unet",
                "pspnet": "pspnet"}


def authors_graph_file(net: str) -> Optional[Path]:
    for d in AUTHORS_DIRS:
        p = d / f"cg_{AUTHORS_NAME[net]}.txt"
        if p.exists():
            return p
    return None


def _load(path: str, kind: str):
    from chainer_recompute.core.io import load_authors_graph, load_graph
    return load_authors_graph(path) if kind == "authors" else load_graph(path)


def paper_model_row(path: str, kind: str, solver: str) -> Dict[str, Any]:
    """The paper's model (activations scope) on one graph: the solver's
    least feasible budget (bisection, to the byte), its TC and MC plans at
    that budget (predicted and simulated peaks, one solve's time); for our
    graphs also the replayed total peak of those plans."""
    from chainer_recompute.core.lower_sets import LowerSetFamily
    from chainer_recompute.core.errors import LowerSetExplosionError
    from chainer_recompute.core.planner import solve
    from chainer_recompute.core.search import least_feasible_budget
    g = _load(path, kind)
    if kind == "authors":
        g = g.with_cost_model("paper")
    out: Dict[str, Any] = {"n": g.n, "activation_bytes": int(g.activation_bytes),
                           "two_sum_m": 2 * int(g.activation_bytes),
                           "cost_model": g.cost_model if hasattr(g, "cost_model") else None}
    if solver == "exact":
        try:
            out["n_lower_sets"] = len(LowerSetFamily.all(g))
        except LowerSetExplosionError as e:
            out["n_lower_sets"] = None
            out["error"] = str(e)
            return out
    t0 = time.perf_counter()
    least = least_feasible_budget(g, solver=solver, strategy="tc")
    out["least_budget_bytes"] = int(least)
    out["search_s"] = time.perf_counter() - t0
    for strategy in ("tc", "mc"):
        t0 = time.perf_counter()
        plan = solve(g, least, solver=solver, strategy=strategy, raise_infeasible=False)
        r = {"solve_s": time.perf_counter() - t0, "feasible": plan.feasible,
             "predicted_peak_bytes": plan.predicted_peak_bytes,
             "simulated_peak_bytes": plan.simulated_peak_bytes,
             "overhead_fraction": plan.overhead_fraction, "n_blocks": plan.n_blocks}
        if kind == "ours" and plan.feasible:
            from chainer_recompute.core.execution import ExecutionPlan
            from chainer_recompute.core.replay import replay
            ep = ExecutionPlan.of(g, plan) if plan.recompute else None
            rp = replay(g, ep)
            r["replay_total_peak_bytes"] = rp.peak_bytes
            r["replay_peak_event"] = rp.peak_event
        out[strategy] = r
        if solver == "chen":
            break
    return out


def peak_parts(g, rp) -> Dict[str, Any]:
    """What a replayed peak is made of: the event, the call's transient
    (im2col and col2im buffers) at that moment, the plan-independent
    constant (parameters, inputs, persistents) and the parameter gradients."""
    import numpy
    from chainer_recompute.core.replay import param_grad_bytes, state_constant_bytes
    k = int(numpy.argmax(rp.memory_bytes))
    ev = rp.events[k]
    words = ev.split()
    transient = 0
    if len(words) > 1 and words[0] in ("forward", "backward", "regenerate") and \
            words[1].isdigit():
        node = g.nodes[int(words[1])]
        transient = int((node.backward_transient_bytes if words[0] == "backward"
                         else node.forward_transient_bytes) or 0)
    elif words and words[0] == "update":
        transient = int(g.state_bytes.get("update_transient", 0))
    return {"peak_event": ev, "transient_at_peak_bytes": transient,
            "constant_bytes": state_constant_bytes(g), "param_grad_bytes": param_grad_bytes(g)}


def graph_breakdown(path: str) -> Dict[str, Any]:
    """What plain Chainer's replayed peak is made of on one of our recorded
    graphs (see :func:`peak_parts`), and the largest transient of any call."""
    import numpy
    from chainer_recompute.core.io import load_graph
    from chainer_recompute.core.replay import replay
    g = load_graph(path)
    rp = replay(g, None)
    ft = [int(n.forward_transient_bytes or 0) for n in g.nodes]
    bt = [int(n.backward_transient_bytes or 0) for n in g.nodes]
    j = int(numpy.argmax(numpy.maximum(ft, bt)))
    return {"vanilla_replay_peak_bytes": rp.peak_bytes, **peak_parts(g, rp),
            "largest_transient_bytes": max(ft[j], bt[j]),
            "largest_transient_op": f"{j} {g.nodes[j].op}",
            "activation_bytes": int(g.activation_bytes),
            "retained_bytes": int(g.retained_bytes), "n": g.n,
            "state_bytes": g.state_bytes}


def solver_rows(cfg: Dict[str, Any], networks: List[str], resume: bool) -> int:
    """The paper-model rows on the authors' graphs and on ours (each solve
    in a process of its own, the exact DP limited to exact_timeout_s)."""
    limit = cfg["protocol"]["exact_timeout_s"]
    out_path = RESULTS / "solvers.json"
    res = read_json(out_path) or {}
    for net in [n for n in cfg["order"] if n in networks]:
        batch = cfg["networks"][net]["paper_batch"]
        sources = []
        a = authors_graph_file(net)
        if a is not None:
            sources.append(("authors", str(a)))
        ours = graph_path(net, batch)
        if ours.exists():
            sources.append(("ours", str(ours)))
        for kind, path in sources:
            key = f"{net}/{kind}"
            row = res.get(key, {})
            row["file"] = os.path.relpath(path, ROOT) if kind == "ours" else path
            for solver in ("approx", "chen", "exact"):
                if resume and row.get(solver, {}).get("status") == "ok":
                    continue
                r = call_with_timeout("paper_model_row", [path, kind, solver],
                                      limit if solver == "exact" else 3600)
                r["load"] = load_avg()
                row[solver] = r
                lb = r.get("least_budget_bytes")
                print(f"{key} {solver}: {r['status']} least "
                      f"{'-' if lb is None else f'{lb / 1e9:.3f} GB'} ({r['wall_s']:.1f} s)",
                      flush=True)
            if kind == "ours" and not (resume and "breakdown" in row):
                row["breakdown"] = call_with_timeout("graph_breakdown", [path], 3600)
            res[key] = row
            write_json(out_path, res)
    return 0


# ======================================================================
# Explanations: the recorded graphs replayed without the convolutions'
# temporary buffers (NumPy's im2col/col2im; cuDNN on a GPU works within a
# workspace bounded by CuPy's max_workspace_size, 8 MiB by default).

def _without_transients(g):
    import dataclasses
    return g.replace(nodes=[dataclasses.replace(n, forward_transient_bytes=0,
                                                backward_transient_bytes=0)
                            for n in g.nodes])


def explain_row(path: str, methods: List[str]) -> Dict[str, Any]:
    """On one recorded graph: each method's plan at its least total budget
    re-solved (as its cell did; cost model flops), its replayed peak (the
    cell's prediction), the same plan replayed without transients, and the
    least each method reaches when planned on the graph without transients;
    plain backprop with and without transients."""
    from chainer_recompute.core.budget import BudgetSearch
    from chainer_recompute.core.io import load_graph
    g = load_graph(path)
    g0 = _without_transients(g)
    out: Dict[str, Any] = {"vanilla": {"peak_bytes": _replayed_peak(g, None),
                                       "peak_no_transient_bytes": _replayed_peak(g0, None)}}
    for m in methods:
        t0 = time.perf_counter()
        if m == "chen":
            plan = _chen_plan(g)
            plan0 = _chen_plan(g0)
        else:
            solver, strategy = m.split("-")
            plan = BudgetSearch(g, solver, strategy).least_plan()
            plan0 = BudgetSearch(g0, solver, strategy).least_plan()
        out[m] = {"peak_bytes": _replayed_peak(g, plan),
                  "same_plan_no_transient_bytes": _replayed_peak(g0, plan),
                  "replanned_no_transient_bytes": _replayed_peak(g0, plan0),
                  "recompute": plan.recompute, "solve_s": time.perf_counter() - t0}
    return out


def explain(cfg: Dict[str, Any], networks: List[str], resume: bool) -> int:
    out_path = RESULTS / "explain.json"
    res = read_json(out_path) or {}
    for net in [n for n in cfg["order"] if n in networks]:
        batch = cfg["networks"][net]["paper_batch"]
        gp = graph_path(net, batch)
        if not gp.exists() or (resume and net in res and res[net].get("status") == "ok"):
            continue
        methods = ["approx-tc", "approx-mc", "chen"]
        chk = read_json(RESULTS / "cells" / f"{net}_b{batch}__exact-check.json") or {}
        methods += [f"exact-{s}" for s in ("tc", "mc") if chk.get(s, {}).get("status") == "ok"]
        r = call_with_timeout("explain_row", [str(gp), methods],
                              3600 + 2 * cfg["protocol"]["exact_timeout_s"])
        r["load"] = load_avg()
        res[net] = r
        write_json(out_path, res)
        print(f"{net}: {r['status']} ({r['wall_s']:.0f} s)", flush=True)
    return 0


# ======================================================================
# The runtime sweep (the poster's plots): a fixed budget B, the budget at
# which vanilla's largest batch is ``vanilla_batch`` on this machine.

SWEEP = RESULTS / "sweep"


def sweep_cell_path(net: str, batch: int, method: str, budget: int) -> Path:
    return SWEEP / f"{net}_b{batch}__{method}__B{budget}.json"


def _fit_plan(g, solver: str, strategy: str, budget: int):
    """The plan apply() would run for a total budget (None: no plan fits),
    with its replayed peak."""
    from chainer_recompute.core.budget import BudgetSearch
    from chainer_recompute.core.errors import InfeasibleBudgetError
    try:
        plan = BudgetSearch(g, solver, strategy).fit(budget)
    except InfeasibleBudgetError:
        return None
    return plan


def _chen_plan(g):
    from chainer_recompute.core.budget import plan_for_budget
    return plan_for_budget(g, "least", solver="chen", scope="activations")


def _replayed_peak(g, plan) -> int:
    from chainer_recompute.core.execution import ExecutionPlan
    from chainer_recompute.core.replay import replay
    if plan is None or not plan.recompute:
        return replay(g, None).peak_bytes
    return replay(g, ExecutionPlan.of(g, plan)).peak_bytes


def _recompute_share(g, plan) -> float:
    """The share of one plain iteration's measured time (forward and
    backward, from the recorded graph) that the plan's recomputation adds."""
    if plan is None or not plan.recompute:
        return 0.0
    if plan.nested:  # some nodes recomputed twice: the replay's count
        from chainer_recompute.core.execution import ExecutionPlan
        from chainer_recompute.core.replay import replay
        timed = g.with_cost_model("measured")  # each node's cost: its forward's time
        r = replay(timed, ExecutionPlan.of(timed, plan))
        total = sum(float(n.forward_time_s or 0.0) + float(n.backward_time_s or 0.0)
                    for n in g.nodes)
        return float(r.recomputed_cost) / max(1e-12, total)
    fwd = [float(n.forward_time_s or 0.0) for n in g.nodes]
    bwd = [float(n.backward_time_s or 0.0) for n in g.nodes]
    rec = plan.lower_sets[-1] - plan.kept
    return sum(fwd[v] for v in rec) / max(1e-12, sum(fwd) + sum(bwd))


def simulate_method(path: str, method: str, budget: int, batches: List[int]) -> Dict[str, Any]:
    """On the recorded graph scaled to each batch (Graph.scale_batch): does
    the method fit the total budget (replayed peak, as apply() decides), its
    predicted peak, its recomputed share of the iteration time."""
    from chainer_recompute.core.budget import MARGIN
    from chainer_recompute.core.io import load_graph
    g0 = load_graph(path)
    limit = int(budget * (1 - MARGIN))
    rows = []
    for b in batches:
        g = g0.scale_batch(b)
        if method == "vanilla":
            plan, peak = None, _replayed_peak(g, None)
            fits = peak <= limit
        elif method == "chen":
            plan = _chen_plan(g)
            peak = _replayed_peak(g, plan)
            fits = peak <= limit
        else:
            solver, strategy = _solver_of(method)
            plan = _fit_plan(g, solver, strategy, budget)
            fits = plan is not None
            if plan is None:  # the least it reaches, for the curve beyond
                from chainer_recompute.core.budget import BudgetSearch
                plan = BudgetSearch(g, solver, strategy).least_plan()
            peak = int(plan.predicted_peak_bytes) if plan.recompute else _replayed_peak(g, None)
        rows.append({"batch": b, "fits": bool(fits), "predicted_peak_bytes": int(peak),
                     "recompute_share": _recompute_share(g, plan),
                     "overhead_fraction": None if plan is None else plan.overhead_fraction})
    return {"method": method, "rows": rows}


def largest_batch(path: str, method: str, budget: int, hi: int = 4096) -> Dict[str, Any]:
    """The largest batch whose plan fits the total budget, on the recorded
    graph scaled (the replayed peak, as apply() decides; doubling then
    bisection), and core.search.largest_batch_size's figure (the DP formula
    with the measured memory model, no replay)."""
    from chainer_recompute.core.budget import MARGIN
    from chainer_recompute.core.io import load_graph
    from chainer_recompute.core.memory_model import measured_model
    from chainer_recompute.core.search import bisect_least, largest_batch_size
    g0 = load_graph(path)
    limit = int(budget * (1 - MARGIN))

    def ok(b: int) -> bool:
        g = g0.scale_batch(b)
        if method == "vanilla":
            return _replayed_peak(g, None) <= limit
        if method == "chen":
            return _replayed_peak(g, _chen_plan(g)) <= limit
        solver, strategy = _solver_of(method)
        return _fit_plan(g, solver, strategy, budget) is not None

    t0 = time.perf_counter()
    if not ok(1):
        best = 0
    else:
        lo, h = 1, 2
        while h <= hi and ok(h):
            lo, h = h, h * 2
        best = lo if h > hi else bisect_least(lambda b: not ok(b), lo, h) - 1
    out = {"method": method, "largest_batch": best, "search_s": time.perf_counter() - t0}
    if method not in ("vanilla", "chen"):
        solver, strategy = _solver_of(method)
        out["largest_batch_size_dp_formula"] = largest_batch_size(
            g0, budget, solver, strategy, model=measured_model)
    return out


def sweep(cfg: Dict[str, Any], net: str, resume: bool) -> int:
    sc = cfg["sweep"]
    b0 = sc["vanilla_batch"]
    methods = sc["methods"]
    state_path = SWEEP / f"{net}_budget.json"
    state = read_json(state_path) if resume else None
    t_start = time.time()
    if state is None:
        # vanilla at b0 measured, and the graph recorded at b0
        print(f"{net}: recording the graph at batch {b0} and measuring vanilla ...", flush=True)
        v = run_cell(net, "vanilla", b0, cfg, out=SWEEP / f"{net}_b{b0}__vanilla__least.json")
        gpath = SWEEP / "graphs" / f"{net}_b{b0}.json"
        run_cell(net, "approx-tc", b0, cfg, out=SWEEP / f"{net}_b{b0}__approx-tc__least.json",
                 graph_out=gpath)
        from chainer_recompute.core.io import load_graph
        from chainer_recompute.core.replay import replay
        g0 = load_graph(gpath)
        p0 = replay(g0.scale_batch(b0), None).peak_bytes
        p1 = replay(g0.scale_batch(b0 + 1), None).peak_bytes
        budget = (p0 + p1) // 2
        state = {"network": net, "vanilla_batch": b0, "budget_bytes": int(budget),
                 "vanilla_predicted_b0": int(p0), "vanilla_predicted_b0_plus_1": int(p1),
                 "vanilla_measured_b0": v.get("measured_peak_bytes"), "graph_file":
                 os.path.relpath(gpath, ROOT), "load": load_avg()}
        write_json(state_path, state)
    budget = state["budget_bytes"]
    gpath = str(ROOT / state["graph_file"])
    print(f"{net}: budget B = {budget / 1e9:.3f} GB (vanilla predicted {state['vanilla_predicted_b0'] / 1e9:.3f}"
          f" GB at batch {b0}, {state['vanilla_predicted_b0_plus_1'] / 1e9:.3f} GB at {b0 + 1}; "
          f"measured {(state['vanilla_measured_b0'] or 0) / 1e9:.3f} GB at {b0})", flush=True)
    # simulated curves and largest batches (pure core)
    sim = dict(state.get("simulated") or {}) if resume else {}
    largest = dict(state.get("largest") or {}) if resume else {}
    if any(m not in sim for m in methods):
        for m in [m for m in methods if m not in sim]:
            r = call_with_timeout("largest_batch", [gpath, m, budget], 3600)
            largest[m] = r
            top = max(2, int(1.25 * max(r.get("largest_batch", b0), b0)))
            grid = sorted(set(list(range(1, min(top, 16) + 1))
                              + list(range(16, top + 1, max(1, top // 24)))))
            sim[m] = call_with_timeout("simulate_method", [gpath, m, budget, grid], 3600)
            print(f"  {m}: largest batch in B {r.get('largest_batch')} (search "
                  f"{r.get('search_s', 0):.1f} s; largest_batch_size on the DP formula: "
                  f"{r.get('largest_batch_size_dp_formula', '-')})", flush=True)
        state["simulated"], state["largest"] = sim, largest
        write_json(state_path, state)
    # measured sweep, as the poster: vanilla up to its largest batch b0 (and
    # beyond, over B: the extrapolation), the other methods beyond b0 up to
    # their largest batch in B, and once at that largest batch
    largest = {m: state["largest"][m].get("largest_batch") or 0 for m in methods}
    todo = [(b, "vanilla") for b in sc["vanilla_batches"]]
    # nested plans only where the single-level ones no longer fit (below, the
    # nested method's plan is the single-level one): between the largest
    # batches of the two
    single = largest.get("approx-tc", 0)
    for b in sc["method_batches"]:
        todo += [(b, m) for m in methods if m not in ("vanilla", "nested-tc") and b <= largest[m]]
    if "nested-tc" in methods and largest["nested-tc"] > single + 1:
        todo.append(((single + largest["nested-tc"]) // 2, "nested-tc"))
    todo += [(largest[m], m) for m in methods if largest[m] and (largest[m], m) not in todo]
    for k, (b, m) in enumerate(todo):
        p = sweep_cell_path(net, b, m, budget)
        old = read_json(p)
        if resume and old and old.get("status") in ("ok", "infeasible"):
            continue
        print(f"  [{k + 1}/{len(todo)}] {net} batch {b} {m} at B (load {load_avg()}) ...",
              flush=True)
        r = run_cell(net, m, b, cfg, budget=budget if m != "vanilla" else "least", out=p,
                     save_graph=False)
        if r.get("status") == "ok":
            r["fits_budget"] = r["measured_peak_bytes"] <= budget
            write_json(p, r)
            print(f"    {r['time_s']:.1f} s/iter, peak {r['measured_peak_bytes'] / 1e9:.3f} GB"
                  f" ({'fits' if r['fits_budget'] else 'over'} B); elapsed "
                  f"{fmt_s(time.time() - t_start)}", flush=True)
        else:
            print(f"    {r.get('status')}: {r.get('error', '')[-200:]}", flush=True)
    return 0


# ======================================================================
# Plots.

COLORS = {"vanilla": "k", "chen": "tab:green", "approx-tc": "tab:blue",
          "approx-mc": "tab:orange", "exact-tc": "tab:purple", "exact-mc": "tab:red",
          "nested-tc": "tab:brown"}
LABELS = {"vanilla": "vanilla", "chen": "Chen et al.", "approx-tc": "approx DP, TC",
          "approx-mc": "approx DP, MC", "exact-tc": "exact DP, TC", "exact-mc": "exact DP, MC",
          "nested-tc": "nested (auto), TC"}


def sweep_measured(net: str, budget: int) -> Dict[str, List[Dict[str, Any]]]:
    out: Dict[str, List[Dict[str, Any]]] = {}
    for p in sorted(SWEEP.glob(f"{net}_b*__*__B{budget}.json")):
        r = read_json(p)
        if r and r.get("status") in ("ok", "infeasible"):
            out.setdefault(r["method"], []).append(r)
    for rs in out.values():
        rs.sort(key=lambda r: r["batch"])
    return out


def vanilla_fit(measured: Dict[str, List[Dict[str, Any]]]) -> Tuple[float, float]:
    """Least squares t = a + c * batch over vanilla's measured points."""
    import numpy
    pts = [(r["batch"], r["time_s"]) for r in measured.get("vanilla", []) if r["status"] == "ok"]
    if len(pts) < 2:
        b, t = pts[0] if pts else (1, 1.0)
        return 0.0, t / b
    x = numpy.array([p[0] for p in pts], float)
    y = numpy.array([p[1] for p in pts], float)
    c, a = numpy.polyfit(x, y, 1)
    if a < 0 or c <= 0:  # noise (a loaded machine): proportional to the batch
        a, c = 0.0, float((x * y).sum() / (x * x).sum())
    return float(a), float(c)


def plots(cfg: Dict[str, Any]) -> int:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for net in cfg["sweep"]["networks"]:
        state = read_json(SWEEP / f"{net}_budget.json")
        if not state or "simulated" not in state:
            print(f"{net}: no sweep yet")
            continue
        budget = state["budget_bytes"]
        measured = sweep_measured(net, budget)
        a, c = vanilla_fit(measured)
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5))
        for m in [m for m in cfg["sweep"]["methods"] if m in state["simulated"]]:
            col = COLORS[m]
            rows = state["simulated"][m]["rows"]
            b0 = state["vanilla_batch"]
            fit = [r for r in rows if r["fits"] and (m == "vanilla" or r["batch"] > b0)]
            if fit:
                bs = [r["batch"] for r in fit]
                ax.plot(bs, [(a + c * b) * (1 + r["recompute_share"]) for b, r in zip(bs, fit)],
                        "--", color=col, lw=1, alpha=0.8)
            if m == "vanilla":
                top = max(r["batch"] for rr in state["simulated"].values() for r in rr["rows"])
                ax.plot([b0, top], [a + c * b0, a + c * top], ":", color=col, lw=1,
                        label="vanilla extrapolated (over B)")
                ax.axvline(b0, color=col, lw=0.8, ls="--", alpha=0.5)
            ax2.plot([r["batch"] for r in rows], [r["predicted_peak_bytes"] / 1e9 for r in rows],
                     "--", color=col, lw=1, alpha=0.8)
            ok = [r for r in measured.get(m, []) if r["status"] == "ok"]
            fits = [r for r in ok if r.get("fits_budget", r["measured_peak_bytes"] <= budget)]
            over = [r for r in ok if r not in fits]
            ax.plot([r["batch"] for r in ok], [r["time_s"] for r in ok], "-", color=col, lw=1.5,
                    label=f"{LABELS[m]} (largest batch in B: "
                          f"{state['largest'][m].get('largest_batch')})")
            ax.plot([r["batch"] for r in fits], [r["time_s"] for r in fits], "o", color=col)
            ax.plot([r["batch"] for r in over], [r["time_s"] for r in over], "o", color=col,
                    mfc="white")
            ax2.plot([r["batch"] for r in ok], [r["measured_peak_bytes"] / 1e9 for r in ok], "o",
                     color=col, label=LABELS[m])
        ax2.axhline(budget / 1e9, color="gray", lw=1)
        ax2.text(ax2.get_xlim()[0], budget / 1e9, f" B = {budget / 1e9:.2f} GB", va="bottom",
                 color="gray")
        ax.set_xlabel("batch size")
        ax.set_ylabel("time per iteration (s), 2-core CPU")
        ax.set_title(f"{net}: time per iteration at the budget B\n"
                     "solid: measured (filled: fits B, hollow: over B); dashed: SIMULATED")
        ax.legend(fontsize=8)
        ax2.set_xlabel("batch size")
        ax2.set_ylabel("peak memory (GB)")
        ax2.set_title("peak memory: dots measured, dashed SIMULATED (replay;\n"
                      "DPs: the plan for B where it fits, else their least)")
        ax2.legend(fontsize=8)
        fig.tight_layout()
        out = (WRITE_TO or (HERE if RESULTS == COMMITTED else RESULTS)) / f"runtime_{net}.png"
        fig.savefig(out, dpi=110)
        plt.close(fig)
        print(f"wrote {os.path.relpath(out, ROOT)}")
    return 0


# ======================================================================
# The report: Markdown tables from the JSON files.

def _gb(b: Optional[float], d: int = 2) -> str:
    return "-" if b is None else f"{b / 1e9:.{d}f}"


def _pct(x: Optional[float], van: Optional[float]) -> str:
    if x is None or not van:
        return "-"
    return f"{100 * (x / van - 1):+.0f}%"


def _cell(net: str, method: str, cfg: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    return read_json(cell_path(net, method, cfg["networks"][net]["paper_batch"]))


def _ok(r: Optional[Dict[str, Any]]) -> bool:
    return bool(r) and r.get("status") == "ok"


def report_tables(cfg: Dict[str, Any]) -> Dict[str, str]:
    tables: Dict[str, str] = {}
    order = cfg["order"]
    # ---- headline
    lines = ["| network (batch, input) | vanilla: ours / paper | approx DP: ours / paper | "
             "exact DP: ours / paper | Chen et al.: ours / paper |",
             "|---|---|---|---|---|"]
    for net in order:
        ncfg = cfg["networks"][net]
        tg = ncfg["targets"]
        cells = {m: _cell(net, m, cfg) for m in METHODS}
        van = cells["vanilla"]["measured_peak_bytes"] if _ok(cells["vanilla"]) else None

        def best(*ms: str) -> Tuple[Optional[int], str]:
            got = [(cells[m]["measured_peak_bytes"], m) for m in ms if _ok(cells[m])]
            if not got:
                why = [cells[m].get("status") for m in ms if cells[m]]
                return None, ", ".join(w for w in why if w) or "not run"
            v, m = min(got)
            return v, m.split("-")[1].upper()

        row = [f"{net} ({ncfg['paper_batch']}, {'x'.join(map(str, ncfg['input'][1:]))})",
               f"{_gb(van)} GB / {tg['vanilla']} GB"]
        for key, ms in (("approx", ("approx-tc", "approx-mc")),
                        ("exact", ("exact-tc", "exact-mc"))):
            v, which = best(*ms)
            paper = f"{tg[key]} GB ({_pct(tg[key], tg['vanilla'])})"
            row.append(f"{_gb(v)} GB ({_pct(v, van)}, {which}) / {paper}" if v is not None
                       else f"{which} / {paper}")
        ch = cells["chen"]["measured_peak_bytes"] if _ok(cells["chen"]) else None
        row.append(f"{_gb(ch)} GB ({_pct(ch, van)}) / {tg['chen']} GB "
                   f"({_pct(tg['chen'], tg['vanilla'])})")
        lines.append("| " + " | ".join(row) + " |")
    tables["headline"] = "\n".join(lines)
    # ---- every cell
    lines = ["| network | method | measured peak GB | % of vanilla | predicted GB | "
             "measured / predicted | time s/iter | vs vanilla | recomputed (forward cost, "
             "nodes) | blocks | planning s | load (1 min) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for net in order:
        van = _cell(net, "vanilla", cfg)
        vpk = van["measured_peak_bytes"] if _ok(van) else None
        vt = van["time_s"] if _ok(van) else None
        for m in METHODS:
            r = _cell(net, m, cfg)
            if not r:
                lines.append(f"| {net} | {m} | not run | | | | | | | | | |")
                continue
            if not _ok(r):
                why = r.get("reason") or r.get("error") or ""
                lines.append(f"| {net} | {m} | {r.get('status')}: {why[:160]} | | | | | | | | | |")
                continue
            pred = r.get("predicted_peak_bytes")
            if m == "vanilla":
                a = _cell(net, "approx-tc", cfg)
                pred = a["vanilla_replay"]["peak_bytes"] if _ok(a) else None
            plan = r.get("plan") or {}
            steady = r["calls"][-1]
            rec = "-" if m == "vanilla" else (
                f"{100 * (plan.get('overhead_fraction') or 0):.0f}%, "
                f"{steady.get('recomputed_nodes', 0)}/{r.get('n_nodes')}")
            if m != "vanilla" and not plan.get("recompute", True):
                rec = "plain (no plan beats it)"
            mp = r["measured_peak_bytes"]
            ratio = f"{mp / pred:.3f}" if pred else "-"
            share = f"{100 * mp / vpk:.0f}%" if vpk else "-"
            planning = f"{plan['planning_time_s']:.1f}" if plan else "-"
            lines.append(
                f"| {net} | {m} | {_gb(mp, 3)} | {share} | {_gb(pred, 3)} | {ratio} | "
                f"{r['time_s']:.1f} | {_pct(r['time_s'], vt)} | {rec} | "
                f"{plan.get('n_blocks', '-')} | {planning} | {steady['load'][0]} |")
    tables["cells"] = "\n".join(lines)
    # ---- solver rows
    sv = read_json(RESULTS / "solvers.json") or {}
    lines = ["| network | graph | #V | #lower sets | ΣM GB | paper-model least budget GB: "
             "approx / exact / Chen | sim. peak GB TC / MC at exact least | exact TC solve s | "
             "TARGETS.md (authors' solver): approx / exact; sim. TC / MC |",
             "|---|---|---|---|---|---|---|---|---|"]
    for net in order:
        for kind in ("authors", "ours"):
            row = sv.get(f"{net}/{kind}")
            if not row:
                continue
            ap, ex, ch = row.get("approx", {}), row.get("exact", {}), row.get("chen", {})

            def lb(r: Dict[str, Any]) -> str:
                if r.get("status") == "timeout":
                    return f"> {r.get('limit_s', 0):.0f} s"
                if r.get("error"):
                    return "n/a"
                return _gb(r.get("least_budget_bytes"), 3)

            chen_b = ch.get("tc", {}).get("predicted_peak_bytes")
            sim = "-"
            if ex.get("status") == "ok":
                sim = (f"{_gb(ex['tc']['simulated_peak_bytes'], 3)} / "
                       f"{_gb(ex['mc']['simulated_peak_bytes'], 3)}")
            t = TARGETS_SOLVER.get(net) if kind == "authors" else None
            tcol = "-" if not t else f"{t[0]} / {t[1]}; {t[2]} / {t[3]}"
            g = ap
            solve_s = f"{ex['tc']['solve_s']:.2f}" if ex.get("status") == "ok" else "-"
            lines.append(
                f"| {net} | {kind} | {g.get('n', '-')} | {ex.get('n_lower_sets', '-')} | "
                f"{_gb(g.get('activation_bytes'), 3)} | {lb(ap)} / {lb(ex)} / {_gb(chen_b, 3)} | "
                f"{sim} | {solve_s} | {tcol} |")
    tables["solvers"] = "\n".join(lines)
    # ---- vanilla breakdowns (our graphs)
    lines = ["| network | vanilla measured GB | replayed GB | event at the peak | parameters + "
             "inputs GB | parameter gradients GB | transient at the peak GB | largest transient "
             "GB (function) | ΣM ours / authors GB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for net in order:
        row = sv.get(f"{net}/ours", {})
        bd = row.get("breakdown")
        if not bd or bd.get("status") != "ok":
            continue
        van = _cell(net, "vanilla", cfg)
        au = sv.get(f"{net}/authors", {}).get("approx", {})
        lines.append(
            f"| {net} | {_gb(van['measured_peak_bytes'], 3) if _ok(van) else '-'} | "
            f"{_gb(bd['vanilla_replay_peak_bytes'], 3)} | {bd['peak_event']} | "
            f"{_gb(bd['constant_bytes'], 3)} | {_gb(bd['param_grad_bytes'], 3)} | "
            f"{_gb(bd['transient_at_peak_bytes'], 3)} | {_gb(bd['largest_transient_bytes'], 3)} "
            f"({bd['largest_transient_op']}) | {_gb(bd['activation_bytes'], 3)} / "
            f"{_gb(au.get('activation_bytes'), 3)} |")
    tables["breakdown"] = "\n".join(lines)
    # ---- the runtime sweep
    lines = ["| network | budget B GB | method | largest batch in B (replayed) | "
             "largest_batch_size (DP formula) | measured at that batch: peak GB, fits B | "
             "s/iter at that batch | s/iter at batch 8 (vs vanilla at 8) | "
             "s/iter at batch 5 (vs vanilla's fit at 5) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for net in cfg.get("sweep", {}).get("networks", []):
        state = read_json(SWEEP / f"{net}_budget.json")
        if not state or "largest" not in state:
            continue
        budget = state["budget_bytes"]
        meas = sweep_measured(net, budget)
        a, c = vanilla_fit(meas)

        def at(m: str, b: int) -> Optional[Dict[str, Any]]:
            for r in meas.get(m, []):
                if r["batch"] == b and r["status"] == "ok":
                    return r
            return None

        v8 = at("vanilla", 8)
        for m in [m for m in cfg["sweep"]["methods"] if m in state["largest"]]:
            lg = state["largest"][m]
            L = lg.get("largest_batch")
            r = at(m, L) if L else None
            r8, r5 = at(m, 8), at(m, 5)
            t8 = "-" if not r8 else (f"{r8['time_s']:.1f}" + (
                f" ({_pct(r8['time_s'], v8['time_s'])})" if v8 and m != "vanilla" else ""))
            t5 = "-" if not r5 else f"{r5['time_s']:.1f} ({_pct(r5['time_s'], a + 5 * c)})"
            fits = "-" if not r else (f"{_gb(r['measured_peak_bytes'], 3)}, "
                                      f"{'yes' if r['measured_peak_bytes'] <= budget else 'NO'}")
            lines.append(
                f"| {net} | {_gb(budget, 3)} | {m} | {L} | "
                f"{lg.get('largest_batch_size_dp_formula', '-')} | {fits} | "
                f"{'-' if not r else round(r['time_s'], 1)} | "
                f"{t8} | {t5} |")
    tables["sweep"] = "\n".join(lines)
    # ---- interleaved timing
    lines = ["| network (batch) | vanilla s/iter (median of n) | approx-DP TC at its least budget "
             "s/iter (median of n) | TC overhead | recomputed share of a forward (flops) | "
             "load (1 min) during the runs |",
             "|---|---|---|---|---|---|"]
    for net, d in timing_summary(cfg).items():
        if "overhead" not in d:
            continue
        a = _cell(net, "approx-tc", cfg)
        share = f"{100 * a['plan']['overhead_fraction']:.0f}%" if _ok(a) else "-"
        lines.append(f"| {net} ({d['batch']}) | {d['median_vanilla_s']:.1f} ({len(d['vanilla'])}) | "
                     f"{d['median_tc_s']:.1f} ({len(d['approx-tc'])}) | "
                     f"{100 * d['overhead']:+.0f}% | {share} | "
                     f"{min(d['loads']):.1f}-{max(d['loads']):.1f} |")
    tables["timing"] = "\n".join(lines)
    return tables


#: TARGETS.md, the authors' solver on their graphs: approx / exact least
#: budget GB, simulated peak TC / MC at the exact least (GB).
TARGETS_SOLVER = {"vgg19": ("2.114", "2.114", "2.116", "2.116"),
                  "resnet50": ("1.311", "1.290", "1.301", "1.235"),
                  "densenet161": ("1.685", "1.685", "1.693", "1.499"),
                  "unet": ("5.819", "5.726", "(overflow)", "(overflow)")}


def report(cfg: Dict[str, Any]) -> int:
    tables = report_tables(cfg)
    md = []
    for name, t in tables.items():
        md.append(f"<!-- BEGIN:{name} -->\n{t}\n<!-- END:{name} -->")
    tables_md = (WRITE_TO or RESULTS) / "tables.md"
    tables_md.parent.mkdir(parents=True, exist_ok=True)
    tables_md.write_text("\n\n".join(md) + "\n")
    readme = HERE / "README.md"
    # experiments/README.md's tables are the committed results': rewritten
    # only with --update-committed
    if RESULTS == COMMITTED and WRITE_TO is None and readme.exists():
        text = readme.read_text()
        for name, t in tables.items():
            b, e = f"<!-- BEGIN:{name} -->", f"<!-- END:{name} -->"
            if b in text and e in text:
                head, rest = text.split(b, 1)
                _, tail = rest.split(e, 1)
                text = f"{head}{b}\n{t}\n{e}{tail}"
        readme.write_text(text)
    print("\n\n".join(tables.values()))
    print(f"wrote {tables_md}" + (f" and {readme}" if RESULTS == COMMITTED and WRITE_TO is None
                                  else " (experiments/README.md is left alone: "
                                       "--update-committed rewrites it)"), file=sys.stderr)
    return 0


# ======================================================================
# Timing: vanilla and TC interleaved, several measured iterations each.

def timing(cfg: Dict[str, Any], networks: List[str], rounds: int, resume: bool) -> int:
    """The time overhead of approx-DP TC at its least budget against
    vanilla, measured in alternating processes (vanilla, TC, vanilla, ...),
    ``timing_iterations`` measured iterations each after the warm-up; the
    median per iteration of each, with the load averages."""
    k = cfg["protocol"].get("timing_iterations", 3)
    for net in networks:
        batch = cfg["networks"][net]["paper_batch"]
        for r in range(rounds):
            for m in ("vanilla", "approx-tc"):
                p = RESULTS / "timing" / f"{net}_b{batch}_r{r}__{m}.json"
                old = read_json(p)
                if resume and old and old.get("status") == "ok":
                    continue
                out = run_cell(net, m, batch, cfg, out=p, save_graph=False, measured=k)
                ts = [c["time_s"] for c in out.get("calls", [])[1:]]
                print(f"{net} round {r} {m}: {out.get('status')} "
                      f"{', '.join(f'{t:.1f}' for t in ts)} s (load {out['load_end']})",
                      flush=True)
    return 0


def timing_summary(cfg: Dict[str, Any]) -> Dict[str, Any]:
    import statistics
    res: Dict[str, Any] = {}
    for p in sorted((RESULTS / "timing").glob("*.json")):
        r = read_json(p)
        if not r or r.get("status") != "ok":
            continue
        d = res.setdefault(r["network"], {"batch": r["batch"], "vanilla": [], "approx-tc": [],
                                          "loads": []})
        d[r["method"]] += [c["time_s"] for c in r["calls"][1:]]
        d["loads"] += [c["load"][0] for c in r["calls"][1:]]
    for net, d in res.items():
        if d["vanilla"] and d["approx-tc"]:
            d["median_vanilla_s"] = statistics.median(d["vanilla"])
            d["median_tc_s"] = statistics.median(d["approx-tc"])
            d["overhead"] = d["median_tc_s"] / d["median_vanilla_s"] - 1
    return res


# ======================================================================
# The estimate: small-batch runs, scaled.

def estimate(cfg: Dict[str, Any], networks: List[str], resume: bool) -> int:
    """Vanilla and approx-TC at a small batch per network; per-sample time
    scaled to the paper's batch, and the whole table's time."""
    est = read_json(RESULTS / "estimate.json") or {}
    measured = cfg["protocol"]["measured_iterations"]
    total = 0.0
    for net in [n for n in cfg["order"] if n in networks]:
        ncfg = cfg["networks"][net]
        b = ncfg["estimate_batch"]
        if not (resume and net in est):
            runs = {}
            for method in ("vanilla", "approx-tc"):
                r = run_cell(net, method, b, cfg, tag="-est", save_graph=False)
                runs[method] = r
                print(f"  {net} batch {b} {method}: {r.get('status')} "
                      f"{r.get('time_s', 0):.1f} s/iter, peak "
                      f"{r.get('measured_peak_bytes', 0) / 1e9:.2f} GB, process "
                      f"{r.get('process_s', 0):.0f} s, load {r['load_end']}", flush=True)
            v, a = runs["vanilla"], runs["approx-tc"]
            if v.get("status") != "ok":
                continue
            est[net] = {"batch": b, "per_sample_s": v["time_s"] / b,
                        "vanilla_time_s": v["time_s"],
                        "vanilla_peak_bytes": v["measured_peak_bytes"],
                        "approx_tc_time_s": a.get("time_s"),
                        "approx_tc_process_s": a.get("process_s"),
                        "record_time_s": a["calls"][0]["time_s"] if a.get("calls") else None,
                        "load": load_avg()}
            write_json(RESULTS / "estimate.json", est)
        e = est[net]
        scale = ncfg["paper_batch"] / e["batch"]
        it = e["vanilla_time_s"] * scale
        rec = (e["record_time_s"] or 2 * e["vanilla_time_s"]) * scale
        cells = 6 if net not in cfg.get("exact_skip_expected", []) else 4
        t_net = (1 + measured) * it + (cells - 1) * (rec + (1 + measured) * it)
        total += t_net
        print(f"{net}: batch {e['batch']} -> {ncfg['paper_batch']}: ~{it:.0f} s/iter, recording "
              f"~{rec:.0f} s, ~{fmt_s(t_net)} for {cells} cells (vanilla peak at batch "
              f"{e['batch']}: {e['vanilla_peak_bytes'] / 1e9:.2f} GB)", flush=True)
    print(f"estimated total: {fmt_s(total)} (iterations only, at the load of the estimate "
          f"runs; exact-DP planning comes on top)")
    return 0


# ======================================================================
# The workspace's time against none, paired.

def paired(cfg: Dict[str, Any], networks: List[str]) -> int:
    """For each network in turn: its approx-tc cell, then at once its
    approx-tc-ws cell (the same protocol, the same machine load as near as a
    shared machine gives). The approx-tc cell goes to
    ``workspace/<net>_b<batch>__approx-tc__paired.json`` (the headline
    table's cell and the recorded graph are left as they are); the
    workspace cell to ``cells/`` as ``--cell`` writes it."""
    for net in networks:
        batch = cfg["networks"][net]["paper_batch"]
        for method, out in (("approx-tc", RESULTS / "workspace"
                             / f"{net}_b{batch}__approx-tc__paired.json"),
                            ("approx-tc-ws", cell_path(net, "approx-tc-ws", batch))):
            print(f"{net}:{method} batch {batch} (load {load_avg()}, "
                  f"{mem_available() / 2**30:.1f} GiB available) ...", flush=True)
            r = run_cell(net, method, batch, cfg, out=out, save_graph=False,
                         timeout_s=cfg["protocol"]["cell_timeout_s"])
            if r["status"] == "ok":
                print(f"    measured peak {r['measured_peak_bytes'] / 1e9:.3f} GB, "
                      f"predicted {r.get('predicted_peak_bytes', 0) / 1e9:.3f} GB, budget "
                      f"{(r.get('plan') or {}).get('budget_bytes', 0) / 1e9:.3f} GB, "
                      f"{r['time_s']:.1f} s/iter, workspace {r.get('workspace_bytes')}, "
                      f"{r.get('workspace_calls')} calls (load {load_avg()})", flush=True)
            else:
                print(f"    {r['status']}: {r.get('error', '')[-300:]}", flush=True)
    return 0


# ======================================================================

def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "paper.json"))
    ap.add_argument("--out", "--results", dest="results", metavar="DIR",
                    help="the results folder this run reads and writes (default: a new "
                         "scratch folder, said on stderr; --report and --plots then read "
                         "the committed results and write there)")
    ap.add_argument("--update-committed", action="store_true",
                    help="write into the committed experiments/results/ and let --report "
                         "rewrite experiments/README.md's tables (regenerating the "
                         "published figures)")
    ap.add_argument("--networks", help="comma-separated (default: all of the config)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--resume", action="store_true", help="skip cells already done")
    ap.add_argument("--cell", help="NET:METHOD: run this one cell (overwrites its JSON in the "
                                   "results folder)")
    ap.add_argument("--paired", metavar="NET[,NET...]",
                    help="approx-tc then approx-tc-ws, back to back, per network (one at a "
                         "time): the workspace's time against none, paired")
    ap.add_argument("--batch", type=int, help="with --cell: another batch size")
    ap.add_argument("--estimate", action="store_true")
    ap.add_argument("--solvers", action="store_true", help="the solver rows (pure core)")
    ap.add_argument("--sweep", help="NET: the runtime sweep at the fixed budget")
    ap.add_argument("--plots", action="store_true", help="draw the runtime plots")
    ap.add_argument("--timing", type=int, metavar="ROUNDS",
                    help="vanilla and approx-TC interleaved, ROUNDS rounds (--networks)")
    ap.add_argument("--explain", action="store_true",
                    help="replays without the convolutions' temporaries (pure core)")
    ap.add_argument("--report", action="store_true",
                    help="the Markdown tables (results/tables.md and experiments/README.md)")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--call", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--measured", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--optimizer", default="SGD", help=argparse.SUPPRESS)
    ap.add_argument("--cost", default="flops", help=argparse.SUPPRESS)
    ap.add_argument("--save-graph", help=argparse.SUPPRESS)
    ap.add_argument("--budget", default="least",
                    help="with --cell: a total budget in bytes instead of the least")
    ap.add_argument("--small", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        net, method = args.worker
        out = worker(net, method, args.batch, measured=args.measured, optimizer=args.optimizer,
                     cost=args.cost, save_graph=args.save_graph, small=args.small,
                     budget=args.budget)
        print("CELL " + json.dumps(out))
        return 0
    if args.call:
        fn, a = args.call
        print("RESULT " + json.dumps(globals()[fn](*json.loads(a))))
        return 0
    cfg = load_config(args.config)
    reads_only = bool(args.report or args.plots)
    results, write_to, flags = results_folder(args.results, args.update_committed, reads_only)
    global RESULTS, SWEEP, WRITE_TO, RUN_FLAGS
    RESULTS, WRITE_TO = results, write_to
    SWEEP = RESULTS / "sweep"
    config = Path(args.config).resolve()
    RUN_FLAGS = ["--config", _shown(config)] + flags
    networks = args.networks.split(",") if args.networks else list(cfg["networks"])
    methods = args.methods.split(",")
    if args.estimate:
        return estimate(cfg, networks, args.resume)
    if args.solvers:
        return solver_rows(cfg, networks, args.resume)
    if args.sweep:
        return sweep(cfg, args.sweep, args.resume)
    if args.plots:
        return plots(cfg)
    if args.explain:
        return explain(cfg, networks, args.resume)
    if args.timing:
        return timing(cfg, networks, args.timing, args.resume)
    if args.report:
        return report(cfg)
    if args.paired:
        return paired(cfg, args.paired.split(","))
    if args.cell:
        net, method = args.cell.split(":")
        batch = args.batch or cfg["networks"][net]["paper_batch"]
        if args.budget != "least":
            out = RESULTS / "sweep" / f"{net}_b{batch}__{method}__B{args.budget}.json"
            r = run_cell(net, method, batch, cfg, budget=args.budget, out=out,
                         save_graph=False)
        else:
            out = cell_path(net, method, batch)
            r = run_cell(net, method, batch, cfg)
        print(summary_table([r], cfg))
        print(f"wrote {out}", file=sys.stderr)
        return 0 if r["status"] == "ok" else 1
    return table_cells(cfg, networks, methods, args.resume)


def _shown(path: Path) -> str:
    """A path as a command shows it: relative to the repository when inside."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def results_folder(out: Optional[str], update_committed: bool, reads_only: bool
                   ) -> Tuple[Path, Optional[Path], List[str]]:
    """Where this run reads and writes: ``(results, write_to, flags)``.

    - ``--update-committed``: the committed experiments/results/ (and
      --report rewrites experiments/README.md's tables);
    - ``--out DIR``: DIR, which may not be the committed folder or inside it;
    - neither: a new scratch folder (said on stderr); --report and --plots
      read the committed results and write into it.

    ``flags`` are the ones a command that reproduces a cell of this run
    needs (``--out DIR`` or ``--update-committed``)."""
    import tempfile
    if update_committed:
        if out and Path(out).resolve() != COMMITTED:
            raise SystemExit("reproduce.py: error: --update-committed writes into "
                             f"{_shown(COMMITTED)}; drop --out {out}, or drop "
                             "--update-committed to write into that folder")
        return COMMITTED, None, ["--update-committed"]
    if out:
        path = Path(out).resolve()
        if path == COMMITTED or COMMITTED in path.parents:
            raise SystemExit(f"reproduce.py: error: --out {out} is the committed results "
                             f"folder ({_shown(COMMITTED)}); name another folder, or add "
                             "--update-committed (without --out) to regenerate the "
                             "committed results")
        path.mkdir(parents=True, exist_ok=True)
        return path, None, ["--out", _shown(path)]
    scratch = Path(tempfile.mkdtemp(prefix="reproduce-"))
    if reads_only:
        print(f"reading the committed results in {_shown(COMMITTED)}; writing into {scratch} "
              "(--out DIR to choose the folder, --update-committed to rewrite "
              "experiments/README.md)", file=sys.stderr)
        return COMMITTED, scratch, ["--out", str(scratch)]
    print(f"writing results into {scratch} (--out DIR to choose the folder; the committed "
          f"{_shown(COMMITTED)} is left alone unless --update-committed)", file=sys.stderr)
    return scratch, None, ["--out", str(scratch)]


#: method -> the key of the paper's figure in the config's targets
_TARGET = {"vanilla": "vanilla", "chen": "chen"}


def _paper_figure(net: str, method: str, cfg: Dict[str, Any]) -> str:
    targets = (cfg["networks"].get(net) or {}).get("targets") or {}
    key = _TARGET.get(method) or method.split("-")[0]
    gb, van = targets.get(key), targets.get("vanilla")
    if gb is None:
        return "-"
    if key == "vanilla" or not van:
        return f"{gb} GB"
    return f"{gb} GB ({100 * (gb / van - 1):+.0f}%)"


def summary_table(cells: List[Dict[str, Any]], cfg: Dict[str, Any]) -> str:
    """The short table a run ends with: per cell the measured peak, the
    predicted one, the paper's figure (GPU, against its own vanilla) and the
    command that reproduces it."""
    head = ["cell", "measured peak", "predicted peak", "vs plain (ours)", "paper (GPU)",
            "s/iter", "command"]
    rows = []
    for r in cells:
        cell = f"{r['network']}:{r['method']} b{r['batch']}"
        if r.get("status") != "ok":
            rows.append([cell, r.get("status", "?"), "-", "-",
                         _paper_figure(r["network"], r["method"], cfg), "-",
                         r.get("command", "")])
            continue
        meas = r["measured_peak_bytes"]
        pred = r.get("predicted_peak_bytes")
        plain = (r.get("vanilla_replay") or {}).get("peak_bytes")
        if r["method"] == "vanilla":
            plain = None  # it is plain Chainer
        rows.append([cell, f"{meas / 1e9:.3f} GB",
                     f"{pred / 1e9:.3f} GB" if pred else "- (plain Chainer: no plan)",
                     f"{100 * (meas / plain - 1):+.0f}%" if plain else "-",
                     _paper_figure(r["network"], r["method"], cfg), f"{r['time_s']:.1f}",
                     r.get("command", "")])
    widths = [max(len(str(x[i])) for x in [head] + rows) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(widths[i]) for i, c in enumerate(x)).rstrip()
             for x in [head] + rows]
    note = ("vs plain (ours): the measured peak against plain Chainer's replayed peak on the "
            "cell's own recorded graph; paper: Kusumoto et al.'s GPU figure and its change "
            "from their vanilla")
    return "\n".join(lines + [note])


if __name__ == "__main__":
    sys.exit(main())
