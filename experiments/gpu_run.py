#!/usr/bin/env python
"""One prepared run on a lent GPU (issue 36): the paper's table, the time
overhead and the budget, measured on CuPy's memory pool.

    python experiments/gpu_run.py OUT                      # @cupy:0, full sizes: < 9 min, one H200
    python experiments/gpu_run.py OUT --device @numpy --tiny          # the same on CPU, small
    python experiments/gpu_run.py OUT --sections resnet50,lstm        # some sections only

``experiments/gpu_run.sh`` sets the machine up from carried wheels first
(experiments/gpu.md has the device command). It writes ``OUT/gpu_run.md``
(one table) and ``OUT/gpu_run.json`` (every figure), and ``OUT/logs/``.

Sections, in order (what finishes first matters most); each runs in a
process of its own under a time box, and one that fails, times out or is
skipped is recorded without stopping the rest:

1. ``pytest``: ``pytest -m gpu`` on the test files that have GPU tests.
2. ``resnet50``, ``resnet152``, ``vgg19`` (batch 32), ``unet`` (batch 8,
   572x572): plain Chainer, ``apply(budget='least')`` and a byte budget
   halfway between the least and plain's measured peak; on ResNet50 and
   ResNet152, also the least budget with nested recomputation (issue 35),
   below the single-level least, searched on the least plan's graph. Three steps of
   each from the same parameters with NumPy's and CuPy's generators seeded
   alike: loss, gradients, parameters and BatchNorm statistics compared bit
   for bit with plain's; the pool's used and total peaks of the planned
   steps against the budget and the plan's prediction (the runner's own
   figures and this script's meter); then two steps under
   ``cupy.get_default_memory_pool().set_limit(size=budget)`` (no
   ``OutOfMemoryError`` expected); then time per iteration, all
   configurations interleaved, median of ``--repeat`` after two warm-up
   steps, each against plain's in the same round (paired), with
   ``verify=False`` beside.
3. ``tc_overhead``: ResNet152. The memory M in which plain Chainer's
   largest batch is 32 (its measured peak at 32): the approximate DP (TC)
   at batch 64 in M against plain Chainer at 64 (the poster: +12%; the
   CPU sweep measured it at twice vanilla's largest batch too); and the
   executor's own cost at 32 with a budget that drops nothing, as it runs
   by default and with its hook kept on (goal: at most 3%).
4. ``densenet161``, ``googlenet``, ``pspnet`` (batch 1, 713x713): plain
   and least only (no timing rounds).
5. ``workspace``: VGG19's convolutions under one-copy and chunked
   workspace kernels against Chainer's own (im2col + cuBLAS on CuPy):
   gradients bit-identical or not, and time.
6. ``lstm``: Chainer's PTB LSTM unrolled over t = 1000: plain BPTT against
   MSM and ISM at 5% and 10% of plain's measured peak; identical gradients
   with the RNG (dropout) in play; time, paired.
7. ``torch``: torchvision's ResNet50 at batch 32, plain against
   ``torch.utils.checkpoint`` over its four stages:
   ``torch.cuda.max_memory_allocated`` and time.

On CPU (``--device @numpy``) the pool figures are tracemalloc's, there is
no pool limit, and the CuPy and torch sections say they are skipped.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

#: name, kind, time box in seconds on the GPU, in --tiny, batch on the GPU.
#: The GPU boxes add up to 685 s; ``--deadline-s`` (510 s) cuts the last ones short, so
#: that with the set-up (about 20 s) and the numba kernels' compilation (about 20 s on the
#: H200's host) the whole stays under 9 minutes. On the H200 (experiments/gpu.md) every
#: section took 10-53 s but the two ResNets' (61 and 173 s with their nested rows), 474 s
#: in all.
SECTIONS: List[Tuple[str, str, int, int, Optional[int]]] = [
    ("pytest", "pytest", 45, 60, None),
    ("resnet50", "net+nested", 80, 240, 32),
    ("resnet152", "net+nested", 190, 480, 32),
    ("vgg19", "net", 50, 480, 32),
    ("unet", "net", 50, 240, 8),
    ("tc_overhead", "tc_overhead", 60, 480, 32),
    ("densenet161", "least", 35, 240, 32),
    ("googlenet", "least", 25, 240, 32),
    ("pspnet", "least", 30, 240, 1),
    ("workspace", "workspace", 30, 240, None),
    ("lstm", "lstm", 60, 240, None),
    ("lstm_graph", "lstm_graph", 40, 120, None),
    ("torch", "torch", 30, 30, 32),
]
#: --tiny: the registry's small networks at this batch (3 or more: planned from captures)
TINY_BATCH = 4


class Skip(Exception):
    """A section that cannot run here (no CuPy, no torch)."""


# --------------------------------------------------------------------------
# The parent: runs each section in a process of its own, under its box.

def section_table(names: Optional[str]) -> List[Tuple[str, str, int, int, Optional[int]]]:
    """The sections asked for, in the run's order; a registry network name
    not in :data:`SECTIONS` (``mlp``) runs as a full network section, after
    the others."""
    if not names:
        return list(SECTIONS)
    from chainer_recompute.models import MODELS
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {s[0]: s for s in SECTIONS}
    out = []
    for n in wanted:
        if n in known:
            out.append(known[n])
        elif n in MODELS:
            out.append((n, "net", 60, 60, MODELS[n][1]))
        else:
            raise SystemExit(f"unknown section {n!r}: choose among "
                             f"{', '.join(s[0] for s in SECTIONS)} or a registry network "
                             f"({', '.join(sorted(MODELS))})")
    order = {s[0]: i for i, s in enumerate(SECTIONS)}
    return sorted(out, key=lambda s: order.get(s[0], len(SECTIONS)))


def run_all(args: argparse.Namespace) -> int:
    out = Path(args.out)
    (out / "rows").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    deadline = t_start + args.deadline_s
    report: Dict[str, Any] = {"meta": environment(args), "sections": []}
    for name, kind, box_gpu, box_tiny, _ in section_table(args.sections):
        box = box_tiny if args.tiny else box_gpu
        box = int(box * args.box_scale)
        left = deadline - time.monotonic()
        entry: Dict[str, Any] = {"name": name, "kind": kind, "box_s": box}
        if left < 10:
            entry.update(status="skipped", reason=f"out of time ({args.deadline_s:.0f} s run)")
            report["sections"].append(entry)
            continue
        timeout = min(box, left)
        rows_path = out / "rows" / f"{name}.jsonl"
        rows_path.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), str(out), "--child", name,
               "--device", args.device, "--repeat", str(args.repeat)]
        if args.tiny:
            cmd.append("--tiny")
        print(f"[{time.monotonic() - t_start:6.1f} s] {name}: up to {timeout:.0f} s", flush=True)
        t0 = time.monotonic()
        with open(out / "logs" / f"{name}.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the section's own process group
                proc.wait()
                rc, timed_out = None, True
        entry["wall_s"] = round(time.monotonic() - t0, 1)
        rows, status = read_rows(rows_path)
        entry["rows"] = rows
        if timed_out:
            entry.update(status="timed out",
                         reason=f"stopped at its {timeout:.0f} s box; rows so far kept")
        elif "skipped" in status:
            entry.update(status="skipped", reason=status["skipped"])
        elif "error" in status or rc != 0:
            entry.update(status="failed",
                         reason=status.get("error") or f"exit status {rc}; see logs/{name}.log")
        else:
            entry["status"] = "ok"
        print(f"[{time.monotonic() - t_start:6.1f} s] {name}: {entry['status']} "
              f"({entry['wall_s']} s) {entry.get('reason', '')[-300:]}", flush=True)
        report["sections"].append(entry)
        write_report(out, report, time.monotonic() - t_start)  # what is done so far, kept
        bundle(out, args.bundle)
    report["meta"]["wall_s"] = round(time.monotonic() - t_start, 1)
    write_report(out, report, time.monotonic() - t_start)
    bundle(out, args.bundle)
    print((out / "gpu_run.md").read_text())
    return 0


def bundle(out: Path, dest: Optional[str]) -> None:
    """Copy the report to ``dest`` as three files (the device tool brings
    back a few files only): ``gpu_run.md``, ``gpu_run.json`` and
    ``logs.tar.gz`` (``logs/``, ``rows/``, ``graphs/`` and ``setup.log``)."""
    if not dest:
        return
    import shutil
    import tarfile
    d = Path(dest)
    d.mkdir(parents=True, exist_ok=True)
    for f in ("gpu_run.md", "gpu_run.json"):
        shutil.copyfile(out / f, d / f)
    tmp = d / "logs.tar.gz.part"
    with tarfile.open(tmp, "w:gz") as tar:
        for f in ("logs", "rows", "graphs", "setup.log"):
            if (out / f).exists():
                tar.add(out / f, arcname=f)
    tmp.replace(d / "logs.tar.gz")


def read_rows(path: Path) -> Tuple[List[Dict[str, Any]], Dict[str, str]]:
    """A child's rows (a later row with the same ``case`` updates the
    earlier one) and its closing status."""
    rows: Dict[str, Dict[str, Any]] = {}
    status: Dict[str, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            d = json.loads(line)
            if "_status" in d:
                status = d["_status"]
            else:
                rows.setdefault(d["case"], {}).update(d)
    return list(rows.values()), status


def environment(args: argparse.Namespace) -> Dict[str, Any]:
    import numpy
    meta: Dict[str, Any] = {"device": args.device, "tiny": args.tiny, "repeat": args.repeat,
                            "python": platform.python_version(), "numpy": numpy.__version__,
                            "machine": platform.node(), "started": time.strftime(
                                "%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv[1:]}
    try:
        import chainer_recompute  # noqa: F401  (NumPy 2: before chainer)
        import chainer
        meta["chainer"] = chainer.__version__
    except Exception as e:  # noqa: BLE001
        meta["chainer"] = f"not importable: {e}"
    try:
        import cupy
        meta["cupy"] = cupy.__version__
        props = cupy.cuda.runtime.getDeviceProperties(0)
        meta["gpu"] = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    except Exception as e:  # noqa: BLE001
        meta["cupy"] = f"none ({type(e).__name__})"
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=str(ROOT),
                             capture_output=True, text=True, timeout=10)
        meta["commit"] = git.stdout.strip() or None
    except Exception:  # noqa: BLE001
        meta["commit"] = None
    return meta


# --------------------------------------------------------------------------
# The report.

def gb(b: Optional[float]) -> str:
    if b is None:
        return ""
    return f"{b / 1e9:.3f} GB" if b >= 1e8 else f"{b / 2**20:.2f} MiB"


def pct(r: Optional[float]) -> str:
    return "" if r is None else f"{100 * r:+.1f}%"


def secs(s: Optional[float]) -> str:
    return "" if s is None else (f"{s:.3f}" if s >= 0.01 else f"{s * 1e3:.2f} ms")


COLUMNS = ["section", "case", "budget", "predicted", "used peak", "pool total peak",
           "<= budget", "used / predicted", "identical", "s/iter (median)", "vs base (paired)",
           "verify=False s/iter", "vs base", "note"]


def row_cells(section: str, r: Dict[str, Any]) -> List[str]:
    used, budget, pred = r.get("used_peak_bytes"), r.get("budget_bytes"), r.get("predicted_bytes")
    total = r.get("pool_total_peak_bytes")
    fits = ""
    if used is not None and budget is not None:
        fits = "yes" if max(used, total or 0) <= budget else "**no**"
    ratio = f"{used / pred:.3f}" if used is not None and pred else ""
    ident = r.get("identical")
    return [section, r["case"], gb(budget), gb(pred), gb(used), gb(total), fits, ratio,
            "" if ident is None else str(ident), secs(r.get("time_s")), pct(r.get("vs_base")),
            secs(r.get("time_noverify_s")), pct(r.get("noverify_vs_base")),
            str(r.get("note", "")).replace("|", "/").replace("\n", " ")]


def write_report(out: Path, report: Dict[str, Any], wall_s: float) -> None:
    meta = report["meta"]
    lines = [f"Device {meta['device']}{' (--tiny)' if meta['tiny'] else ''}: "
             f"{meta.get('gpu', platform.processor() or 'CPU')}, Python {meta['python']}, "
             f"NumPy {meta['numpy']}, Chainer {meta.get('chainer')}, CuPy {meta.get('cupy')}, "
             f"commit {meta.get('commit')}; {wall_s:.0f} s in all. Peaks in the total scope "
             f"(parameters, gradients, optimizer state, inputs and the iteration's arrays).", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for s in report["sections"]:
        state = s["status"] + (f" in {s['wall_s']} s" if "wall_s" in s else "")
        if s["status"] != "ok":
            state += f": {s.get('reason', '')}"
        lines.append("| " + " | ".join([s["name"], f"*{state}*"] + [""] * (len(COLUMNS) - 3)
                                       + [""]) + " |")
        for r in s.get("rows", []):
            lines.append("| " + " | ".join(row_cells(s["name"], r)) + " |")
    (out / "gpu_run.md").write_text("\n".join(lines) + "\n")
    (out / "gpu_run.json").write_text(json.dumps(report, indent=1, default=str) + "\n")


# --------------------------------------------------------------------------
# A child: one section.

class Context:
    """What a section needs: the device, its array module and pool, where
    rows go."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tiny = args.tiny
        self.repeat = args.repeat
        self.rows_path = Path(args.out) / "rows" / f"{args.child}.jsonl"
        self.device_name = args.device
        self._dev: Any = None

    def emit(self, **row: Any) -> None:
        with open(self.rows_path, "a") as f:
            f.write(json.dumps(row, default=_plain) + "\n")
        print(json.dumps(row, default=_plain), flush=True)

    def close(self, **status: str) -> None:
        with open(self.rows_path, "a") as f:
            f.write(json.dumps({"_status": status}) + "\n")

    @property
    def gpu(self) -> bool:
        return "cupy" in self.device_name

    def need_cupy(self) -> Any:
        if not self.gpu:
            raise Skip(f"no CuPy: device {self.device_name}")
        try:
            import cupy
            cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # noqa: BLE001
            raise Skip(f"no CuPy ({type(e).__name__}: {e})")
        return cupy

    def setup(self) -> Tuple[Any, Any, Any, Any]:
        """``(chainer device, our Device, xp, CuPy pool or None)``."""
        if self.gpu:
            self.need_cupy()
        import chainer_recompute  # noqa: F401  (NumPy 2: before chainer)
        import chainer
        from chainer_recompute.runtime.device import device_of
        cdev = chainer.get_device(self.device_name)
        cdev.use()
        xp = cdev.xp
        dev = device_of([xp.zeros(1, "f")])
        pool = xp.get_default_memory_pool() if self.gpu else None
        return cdev, dev, xp, pool


def _plain(o: Any) -> Any:
    try:
        return o.item()
    except Exception:  # noqa: BLE001
        return str(o)


def child(args: argparse.Namespace) -> int:
    ctx = Context(args)
    name = args.child
    kind = next((s for s in section_table(name)), None)
    warnings.filterwarnings("ignore", message="A batch with no more than one sample")
    try:
        assert kind is not None
        _, k, _, _, batch = kind
        if k == "pytest":
            section_pytest(ctx)
        elif k in ("net", "net+nested", "least"):
            section_net(ctx, name, TINY_BATCH if ctx.tiny else batch, full=(k != "least"),
                        nested=(k == "net+nested"))
        elif k == "tc_overhead":
            section_tc_overhead(ctx, TINY_BATCH if ctx.tiny else batch)
        elif k == "workspace":
            section_workspace(ctx)
        elif k == "lstm":
            section_lstm(ctx)
        elif k == "lstm_graph":
            section_lstm_graph(ctx)
        elif k == "torch":
            section_torch(ctx, 2 if ctx.tiny else batch)
        ctx.close(ok="ok")
        return 0
    except Skip as e:
        ctx.close(skipped=f"skipped: {e}")
        return 0
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        ctx.close(error=f"{type(e).__name__}: {str(e)[:400]}")
        return 1


# --------------------------------------------------------------------------
# Sections.

def section_pytest(ctx: Context) -> None:
    ctx.need_cupy()
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                   if "mark.gpu" in p.read_text())
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfEs",
                           "-p", "no:cacheprovider", *files], cwd=str(ROOT),
                          capture_output=True, text=True)
    print(proc.stdout[-20000:], proc.stderr[-5000:], flush=True)
    tail = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    summary = tail[-1] if tail else proc.stderr.strip()[-300:]
    failed = [ln for ln in tail if ln.startswith(("FAILED", "ERROR"))]
    ctx.emit(case="pytest -m gpu", time_s=time.monotonic() - t0,
             note=f"{summary} (exit {proc.returncode}; {' '.join(files)})"
                  + (f"; {'; '.join(failed)[:600]}" if failed else ""))
    if proc.returncode not in (0, 5):
        raise RuntimeError(f"pytest -m gpu: {summary}")


# -- networks ----------------------------------------------------------------

class Step:
    """One measured training step of a model: forward, backward and the
    optimizer's update, after ``cleargrads()`` and with the pool's cached
    blocks freed, so that the pool's total is what this step added."""

    def __init__(self, dev: Any, pool: Any) -> None:
        self.dev, self.pool = dev, pool

    def __call__(self, model: Any, opt: Any, x: Any, t: Any) -> Dict[str, Any]:
        from chainer_recompute.runtime.memory import model_state_bytes
        model.cleargrads()
        gc.collect()
        self.dev.synchronize()
        if self.pool is not None:
            self.pool.free_all_blocks()
        s = model_state_bytes(model, opt)
        own = (s["params"] + s["grads"] + s["optimizer_state"]
               + self.dev.allocation_bytes(x.nbytes) + self.dev.allocation_bytes(t.nbytes))
        with self.dev.meter() as meter:
            t0 = time.perf_counter()
            loss = model(x, t)
            loss.backward()
            opt.update()
            self.dev.synchronize()
            elapsed = time.perf_counter() - t0
            loss_array = loss.array.copy()
            del loss
        m = meter.result
        total = None
        if m.total_peak_bytes is not None and m.start_total_bytes is not None:
            total = own + m.total_peak_bytes - m.start_total_bytes
        return {"time_s": elapsed, "used": own + m.peak_bytes, "total": total,
                "loss": loss_array}


def snapshot(model: Any, loss: Any) -> Dict[str, Any]:
    """Copies of what a step leaves: the loss, each parameter and its
    gradient, and each link's persistent values (BatchNorm statistics)."""
    snap: Dict[str, Any] = {"loss": loss, "params": {}, "grads": {}, "persistents": {}}
    for n, p in model.namedparams():
        snap["params"][n] = None if p.array is None else p.array.copy()
        snap["grads"][n] = None if p.grad is None else p.grad.copy()
    for path, link in model.namedlinks():
        for attr in getattr(link, "_persistent", ()):
            v = getattr(link, attr, None)
            snap["persistents"][f"{path}/{attr}"] = v.copy() if hasattr(v, "copy") else v
    return snap


def differences(xp: Any, a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
    """What differs, bit for bit, between two snapshots."""
    out = []
    if not bool(xp.array_equal(a["loss"], b["loss"])):
        out.append("loss")
    for part in ("params", "grads", "persistents"):
        for k, v in a[part].items():
            w = b[part].get(k)
            if hasattr(v, "shape") and hasattr(w, "shape"):
                same = bool(xp.array_equal(v, w))
            else:  # None (no gradient), a count
                same = not hasattr(v, "shape") and not hasattr(w, "shape") and v == w
            if not same:
                out.append(f"{part}:{k}")
    return out


def make_base(name: str, batch: int, small: bool, cdev: Any, xp: Any) -> Tuple[Any, Any, Any]:
    """A registry network on the device with its parameters initialised
    (seeded), and one batch ``(base, x, t)``."""
    import chainer
    from chainer_recompute.models import get_model
    from chainer_recompute.runtime.device import seed_all
    spec = get_model(name, batch_size=batch, small=small)
    x, t = spec.make_inputs(batch, xp=xp, seed=0)
    seed_all(0)
    base = get_model(name, batch_size=batch, small=small).link
    base.to_device(cdev)
    with chainer.no_backprop_mode(), chainer.using_config("train", False):
        base(x[:1], t[:1])  # lazily shaped parameters
    return base, x, t


def optimizer(model: Any) -> Any:
    import chainer
    opt = chainer.optimizers.MomentumSGD(lr=1e-4)
    opt.setup(model)
    return opt


def run_steps(model: Any, x: Any, t: Any, step: Step, n: int,
              plain: Optional[List[Dict[str, Any]]], xp: Any
              ) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]], List[str], List[Any]]:
    """``n`` seeded steps; against ``plain``'s snapshots when given.
    Returns (step results, snapshots, what differed, the runner's stats)."""
    import chainer_recompute as cr
    from chainer_recompute.runtime.device import seed_all
    opt = optimizer(model)
    results, snaps, diffs, stats = [], [], [], []
    for k in range(n):
        seed_all(100 + k)
        r = step(model, opt, x, t)
        results.append(r)
        snap = snapshot(model, r.pop("loss"))
        runner = cr.runner_of(model)
        st = runner.last_stats if runner is not None else None
        stats.append(None if st is None else {
            s: getattr(st, s, None) for s in ("path", "n_dropped", "recomputed_nodes", "reordered",
                                        "measured_peak_bytes", "measured_pool_total_bytes",
                                        "predicted_peak_bytes", "budget_bytes",
                                        "plain_peak_bytes")})
        if plain is not None:
            diffs += [f"step {k}: {d}" for d in differences(xp, plain[k], snap)]
            del snap
        else:
            snaps.append(snap)
    return results, snaps, diffs, stats


def under_limit(model: Any, x: Any, t: Any, step: Step, pool: Any, other_bytes: int,
                budget: int, n: int = 2) -> str:
    """``n`` steps with the pool's total limited to the budget plus
    ``other_bytes`` (the pool's total before the model was made, with its
    cached whole blocks given back); what happened."""
    if pool is None:
        return "no pool limit on NumPy"
    import cupy
    opt = optimizer(model)
    pool.set_limit(size=other_bytes + budget)
    try:
        for k in range(n):
            step(model, opt, x, t)
        return f"set_limit(budget): {n} steps, no OutOfMemoryError"
    except cupy.cuda.memory.OutOfMemoryError as e:
        return f"set_limit(budget): **OutOfMemoryError** at step {k}: {str(e)[:160]}"
    finally:
        pool.set_limit(size=0)


def timed_rounds(runs: Dict[str, Tuple[Any, Optional[Callable[[], None]]]], x: Any, t: Any,
                 dev: Any, warmup: int, repeat: int) -> Dict[str, List[float]]:
    """Seconds per training step of each run, interleaved: every round
    steps each run once (the order rotated from round to round, so that
    none always goes first), ``warmup`` rounds left out. A run is ``(model,
    before)``; ``before()`` sets the model's options for that step (two
    runs may share a model: ``verify`` on and off)."""
    opts = {id(m): optimizer(m) for m, _ in runs.values()}
    names = list(runs)
    times: Dict[str, List[float]] = {k: [] for k in names}
    for r in range(warmup + repeat):
        k0 = r % len(names)
        for k in names[k0:] + names[:k0]:
            model, before = runs[k]
            if before is not None:
                before()
            model.cleargrads()
            gc.collect()
            dev.synchronize()
            t0 = time.perf_counter()
            loss = model(x, t)
            loss.backward()
            opts[id(model)].update()
            dev.synchronize()
            dt = time.perf_counter() - t0
            del loss
            if r >= warmup:
                times[k].append(dt)
    return times


def paired(ts: List[float], base: List[float]) -> float:
    """The median over rounds of each round's time against the base's."""
    return statistics.median(a / b - 1 for a, b in zip(ts, base))


def save_graphs(ctx: Context, name: str, model: Any) -> None:
    """The model's planned graphs, recorded on this device, as
    ``OUT/graphs/NAME-K.json`` (in ``logs.tar.gz`` with ``--bundle``): what
    the memory model predicted from, to replay on another machine."""
    import chainer_recompute as cr
    from chainer_recompute.core.io import save_graph
    folder = Path(ctx.args.out) / "graphs"
    folder.mkdir(exist_ok=True)
    for k, g in enumerate(cr.runner_of(model).planned_graphs()):
        save_graph(g, folder / f"{name}-{k}.json")


def nested_least(least_model: Any) -> Optional[int]:
    """The least budget with nested recomputation (issue 35), from the
    graph the least plan was made from, as ``apply()`` searches it below
    the single-level least (``BudgetSearch.nested_least``, with the
    planner's headroom)."""
    import chainer_recompute as cr
    from chainer_recompute.core.budget import BudgetSearch, least_for
    got = BudgetSearch(cr.runner_of(least_model).planned_graphs()[-1], "auto").nested_least()
    return None if got is None else least_for(got[1])


def section_net(ctx: Context, name: str, batch: int, full: bool, nested: bool = False) -> None:
    import chainer_recompute as cr
    cdev, dev, xp, pool = ctx.setup()
    base, x, t = make_base(name, batch, ctx.tiny, cdev, xp)
    step = Step(dev, pool)
    # Four steps: the first may record or be planned from captures (and
    # correct the plan after it), peaks are read on the last two.
    n_steps = 4
    size = f"{name} b{batch}{' small' if ctx.tiny else ''}"
    # plain Chainer: the reference snapshots and the vanilla peaks
    models = {"vanilla": copy.deepcopy(base)}
    res, plain_snaps, _, _ = run_steps(models["vanilla"], x, t, step, n_steps, None, xp)
    vanilla_used = max(r["used"] for r in res[2:])
    totals = [r["total"] for r in res[2:] if r["total"] is not None]
    ctx.emit(case="vanilla", used_peak_bytes=vanilla_used,
             pool_total_peak_bytes=max(totals) if totals else None,
             step_times_s=[r["time_s"] for r in res],
             time_s=None if full else statistics.median(r["time_s"] for r in res[1:]),
             note=f"{size}; peaks of steps 3-{n_steps}" + ("" if full else
                                                           "; time: steps 2-4, not paired"))
    budgets: Dict[str, Any] = {"least": "least"}
    found = ""
    labels = ("least", "half", "nested") if nested else ("least", "half") if full else ("least",)
    for label in labels:
        if label != "least" and "least" not in models:
            ctx.emit(case=label, note="not run: no least plan ran")
            continue
        if label == "nested":  # below the single-level least (issue 35)
            t0 = time.monotonic()
            try:
                below = nested_least(models["least"])
            except Exception as e:  # noqa: BLE001  (said; the timing rounds still run)
                traceback.print_exc()
                ctx.emit(case=label, note=f"the nested least not found: {type(e).__name__}: "
                                          f"{str(e)[:300]}")
                continue
            if below is None or below >= budgets["least_bytes"]:
                ctx.emit(case=label, note=f"not run: no nested plan below the single-level "
                                          f"least {gb(budgets['least_bytes'])}")
                continue
            budgets["nested"] = below
            found = (f"the nested least, {100 * (below / budgets['least_bytes'] - 1):+.1f}% "
                     f"against the single-level least (found in {time.monotonic() - t0:.1f} s); ")
        if label == "half":
            if vanilla_used <= budgets["least_bytes"]:
                ctx.emit(case=label, note=f"not run: plain's peak {gb(vanilla_used)} is at or "
                                          f"under the least budget {gb(budgets['least_bytes'])}")
                continue
            budgets["half"] = int(budgets["least_bytes"]
                                  + (vanilla_used - budgets["least_bytes"]) // 2)
        if pool is not None:
            gc.collect()
            pool.free_all_blocks()
        # what the pool holds now and cannot give back (the other models'
        # arrays and the cached fragments of their blocks): the limit below
        # bounds the pool's total, so the budget is added to this
        other = int(pool.total_bytes()) if pool is not None else 0
        model = cr.apply(copy.deepcopy(base), budget=budgets[label], verbose=False)
        try:
            res, _, diffs, stats = run_steps(model, x, t, step, n_steps, plain_snaps, xp)
        except cr.RecomputeError as e:  # an infeasible budget: said, the rest goes on
            ctx.emit(case=label, budget_bytes=budgets[label] if label != "least" else None,
                     note=f"{type(e).__name__}: {str(e)[:300]}")
            continue
        models[label] = model
        if label == "least":  # the graph as recorded here, to replay elsewhere (core.io)
            save_graphs(ctx, name, model)
        planned = [(r, s) for r, s in zip(res, stats) if s and s["path"] == "planned"]
        last = planned[-1][1] if planned else (stats[-1] or {})
        if label == "least":  # before any correction of the plan after a step
            budgets["least_bytes"] = min((s["budget_bytes"] for _, s in planned
                                          if s["budget_bytes"]), default=vanilla_used)
        settled = planned[-2:]
        used = max((r["used"] for r, _ in settled), default=None)
        total = max((r["total"] for r, _ in settled if r["total"] is not None), default=None)
        budgets_seen = sorted({s["budget_bytes"] for _, s in planned if s["budget_bytes"]})
        limit = (under_limit(model, x, t, step, pool, other, last["budget_bytes"])
                 if last.get("budget_bytes") else "no budget")
        paths = ",".join(s["path"] if s else "-" for s in stats)
        ctx.emit(case=label, budget_bytes=last.get("budget_bytes"),
                 predicted_bytes=last.get("predicted_peak_bytes"),
                 used_peak_bytes=used, pool_total_peak_bytes=total,
                 runner_measured_bytes=last.get("measured_peak_bytes"),
                 runner_pool_total_bytes=last.get("measured_pool_total_bytes"),
                 identical=not diffs, differences=diffs[:20], stats=stats,
                 step_times_s=[r["time_s"] for r in res],
                 time_s=None if full else statistics.median(r["time_s"] for r in res[1:]),
                 note=(found if label == "nested" else "") + f"steps {paths}"
                      + (f" (budget corrected: {' -> '.join(gb(b) for b in budgets_seen)})"
                         if len(budgets_seen) > 1 else "")
                      + f"; peaks of the last two planned; dropped {last.get('n_dropped')}, "
                      f"recomputed {last.get('recomputed_nodes')}"
                      + ("; backward in another order" if last.get("reordered") else "")
                      + "; the runner's own figures: used "
                      f"{gb(last.get('measured_peak_bytes'))}, pool total "
                      f"{gb(last.get('measured_pool_total_bytes'))}; {limit}"
                      + (f"; differ: {', '.join(diffs[:3])}" if diffs else ""))
    del plain_snaps
    if not full:
        return
    # Time: the same models, verify on and off in turn (no new plans).
    runs: Dict[str, Tuple[Any, Optional[Callable[[], None]]]] = {
        "vanilla": (models["vanilla"], None)}
    timed = [label for label in ("least", "half", "nested") if label in models]
    for label in timed:
        runner = cr.runner_of(models[label])
        runs[label] = (models[label], lambda r=runner: setattr(r, "verify", True))
        runs[f"{label}/no-verify"] = (models[label],
                                      lambda r=runner: setattr(r, "verify", False))
    times = timed_rounds(runs, x, t, dev, 2, ctx.repeat)
    base_t = times["vanilla"]
    ctx.emit(case="vanilla", time_s=statistics.median(base_t), times_s=base_t)
    for label in timed:
        ts, nv = times[label], times[f"{label}/no-verify"]
        ctx.emit(case=label, time_s=statistics.median(ts), vs_base=paired(ts, base_t),
                 times_s=ts, time_noverify_s=statistics.median(nv),
                 noverify_vs_base=paired(nv, base_t), times_noverify_s=nv)


def section_tc_overhead(ctx: Context, batch: int) -> None:
    import chainer_recompute as cr
    cdev, dev, xp, pool = ctx.setup()
    name = "resnet152"
    small = " small" if ctx.tiny else ""
    base, x, t = make_base(name, batch, ctx.tiny, cdev, xp)
    step = Step(dev, pool)
    plain = copy.deepcopy(base)
    res, _, _, _ = run_steps(plain, x, t, step, 2, None, xp)
    m_bytes = max(res[-1]["used"], res[-1]["total"] or 0)
    ctx.emit(case=f"plain b{batch}: M", used_peak_bytes=res[-1]["used"],
             pool_total_peak_bytes=res[-1]["total"],
             note=f"{name}{small}: M, the memory in which plain Chainer's largest batch "
                  f"is {batch}")
    # The executor's own cost: a budget that drops nothing, as it runs by
    # default (plain Chainer once checked) and with its hook kept on.
    keep = cr.apply(copy.deepcopy(base), budget=2 * m_bytes, verbose=False)
    runner = cr.runner_of(keep)
    _, _, _, stats = run_steps(keep, x, t, step, 2 + runner.spec.check_iterations, None, xp)

    def options(plain_when_nothing_dropped: bool, verify: bool) -> Callable[[], None]:
        def set_() -> None:
            runner.plain_when_nothing_dropped = plain_when_nothing_dropped
            runner.spec = dataclasses.replace(runner.spec, verify=verify)
        return set_

    times = timed_rounds({"plain": (plain, None), "keep": (keep, options(True, True)),
                          "hooked": (keep, options(False, False))}, x, t, dev, 2, ctx.repeat)
    ctx.emit(case=f"plain b{batch}", time_s=statistics.median(times["plain"]))
    ctx.emit(case=f"b{batch} budget 2M, nothing dropped", budget_bytes=2 * m_bytes,
             time_s=statistics.median(times["keep"]), vs_base=paired(times["keep"], times["plain"]),
             note=f"default options: plain Chainer once checked; dropped "
                  f"{(stats[-1] or {}).get('n_dropped')}; goal at most +3%")
    ctx.emit(case=f"b{batch} budget 2M, executor hook on", budget_bytes=2 * m_bytes,
             time_s=statistics.median(times["hooked"]),
             vs_base=paired(times["hooked"], times["plain"]),
             note="plain_when_nothing_dropped=False, verify=False: every function "
                  "checked against the plan; goal at most +3%")
    del base, plain, keep
    gc.collect()
    # Time-centric DP at twice plain's largest batch, in M.
    b2 = 2 * batch
    base2, x2, t2 = make_base(name, b2, ctx.tiny, cdev, xp)
    plain2 = copy.deepcopy(base2)
    tc = cr.apply(copy.deepcopy(base2), budget=m_bytes, solver="approx", strategy="tc",
                  verbose=False)
    res2, _, _, stats = run_steps(tc, x2, t2, step, 3, None, xp)
    last = next((s for s in reversed(stats) if s and s["path"] == "planned"), stats[-1] or {})
    times = timed_rounds({"plain": (plain2, None), "tc": (tc, None)}, x2, t2, dev, 2, ctx.repeat)
    ctx.emit(case=f"plain b{b2}", time_s=statistics.median(times["plain"]),
             note="no budget (over M)")
    ctx.emit(case=f"TC b{b2} in M", budget_bytes=last.get("budget_bytes"),
             predicted_bytes=last.get("predicted_peak_bytes"),
             used_peak_bytes=max(r["used"] for r in res2[1:]),
             pool_total_peak_bytes=res2[-1]["total"], stats=stats,
             time_s=statistics.median(times["tc"]), vs_base=paired(times["tc"], times["plain"]),
             note=f"approx DP, TC; steps {','.join(s['path'] if s else '-' for s in stats)}; "
                  f"dropped {last.get('n_dropped')}, recomputed {last.get('recomputed_nodes')}; "
                  f"target at most +15% (poster +12%)")


# -- workspace kernels ---------------------------------------------------------

def section_workspace(ctx: Context) -> None:
    import workspace_cost
    from chainer_recompute.core.units import parse_bytes
    cdev, dev, xp, pool = ctx.setup()
    net, batch, small, limit = ("unet", 2, True, "256K") if ctx.tiny else \
        ("vgg19", 8, False, "128M")
    k = workspace_cost.kernels(net, batch, small, parse_bytes(limit), max(ctx.repeat, 2),
                               device=cdev)
    for variant in k["median_s"]:
        if variant == "plain":
            continue
        ctx.emit(case=f"{variant} kernels", identical=k["bit_identical_grads"][variant],
                 time_s=k["median_s"][variant], vs_base=k["vs_plain_paired"][variant],
                 note=f"{net} b{batch}{' small' if small else ''}, bound {limit}; Chainer's own "
                      f"{secs(k['median_s']['plain'])} s; max relative gradient difference "
                      f"{k['max_rel_diff'][variant]:.2e}; calls {k['calls'].get(variant)}")


# -- LSTM ----------------------------------------------------------------------

def _lstm(ctx: Context, T: int, dropout: float) -> Tuple[Any, ...]:
    """experiments/bptt.py's PTB LSTM on this device over ``T`` steps:
    ``(args, model, optimizer, data, plain BPTT, xp, seeded)``, where
    ``seeded(fn)`` runs one update by ``fn`` from the parameters the model
    started with, the random generators seeded alike (dropout), and gives
    its result and the gradients."""
    import bptt as B
    from chainer_recompute.runtime.device import seed_all
    import numpy
    cdev, dev, xp, pool = ctx.setup()
    args = argparse.Namespace(vocab=100, units=32, batch=8, dropout=dropout)
    model, opt = B.make(args)
    model.to_device(cdev)
    data = xp.asarray(numpy.random.RandomState(1).randint(
        0, args.vocab, (T + 1, args.batch)).astype(numpy.int32))
    plain = B.plain_fn(model)
    B.iterate(plain, model, opt, data)  # warm-up (lazy initialisation)
    start = {n: p.array.copy() for n, p in model.namedparams()}

    def seeded(fn: Callable[[Any, Any], Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        for n, p in model.namedparams():
            p.array[...] = start[n]
        seed_all(7)
        r = B.iterate(fn, model, opt, data)
        return r, {n: p.grad.copy() for n, p in model.namedparams()}

    return args, model, opt, data, plain, xp, seeded


def section_lstm(ctx: Context) -> None:
    import bptt as B
    import chainer_recompute as cr
    from chainer_recompute.runtime import bptt as cr_bptt
    T = 300 if ctx.tiny else 1000
    args, model, opt, data, plain, xp, seeded = _lstm(ctx, T, dropout=0.5)
    xs, ts = data[:-1], data[1:]
    ref, ref_grads = seeded(plain)
    plain_peak = ref["peak_bytes"]
    note = (f"t={T}, PTB LSTM (vocab {args.vocab}, units {args.units}, batch {args.batch}, "
            f"dropout {args.dropout})")
    ctx.emit(case="plain BPTT", used_peak_bytes=plain_peak, note=note)
    methods: Dict[str, Callable[[], Dict[str, float]]] = {
        "plain": lambda: B.iterate(plain, model, opt, data)}
    rows: Dict[str, Dict[str, Any]] = {}
    for policy in ("msm", "ism"):
        # 5% and 10% of plain's peak (Gruslys et al.), the first timed; where
        # 5% is below the least the policy reaches on this device (on CuPy
        # every array takes a multiple of 512 bytes), 10% is timed instead
        # (at the least itself, one slot, the schedule is quadratic in t)
        timed_next = True
        for frac in (0.05, 0.10):
            label = f"{policy} at {frac:.0%} of plain"
            budget = int(frac * plain_peak)
            timed, timed_next = timed_next, False
            model.predictor.reset_state()
            try:
                runner = cr_bptt.ChainRecompute(model, policy=policy, budget=budget)
                st = runner.predict(xs, ts)
                seeded(runner)  # the first call measures the cell and plans
                r, grads = seeded(runner)
            except cr.RecomputeError as e:  # infeasible: said, not run
                ctx.emit(case=label, budget_bytes=budget,
                         note=f"{type(e).__name__}: {str(e)[:200]}")
                timed_next = timed
                continue
            same = all(bool(xp.array_equal(ref_grads[n], g)) for n, g in grads.items())
            rows[label] = dict(case=label, budget_bytes=budget,
                               predicted_bytes=runner.last_stats.predicted_peak_bytes,
                               used_peak_bytes=r["peak_bytes"], identical=same,
                               note=f"t={T}, {st.forward_steps} forward steps (plain {T}), "
                                    f"{st.slots} slots; vs plain "
                                    f"{pct(r['peak_bytes'] / plain_peak - 1)} memory")
            ctx.emit(**rows[label])
            if timed:  # Gruslys et al.'s 95% less memory, or 90% where that is infeasible
                methods[label] = (lambda rr=runner: B.iterate(rr, model, opt, data))
    runs = B.interleaved(methods, 2 if ctx.tiny else 3)
    base = [r["time_s"] for r in runs["plain"]]
    ctx.emit(case="plain BPTT", time_s=statistics.median(base))
    for label in rows:
        if label not in runs:
            continue
        s = B.summary(runs[label])
        ratio = statistics.median(r["time_s"] / r["plain_time_s"] - 1 for r in runs[label])
        ctx.emit(case=label, time_s=s["time_median_s"], vs_base=ratio)


def section_lstm_graph(ctx: Context) -> None:
    """Issue 35's LSTM target on this device: the t = 30 unroll of Chainer's
    PTB LSTM without dropout (experiments/nested.md's rows) through
    ``apply()`` against MSM and ISM at the budgets 10% and 25% of the way
    from the chain policies' least to plain's measured peak (10 and 25
    slots on NumPy); gradients against plain's from the same parameters,
    then time, paired with plain's, every method in each round (``--tiny``:
    over 10 steps)."""
    import bptt as B
    import chainer_recompute as cr
    from chainer_recompute.runtime import bptt as cr_bptt
    T = 10 if ctx.tiny else 30
    args, model, opt, data, plain, xp, seeded = _lstm(ctx, T, dropout=0.0)
    xs, ts = data[:-1], data[1:]
    ref, ref_grads = seeded(plain)
    plain_peak = ref["peak_bytes"]
    least = min(cr_bptt.ChainRecompute(model, policy=policy, budget="least").predict(
        xs, ts).predicted_peak_bytes for policy in ("hsm", "ism", "msm", "revolve"))
    note = (f"t={T}, PTB LSTM (vocab {args.vocab}, units {args.units}, batch {args.batch}, "
            f"no dropout)")
    ctx.emit(case="plain BPTT", used_peak_bytes=plain_peak,
             note=f"{note}; the chain policies' least {least} B")
    methods: Dict[str, Callable[[], Dict[str, float]]] = {
        "plain": lambda: B.iterate(plain, model, opt, data)}
    labels = []
    for frac in (0.10, 0.25):
        budget = int(least + frac * (plain_peak - least))
        for policy in ("msm", "ism", "apply"):
            label = f"{policy} at {frac:.0%}"
            model.predictor.reset_state()
            try:
                if policy == "apply":
                    u = B.Unrolled(model)
                    cr.apply(u, budget=budget, verbose=False)
                    fn: Callable[[Any, Any], Any] = (lambda a, b, u=u: u(a, b))
                    B.iterate(fn, model, opt, data)  # records
                    B.iterate(fn, model, opt, data)  # plans
                    # (on NumPy this step's meter sees the arrays of the graph
                    # the runner predicts again at the call, not the free of
                    # the earlier ones, made before it: experiments/nested.md,
                    # "A step over its budget, traced")
                    B.iterate(fn, model, opt, data)
                else:
                    fn = cr_bptt.ChainRecompute(model, policy=policy, budget=budget)
                    fn.predict(xs, ts)
                    B.iterate(fn, model, opt, data)  # measures the cell, plans
                r, grads = seeded(fn)
            except cr.RecomputeError as e:  # infeasible: said, not run
                ctx.emit(case=label, budget_bytes=budget,
                         note=f"{type(e).__name__}: {str(e)[:200]}")
                continue
            st = cr.runner_of(u).last_stats if policy == "apply" else fn.last_stats
            same = all(bool(xp.array_equal(ref_grads[n], g)) for n, g in grads.items())
            extra = (f"{st.recomputed_nodes} functions recomputed ({st.path})"
                     if policy == "apply" else
                     f"{st.forward_steps} forward steps, {st.slots} slots")
            ctx.emit(case=label, budget_bytes=budget, predicted_bytes=st.predicted_peak_bytes,
                     used_peak_bytes=r["peak_bytes"], identical=same,
                     note=f"{extra}; vs plain {pct(r['peak_bytes'] / plain_peak - 1)} memory")
            methods[label] = (lambda f=fn: B.iterate(f, model, opt, data))
            labels.append(label)
    runs = B.interleaved(methods, 2 if ctx.tiny else 5)
    ctx.emit(case="plain BPTT", time_s=statistics.median(r["time_s"] for r in runs["plain"]))
    for label in labels:
        ratio = statistics.median(r["time_s"] / r["plain_time_s"] - 1 for r in runs[label])
        ctx.emit(case=label, time_s=B.summary(runs[label])["time_median_s"], vs_base=ratio)


# -- torch ---------------------------------------------------------------------

def section_torch(ctx: Context, batch: int) -> None:
    try:
        import torch
    except ImportError:
        raise Skip("no torch")
    if not torch.cuda.is_available() or not ctx.gpu:
        raise Skip(f"no CUDA for torch (device {ctx.device_name})")
    try:
        import torchvision
        net = torchvision.models.resnet50(weights=None)
        source = f"torchvision {torchvision.__version__}"
    except ImportError:
        raise Skip("no torchvision")
    from torch.utils.checkpoint import checkpoint
    dev = torch.device("cuda")
    net = net.to(dev).train()
    state = copy.deepcopy(net.state_dict())
    opt = torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9)
    torch.manual_seed(0)
    x = torch.randn(batch, 3, 224, 224, device=dev)
    t = torch.randint(0, 1000, (batch,), device=dev)
    stages = [net.layer1, net.layer2, net.layer3, net.layer4]

    def forward(ckpt: bool) -> Any:
        h = net.maxpool(net.relu(net.bn1(net.conv1(x))))
        for s in stages:
            h = checkpoint(s, h, use_reentrant=False) if ckpt else s(h)
        h = torch.flatten(net.avgpool(h), 1)
        return torch.nn.functional.cross_entropy(net.fc(h), t)

    def one(ckpt: bool) -> Tuple[float, int]:
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        forward(ckpt).backward()
        opt.step()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, torch.cuda.max_memory_allocated()

    runs: Dict[bool, List[Tuple[float, int]]] = {False: [], True: []}
    net.load_state_dict(state)
    for k in range(2 + ctx.repeat):
        for ckpt in ((False, True) if k % 2 == 0 else (True, False)):
            runs[ckpt].append(one(ckpt))
    plain = [r[0] for r in runs[False][2:]]
    for ckpt, label in ((False, "torch plain"), (True, "torch checkpoint x4 stages")):
        ts = [r[0] for r in runs[ckpt][2:]]
        ctx.emit(case=label, used_peak_bytes=max(r[1] for r in runs[ckpt][2:]),
                 time_s=statistics.median(ts),
                 vs_base=statistics.median(a / b - 1 for a, b in zip(ts, plain)),
                 note=f"{source} ResNet50 b{batch}, torch {torch.__version__}; "
                      f"torch.cuda.max_memory_allocated")


# --------------------------------------------------------------------------

def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="folder for gpu_run.md, gpu_run.json, rows/ and logs/")
    p.add_argument("--device", default="@cupy:0")
    p.add_argument("--tiny", action="store_true",
                   help=f"the registry's small networks at batch {TINY_BATCH}, t=300 LSTM")
    p.add_argument("--sections", help="comma-separated, among: "
                   + ", ".join(s[0] for s in SECTIONS) + " (or a registry network)")
    p.add_argument("--repeat", type=int, default=None,
                   help="timed steps per configuration after the warm-up (5; --tiny: 2)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="the whole run's seconds; sections past it are skipped "
                        "(510; --tiny: 3600)")
    p.add_argument("--bundle", metavar="DIR",
                   help="after each section, copy gpu_run.md, gpu_run.json and logs.tar.gz "
                        "(logs/, rows/, graphs/, setup.log) there: three files")
    p.add_argument("--box-scale", type=float, default=1.0, help="multiply every time box")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeat is None:
        args.repeat = 2 if args.tiny else 5
    if args.deadline_s is None:
        args.deadline_s = 3600.0 if args.tiny else 510.0
    if args.child:
        return child(args)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
