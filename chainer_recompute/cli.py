"""The command line: plan recomputation for a network (or a saved graph),
show what it saves, and optionally run and measure it.

::

    chainer-recompute --model resnet152 --budget 8G --dry-run
    chainer-recompute --model resnet50 --small --batch-size 8 --iterations 3 --vanilla
    chainer-recompute --graph cg_unet.txt --solver exact --budget 6GB
    chainer-recompute plot out/report.json

(``.venv/bin/python scripts/run_schedule.py`` is the same command without
installing.) Sizes are binary throughout: ``8G`` is 8 GiB, as a GPU's
memory is counted; ``8GB`` is 8·10^9 bytes. Bad input exits with code 2
and one line naming the problem and the accepted forms (``-v`` adds the
traceback); errors of the library (:class:`~chainer_recompute.core.errors.RecomputeError`)
exit the same way.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shlex
import sys
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from .core.units import ACCEPTED_FORMS, format_bytes, format_bytes_up, parse_bytes

logger = logging.getLogger(__name__)

PROG = "chainer-recompute"
SOLVERS = ("auto", "hier", "approx", "exact", "chen", "chen-greedy", "none")
SCOPES = ("total", "activations")
#: Exit status of every bad input.
EXIT_USAGE = 2
REPORT_VERSION = 1
DEVICE_FORMS = "@numpy, @cupy:N (needs CuPy and a GPU), @intel64 (needs iDeep)"


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors raised as one-line :class:`UsageError`."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number; accepted: a positive integer such as 1, 8 "
            f"or 32") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not positive; accepted: a positive "
                                         f"integer such as 1, 8 or 32")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number; accepted: 0 or a positive integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative; accepted: 0 or a positive "
                                         f"integer")
    return value


def _budget(text: str) -> str:
    """``least`` or a size that :func:`parse_bytes` reads, kept as typed."""
    if text.strip().lower() == "least":
        return "least"
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is negative; accepted: 'least' or a positive size: {ACCEPTED_FORMS}")
    from .core.errors import BudgetError
    try:
        parse_bytes(text)
    except BudgetError as e:
        raise argparse.ArgumentTypeError(f"{e} (or 'least')") from None
    return text.strip()


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default, unless it is None (its help says what
    happens then) or False (a plain switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False):
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from .models import MODELS
    p = _Parser(
        prog=PROG,
        description="Find a recomputation plan for a memory budget (Kusumoto et al., "
                    "NeurIPS 2019) for one of the paper's networks or a saved graph: plain "
                    "backprop's predicted peak, the plan's, the saving and the recompute "
                    "overhead; optionally run training iterations and measure them. "
                    f"'{PROG} plot REPORT.json' redraws the figures of --out.",
        epilog="Sizes are binary: 8G = 8GiB = 8*2^30 bytes; 8GB = 8*10^9 bytes.",
        formatter_class=_DefaultsFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="mlp", choices=sorted(MODELS), metavar="NAME",
                     help=f"network to plan: {', '.join(sorted(MODELS))}")
    src.add_argument("--graph", metavar="PATH",
                     help="plan a saved graph instead: this project's JSON (--save-graph), "
                          "or the authors' text format (cg_*.txt)")
    p.add_argument("--budget", default="least", type=_budget, metavar="SIZE",
                   help="memory budget: 'least' (the least feasible budget) or a size: "
                        f"{ACCEPTED_FORMS}. G means GiB (2^30), GB means 10^9")
    p.add_argument("--budget-scope", choices=SCOPES, default=None,
                   help="what the budget bounds: 'total': the whole iteration (parameters, "
                        "gradients, optimizer state, activations, temporaries: what the device "
                        "shows); 'activations': the paper's model of activations and their "
                        "gradients only (default: total; activations for the authors' "
                        "cg_*.txt graphs, which record nothing else)")
    p.add_argument("--batch-size", type=_positive_int, default=None, metavar="N",
                   help="batch size (default: the paper's for the network)")
    p.add_argument("--small", action="store_true",
                   help="the reduced variant of the network (quick CPU runs)")
    p.add_argument("--solver", default="auto", choices=SOLVERS,
                   help="auto (default): hier on graphs of 1,000+ nodes with repeated layers or "
                   "steps, approx otherwise; hier: hierarchical DP (each distinct layer planned "
                   "once, then chained); approx: approximate DP; exact: exhaustive exact DP; "
                   "chen: Chen et "
                   "al.'s sqrt(n) (budget ignored); chen-greedy: Chen's budgeted greedy; "
                   "none: plain backprop")
    p.add_argument("--strategy", default="tc", choices=("tc", "mc"),
                   help="tc: least recomputation; mc: least memory")
    p.add_argument("--cost", default="measured", choices=("measured", "flops", "paper"),
                   help="cost model T_v for the solver")
    p.add_argument("--workspace", default=None, metavar="SIZE|auto",
                   help="bound one convolution call's column buffer: a size ('64M') or "
                        "auto (chosen with the plan); calls over it build it in one copy, "
                        "bit-identical (default: Chainer's kernels)")
    p.add_argument("--dry-run", action="store_true",
                   help="plan only (the default without --iterations), and say so: the graph "
                        "is recorded at --capture-batch and scaled; nothing runs at the full "
                        "batch")
    p.add_argument("--capture-batch", type=_count, default=1, metavar="N",
                   help="record the graph at this batch size and scale it linearly to "
                        "--batch-size; 0: record at the full batch")
    p.add_argument("--capture-input", choices=("auto", "full"), default="auto",
                   help="auto: the segmentation networks (unet, pspnet) are recorded at three "
                        "smaller input sizes and extrapolated to theirs; full: at their size")
    p.add_argument("--iterations", type=_count, default=0, metavar="N",
                   help="training iterations to run with the plan (0: plan only); the "
                        "first (recorded) and second (planned) are left out of the averages")
    p.add_argument("--vanilla", action="store_true",
                   help="with --iterations: also run plain Chainer and measure it")
    p.add_argument("--check-gradients", action="store_true",
                   help="compare one step's loss and gradients with plain backprop")
    p.add_argument("--device", default="@numpy",
                   help=f"Chainer device: {DEVICE_FORMS}")
    p.add_argument("--out", metavar="DIR",
                   help="write report.json, memory.png and schedule.png there")
    p.add_argument("--save-graph", metavar="PATH", help="write the graph as JSON")
    p.add_argument("--json", metavar="PATH", help="write the report (report.json's content) "
                                                  "to PATH")
    p.add_argument("--seed", type=int, default=0, help="model initialisation seed")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log planning details; tracebacks on errors")
    return p


_VALUE_OPTIONS = ("--budget", "--batch-size", "--capture-batch", "--iterations", "--seed",
                  "--workspace")


def _join_negative_values(argv: Sequence[str]) -> List[str]:
    """``--budget -1G`` -> ``--budget=-1G``: argparse would take ``-1G``
    for an option and say "expected one argument"."""
    out: List[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok in _VALUE_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and not argv[i + 1].startswith("--") and argv[i + 1] not in ("-v", "-q", "-h"):
            out.append(f"{tok}={argv[i + 1]}")
            i += 2
            continue
        out.append(tok)
        i += 1
    return out


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plot":
        return plot_main(argv[1:])
    verbose = "-v" in argv or "--verbose" in argv
    from .core.errors import RecomputeError
    restore_logging = None
    try:
        args = build_parser().parse_args(_join_negative_values(argv))
        restore_logging = _configure_logging(args.verbose)
        return _run(args)
    except UsageError as e:
        return _fail(e, verbose, EXIT_USAGE)
    except RecomputeError as e:
        return _fail(e, verbose, EXIT_USAGE)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - a bug: one line unless -v
        return _fail(f"{type(e).__name__}: {e} (a bug? run with -v for the traceback)",
                     verbose, 1)
    finally:
        if restore_logging is not None:
            restore_logging()


def _fail(error: Any, verbose: bool, code: int) -> int:
    if verbose and isinstance(error, BaseException):
        traceback.print_exception(type(error), error, error.__traceback__)
    elif verbose and sys.exc_info()[0] is not None:
        traceback.print_exc()
    print(f"{PROG}: error: {_one_line(error)}", file=sys.stderr)
    return code


def _configure_logging(verbose: bool) -> Callable[[], None]:
    """Route the library's log to stderr for this run; returns the function
    that puts the caller's configuration back (main() called from Python
    leaves the process's logging as it found it)."""
    root = logging.getLogger("chainer_recompute")
    saved = (root.level, root.propagate)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.propagate = False
    root.setLevel(logging.INFO if verbose else logging.WARNING)

    def restore() -> None:
        root.removeHandler(handler)
        root.setLevel(saved[0])
        root.propagate = saved[1]
    return restore


# ------------------------------------------------------------------ run
def _run(args: argparse.Namespace) -> int:
    from .progress import Progress
    if args.graph and (args.iterations or args.check_gradients):
        raise UsageError("--iterations and --check-gradients need --model (a saved graph "
                         "cannot be run)")
    if args.dry_run and (args.iterations or args.check_gradients):
        raise UsageError("--dry-run plans only; drop it to run --iterations or "
                         "--check-gradients")
    if args.vanilla and not args.iterations:
        raise UsageError("--vanilla runs plain Chainer beside the plan during --iterations; "
                         "add --iterations N")
    out_dir = _prepare_out(args.out) if args.out else None
    progress = Progress(enabled=not args.quiet)
    if args.graph:
        graph, source = _load_graph(args)
    else:
        graph, source = _record_model(args, progress)
    if args.save_graph:
        from .core.io import save_graph
        save_graph(graph, args.save_graph)
    scope = args.budget_scope or source.pop("default_scope", "total")
    source.pop("default_scope", None)
    subject = (f"{args.model} at batch {source['batch_size']}" if not args.graph
               else os.path.basename(args.graph))
    report = plan_report(graph, args.budget, solver=args.solver, strategy=args.strategy,
                         workspace=_workspace(args),
                         scope=scope, progress=progress, subject=subject)
    report["source"] = source
    report["command"] = " ".join([PROG] + [shlex.quote(a) for a in _argv_of(args)])
    if args.check_gradients:
        same = _check_gradients(args, report)
        report["gradients_identical"] = same
    if args.iterations:
        report["runs"] = _run_iterations(args, report, progress)
    report["next_command"] = _next_command(args, report)
    print(format_report(report))
    if args.json:
        _write_json(report, args.json)
    if out_dir is not None:
        _write_json(report, os.path.join(out_dir, "report.json"))
        written = _draw(report, out_dir)
        print(f"wrote {os.path.join(out_dir, 'report.json')}"
              + "".join(f", {p}" for p in written))
    if args.check_gradients and not report["gradients_identical"]:
        return 1
    return 0


def _argv_of(args: argparse.Namespace) -> List[str]:
    """The options that define the plan, as a user would type them."""
    out: List[str] = []
    if args.graph:
        out += ["--graph", args.graph]
    else:
        out += ["--model", args.model]
        if args.batch_size:
            out += ["--batch-size", str(args.batch_size)]
        if args.small:
            out.append("--small")
    out += ["--budget", args.budget]
    for flag, value, default in (("--budget-scope", args.budget_scope, None),
                                 ("--solver", args.solver, "auto"),
                                 ("--strategy", args.strategy, "tc"),
                                 ("--cost", args.cost, "measured"),
                                 ("--device", args.device, "@numpy")):
        if value != default:
            out += [flag, value]
    return out


def _prepare_out(path: str) -> str:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {path}: cannot create the folder ({e.strerror}); accepted: "
                         f"a writable folder") from None
    if not os.access(path, os.W_OK):
        raise UsageError(f"--out {path}: the folder is not writable; accepted: a writable "
                         f"folder")
    return path


def _load_graph(args: argparse.Namespace) -> Tuple[Any, Dict[str, Any]]:
    from .core.io import load_authors_graph, load_graph
    path = args.graph
    if not os.path.isfile(path):
        raise UsageError(f"--graph {path}: no such file; accepted: a graph saved with "
                         f"--save-graph (.json) or the authors' text format (cg_*.txt)")
    authors = not path.endswith(".json")
    from .core.errors import RecomputeError
    try:
        graph = load_authors_graph(path) if authors else load_graph(path)
    except RecomputeError:
        raise  # names the file and the line already
    except OSError as e:
        raise UsageError(f"--graph {path}: cannot read it ({e.strerror})") from None
    except (ValueError, KeyError, IndexError) as e:
        from .core.errors import GraphFormatError
        raise GraphFormatError(path, None, f"not a graph this command reads ({_one_line(e)}); "
                               f"accepted: a .json graph saved with --save-graph or the "
                               f"authors' cg_*.txt format") from None
    has_times = all(n.forward_time_s is not None for n in graph.nodes)
    if args.cost != graph.cost_model and (args.cost != "measured" or has_times):
        graph = graph.with_cost_model(args.cost)  # else: keep the file's (no measured times)
    source = {"graph": path, "format": "authors" if authors else "json",
              "nodes": graph.n, "batch_size": graph.batch_size,
              "default_scope": "activations" if authors else (
                  "total" if "state_bytes" in graph.meta else "activations")}
    return graph, source


def _check_device(spec: str) -> Any:
    from .runtime import _chainer  # noqa: F401
    import chainer
    if spec.startswith("@cupy"):
        try:
            import cupy  # noqa: F401
        except ImportError:
            raise UsageError(f"--device {spec}: CuPy is not installed (pip install a "
                             f"cupy-cudaXXX wheel on a machine with a GPU); accepted: "
                             f"{DEVICE_FORMS}") from None
    try:
        device = chainer.get_device(spec)
        device.use()
    except Exception as e:  # noqa: BLE001 - Chainer raises several kinds
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"--device {spec}: {first}; accepted: {DEVICE_FORMS}") from None
    return device


def _record_model(args: argparse.Namespace, progress: Any) -> Tuple[Any, Dict[str, Any]]:
    from .bench import dry_run_graph
    from .models import MODELS
    _check_device(args.device)
    batch = args.batch_size or MODELS[args.model][1]
    cb = args.capture_batch or batch
    graph, info = dry_run_graph(args.model, batch, small=args.small, device=args.device,
                                cost_model=args.cost, seed=args.seed, capture_batch=cb,
                                input_size=args.capture_input, progress=progress)
    source = {"model": args.model, "batch_size": batch, "small": args.small,
              "device": args.device, "nodes": graph.n, "capture": info,
              "default_scope": "total"}
    return graph, source


# ------------------------------------------------------------- planning
def plan_report(graph: Any, budget: str, *, solver: str = "auto", strategy: str = "tc",
                scope: str = "total", progress: Any = None,
                subject: str = "this graph", workspace: Any = None) -> Dict[str, Any]:
    """Plan ``graph`` for ``budget`` (as typed, or ``'least'``) and gather
    what the report shows: plain backprop, the plan, the least feasible
    budget, and the memory timelines of both.

    Raises:
        InfeasibleBudgetError: the budget is below the least feasible one
            (the message states it, in binary units).
    """
    from .progress import Progress
    from .core.errors import InfeasibleBudgetError
    from .core.execution import ExecutionPlan
    from .core.replay import replay
    progress = progress if progress is not None else Progress(enabled=False)
    least_wanted = budget == "least"
    budget_bytes = None if least_wanted else parse_bytes(budget)
    with progress.step("replaying plain backprop"):
        plain = replay(graph, None)
    if scope == "total":
        if workspace is not None:  # the convolutions' bound (--workspace)
            from .core.workspace import bounded_graph, plan_with_workspace
            graph = (plan_with_workspace(graph, budget, "auto", solver=solver,
                                         strategy=strategy)[1] if workspace == "auto"
                     else bounded_graph(graph, workspace))
        plan, least_plan, least_bytes, plain_peak, times = _plan_total(
            graph, budget_bytes, solver, strategy, progress)
    else:
        plan, least_plan, least_bytes, plain_peak, times = _plan_activations(
            graph, budget_bytes, solver, strategy, progress)
    if plan is None:
        raise InfeasibleBudgetError(
            f"budget {budget} (= {format_bytes(budget_bytes)}) is below the least feasible "
            f"{format_bytes_up(least_bytes)} for {subject} (solver {solver}, strategy "
            f"{strategy}, scope {scope}; plain backprop needs {format_bytes_up(plain_peak)}); "
            f"raise --budget to at least {_typed(least_bytes)}, or use --budget least",
            budget_bytes=budget_bytes, least_feasible_bytes=least_bytes,
            vanilla_bytes=plain_peak)

    def timeline(p: Any) -> Any:
        if p is None or not p.recompute or not p.lower_sets:
            return plain
        return replay(graph, ExecutionPlan(graph, p.lower_sets, frozenset(p.kept)))

    with progress.step("replaying the plan"):
        planned = timeline(plan)

    def row(p: Any, solve_s: float, predicted: int, replayed: Any) -> Dict[str, Any]:
        d = _plan_dict(p)
        d.update(predicted_peak_bytes=int(predicted),
                 saving_fraction=1.0 - predicted / plain_peak if plain_peak else 0.0,
                 overhead_fraction=float(p.overhead_fraction or 0.0) if p.recompute else 0.0,
                 n_blocks=p.n_blocks, solve_time_s=solve_s, n_dropped=len(p.dropped)
                 if p.recompute else 0, recomputed_nodes=replayed.recomputed,
                 replayed_peak_bytes=int(replayed.peak_bytes), peak_event=replayed.peak_event)
        return d

    plan_pred = planned.peak_bytes if scope == "total" else plan.predicted_peak_bytes
    report: Dict[str, Any] = {
        "schema": "chainer-recompute report", "version": REPORT_VERSION,
        "graph": {"nodes": graph.n, "edges": len(graph.edges), "batch_size": graph.batch_size,
                  "model": graph.meta.get("model"), "param_bytes": int(graph.param_bytes),
                  "cost_model": graph.cost_model},
        "budget": {"text": budget, "bytes": budget_bytes, "scope": scope, "solver": solver,
                   "strategy": strategy},
        "plain": {"predicted_peak_bytes": int(plain_peak),
                  "replayed_peak_bytes": int(plain.peak_bytes), "peak_event": plain.peak_event},
        "plan": row(plan, times["plan"], plan_pred, planned),
        "least": None,
        "timelines": {"plain": _timeline_dict(plain), "plan": _timeline_dict(planned)},
        "schedule": _schedule_dict(graph, plan),
    }
    if least_plan is not None:
        lp = timeline(least_plan) if least_plan is not plan else planned
        lpred = lp.peak_bytes if scope == "total" else least_plan.predicted_peak_bytes
        report["least"] = row(least_plan, times["least"], lpred, lp)
        report["least"]["budget_bytes"] = int(least_bytes)
    if least_wanted:
        report["budget"]["bytes"] = int(least_bytes)
    return report


def _plan_total(graph: Any, budget_bytes: Optional[int], solver: str, strategy: str,
                progress: Any) -> Tuple[Any, Any, int, int, Dict[str, float]]:
    from .core.budget import MARGIN, BudgetSearch, plan_for_budget
    from .core.errors import InfeasibleBudgetError
    times: Dict[str, float] = {}
    if solver == "none":
        t0 = time.perf_counter()
        least = plan_for_budget(graph, "least", solver="none", strategy=strategy)
        times["least"] = times["plan"] = time.perf_counter() - t0
        need = int(least.budget_bytes)
        peak = int(least.predicted_peak_bytes)
        if budget_bytes is not None and budget_bytes < need:
            return None, least, need, peak, times
        return least, least, need, peak, times
    t0 = time.perf_counter()
    with progress.step(f"planning ({solver}/{strategy}): the least feasible budget"):
        search = BudgetSearch(graph, solver, strategy)
        _, plain_peak = search.vanilla()
        least_bytes = search.least_budget()
        least = search.least_plan()
    times["least"] = time.perf_counter() - t0
    if budget_bytes is None:
        times["plan"] = times["least"]
        return least, least, least_bytes, plain_peak, times
    t0 = time.perf_counter()
    with progress.step(f"planning ({solver}/{strategy}) for {format_bytes(budget_bytes)}"):
        try:
            plan = search.fit(budget_bytes)
        except InfeasibleBudgetError:
            return None, least, least_bytes, int(math.ceil(plain_peak / (1 - MARGIN))), times
    times["plan"] = time.perf_counter() - t0
    return plan, least, least_bytes, plain_peak, times


def _plan_activations(graph: Any, budget_bytes: Optional[int], solver: str, strategy: str,
                      progress: Any) -> Tuple[Any, Any, int, int, Dict[str, float]]:
    from .core.planner import solve
    from .core.search import least_feasible_budget, vanilla_bytes
    times: Dict[str, float] = {}
    plain_peak = int(vanilla_bytes(graph, None))
    t0 = time.perf_counter()
    with progress.step(f"planning ({solver}/{strategy}): the least feasible budget"):
        least_bytes = int(least_feasible_budget(graph, solver=solver, strategy=strategy))
        least = solve(graph, least_bytes, solver=solver, strategy=strategy,
                      raise_infeasible=False)
    times["least"] = time.perf_counter() - t0
    if budget_bytes is None:
        times["plan"] = times["least"]
        return least, least, least_bytes, plain_peak, times
    if budget_bytes < least_bytes:
        return None, least, least_bytes, plain_peak, times
    t0 = time.perf_counter()
    with progress.step(f"planning ({solver}/{strategy}) for {format_bytes(budget_bytes)}"):
        plan = solve(graph, budget_bytes, solver=solver, strategy=strategy,
                     raise_infeasible=False)
    times["plan"] = time.perf_counter() - t0
    if not plan.feasible:
        return None, least, least_bytes, plain_peak, times
    return plan, least, least_bytes, plain_peak, times


def _plan_dict(plan: Any) -> Dict[str, Any]:
    d = {k: getattr(plan, k) for k in (
        "solver", "strategy", "budget_bytes", "feasible", "predicted_peak_bytes",
        "simulated_peak_bytes", "overhead", "overhead_fraction", "n_blocks", "solve_time_s",
        "cost_model", "recompute")}
    d["memory_scope"] = plan.info.get("memory_scope")
    return d


def _timeline_dict(result: Any) -> Dict[str, Any]:
    return {"events": list(result.events), "memory_bytes": [int(v) for v in result.memory_bytes],
            "peak_bytes": int(result.peak_bytes), "peak_event": result.peak_event,
            "constant_bytes": int(result.constant_bytes)}


def _schedule_dict(graph: Any, plan: Any) -> Dict[str, Any]:
    block = [0] * graph.n
    for b, nodes in enumerate(plan.blocks):
        for v in nodes:
            block[v] = b
    kept = plan.kept if plan.recompute else frozenset(range(graph.n))
    recomputed = sorted(v for v in range(graph.n) if v not in kept and graph.nodes[v].recomputable)
    gone = set(recomputed)
    return {"ops": [n.op for n in graph.nodes], "node_bytes": [int(b) for b in graph.node_bytes],
            "block": block, "kept": [v for v in range(graph.n) if v not in gone],
            "recomputed": recomputed,
            "edges": [[int(u), int(v)] for u, v in graph.edges]}


def _typed(nbytes: float) -> str:
    """A size as one would type it back as a budget (rounded up)."""
    return format_bytes_up(nbytes).replace(" ", "")


# ------------------------------------------------------------- running
def _check_gradients(args: argparse.Namespace, report: Dict[str, Any]) -> bool:
    from .bench import gradients_match, network
    batch = report["source"]["batch_size"]
    make, x, t, _ = _network_for_runs(args, batch, network)
    with _errors_once():
        return gradients_match(make, x, t, **_apply_options(args, report))


def _network_for_runs(args: argparse.Namespace, batch: int, network: Any) -> Any:
    cb = args.capture_batch if args.capture_batch and args.capture_batch < batch else None
    return network(args.model, batch, small=args.small, device=args.device,
                   cost_model=args.cost, seed=args.seed, capture_batch=cb)


def _apply_options(args: argparse.Namespace, report: Dict[str, Any]) -> Dict[str, Any]:
    """apply()'s options for the runs: it plans from the first training
    call, which it records at the real batch (the first iteration is left
    out of the averages)."""
    budget = report["budget"]["text"]
    return dict(budget=budget, solver=args.solver, strategy=args.strategy, cost=args.cost,
                budget_scope=report["budget"]["scope"],
                check_iterations=max(3, args.iterations), verbose=args.verbose,
                workspace=_workspace(args))


def _workspace(args: argparse.Namespace) -> Any:
    """--workspace as apply() takes it (None, 'auto' or bytes)."""
    from .core.workspace import parse_workspace
    try:
        return parse_workspace(getattr(args, "workspace", None))
    except ValueError as e:
        raise UsageError(str(e)) from None


class _NoErrors(logging.Filter):
    """Drops the runner's error lines: the command prints the error itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


@contextlib.contextmanager
def _errors_once() -> Iterator[None]:
    report = logging.getLogger("chainer_recompute.report")
    f = _NoErrors()
    report.addFilter(f)
    try:
        yield
    finally:
        report.removeFilter(f)


def _run_iterations(args: argparse.Namespace, report: Dict[str, Any],
                    progress: Any) -> List[Dict[str, Any]]:
    from .bench import compare
    batch = report["source"]["batch_size"]
    make = x = t = None
    from .bench import network
    with progress.step(f"building {args.model} at batch {batch}"):
        make, x, t, _ = _network_for_runs(args, batch, network)
    label = f"{args.solver}-{args.strategy}"
    with progress.step(f"running {args.iterations} iterations"
                       + (" of plain Chainer and the plan" if args.vanilla else ""),
                       total=args.iterations * (2 if args.vanilla else 1),
                       unit="iterations") as step, _errors_once():
        results = compare(make, x, t, [dict(_apply_options(args, report), label=label)],
                          iterations=args.iterations, vanilla=args.vanilla,
                          on_step=lambda: step.update(), as_updater=True)
    runs = []
    for r in results:
        stats = r.extra.get("stats")
        run: Dict[str, Any] = {
            "label": r.label, "peak_bytes": r.peak_bytes,
            "measured_peak_bytes": r.total_peak_bytes, "time_s": r.time_s,
            "times_s": r.times_s, "first_iteration_s": r.first_iteration_s,
            "recomputed_nodes": getattr(stats, "recomputed_nodes", None), "plan": None}
        if r.plan is not None:  # the plan the runner made from its own recording
            run["plan"] = _plan_dict(r.plan)
        runs.append(run)
    return runs


# -------------------------------------------------------------- output
def _pct(fraction: Optional[float]) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def format_report(report: Dict[str, Any]) -> str:
    """The lines the command prints: what was planned, the table, notes
    and the next command."""
    src = report.get("source", {})
    g = report["graph"]
    b = report["budget"]
    lines = []
    if "model" in src:
        cap = src.get("capture") or {}
        how = []
        if cap.get("capture_batch") and cap["capture_batch"] != src["batch_size"]:
            how.append(f"recorded at batch {cap['capture_batch']}, scaled")
        if cap.get("input_sizes"):
            how.append("input sizes " + ", ".join(str(s) for s in cap["input_sizes"])
                       + " extrapolated")
        took = f", {cap['capture_s']:.1f} s" if "capture_s" in cap else ""
        lines.append(f"{src['model']}{' (small)' if src.get('small') else ''}, batch "
                     f"{src['batch_size']}: {g['nodes']} functions, parameters "
                     f"{format_bytes(g['param_bytes'])}"
                     + (f" ({'; '.join(how)}{took})" if how else f" (recorded{took})"))
    else:
        lines.append(f"{src.get('graph', 'graph')}: {g['nodes']} functions, batch "
                     f"{g['batch_size']}"
                     + (" (the authors' format)" if src.get("format") == "authors" else ""))
    what = ("the whole iteration: parameters, gradients, optimizer state, activations, "
            "temporaries" if b["scope"] == "total" else
            "activations and their gradients (the paper's model); parameters, their "
            "gradients, optimizer state and temporaries come on top")
    budget = (f"least (= {format_bytes(b['bytes'])}, the least feasible)" if b["text"] == "least"
              else f"{b['text']} (= {format_bytes(b['bytes'])})")
    lines.append(f"budget {budget} for {what}; solver {b['solver']}, strategy {b['strategy']}")
    lines.append("")
    runs = {r["label"]: r for r in report.get("runs", [])}
    measured = bool(runs)
    head = ["", "peak (predicted)"] + (["peak (measured)"] if measured else []) + \
        ["saving", "recompute", "blocks", "solve"] + (["time/iter"] if measured else [])
    rows = []
    plain = report["plain"]
    vanilla = runs.get("vanilla")

    def meas(run: Optional[Dict[str, Any]]) -> List[str]:
        if not measured:
            return []
        return [format_bytes(run["measured_peak_bytes"]) if run and run.get(
            "measured_peak_bytes") is not None else "-"]

    def tcol(run: Optional[Dict[str, Any]]) -> List[str]:
        if not measured:
            return []
        if not run:
            return ["-"]
        text = f"{run['time_s']:.3f} s"
        if vanilla and run is not vanilla and vanilla["time_s"]:
            text += f" ({100 * (run['time_s'] / vanilla['time_s'] - 1):+.0f}%)"
        return [text]

    rows.append(["plain backprop", format_bytes(plain["predicted_peak_bytes"])] + meas(vanilla)
                + ["-", "0%", "1", "-"] + tcol(vanilla))
    plan = report["plan"]
    label = "plan at the least feasible budget" if b["text"] == "least" else f"plan for {b['text']}"
    rows.append([label, format_bytes(plan["predicted_peak_bytes"])] + meas(None)
                + [_pct(plan["saving_fraction"]), _pct(plan["overhead_fraction"])
                   if plan["recompute"] else "0%",
                   str(plan["n_blocks"]), f"{plan['solve_time_s']:.2f} s"] + tcol(None))
    for name, run in runs.items():
        rp = run.get("plan")
        if name == "vanilla" or not rp:
            continue
        pred = rp.get("predicted_peak_bytes")
        saving = (1.0 - pred / plain["predicted_peak_bytes"]
                  if pred and plain["predicted_peak_bytes"] else None)
        rows.append([f"  as run ({name})", format_bytes(pred) if pred else "-"] + meas(run)
                    + [_pct(saving), _pct(rp.get("overhead_fraction")) if rp.get("recompute")
                       else "0%", str(rp.get("n_blocks")), f"{rp.get('solve_time_s') or 0:.2f} s"]
                    + tcol(run))
    least = report.get("least")
    if least is not None and b["text"] != "least":
        rows.append([f"least feasible ({format_bytes_up(least['budget_bytes'])})",
                     format_bytes(least["predicted_peak_bytes"])] + (["-"] if measured else [])
                    + [_pct(least["saving_fraction"]), _pct(least["overhead_fraction"])
                       if least["recompute"] else "0%", str(least["n_blocks"]),
                       f"{least['solve_time_s']:.2f} s"] + (["-"] if measured else []))
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    for r in [head] + rows:
        lines.append("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i])
                               for i, c in enumerate(r)).rstrip())
    lines.append("")
    lines.append("saving: against plain backprop's predicted peak; recompute: extra forward "
                 f"work in % of one forward ({g['cost_model']} costs)")
    if not plan["recompute"]:
        lines.append(f"plain backprop fits in {b['text']}: the plan recomputes nothing.")
    if b["scope"] == "activations":
        lines.append(f"the whole iteration, replayed: plain backprop "
                     f"{format_bytes(plain['replayed_peak_bytes'])}, the plan "
                     f"{format_bytes(plan['replayed_peak_bytes'])} (--budget-scope total "
                     f"bounds that figure)")
    if measured:
        lines.append("as run: the plan apply() made from its own recording of the model "
                     "(first iteration recorded, second planned), measured over the later ones; "
                     "plain backprop over all but the first")
    if "gradients_identical" in report:
        lines.append(f"loss and gradients identical to plain backprop: "
                     f"{report['gradients_identical']}")
    if report.get("next_command"):
        lines.append(f"next: {report['next_command']}")
    return "\n".join(lines)


def _next_command(args: argparse.Namespace, report: Dict[str, Any]) -> str:
    base = [PROG] + [a for a in _argv_of(args)]
    plan, least = report["plan"], report.get("least")

    def cmd(replace_budget: Optional[str] = None, extra: Sequence[str] = ()) -> str:
        argv = list(base)
        if replace_budget is not None:
            i = argv.index("--budget")
            argv[i + 1] = replace_budget
        return " ".join(shlex.quote(a) for a in argv + list(extra))

    if args.iterations:
        budget = report["budget"]["text"]
        if budget == "least":
            budget = _typed(report["budget"]["bytes"])
        return (f"in a training script: model = chainer_recompute.apply(model, "
                f"budget={budget!r}) (PrintReport can show chainer_recompute.extensions."
                f"RecomputeReport's keys)")
    if not plan["recompute"] and least is not None and least["recompute"]:
        dry = ["--dry-run"] if args.dry_run else []
        return (f"{cmd(_typed(least['budget_bytes']), dry)}   # the least feasible budget: "
                f"{_pct(least['saving_fraction'])} less than plain backprop")
    if args.graph:
        return cmd(extra=["--out", "plan"]) + "   # memory.png and schedule.png"
    run = ["--iterations", "3", "--vanilla"]
    if not args.small and args.model not in ("mlp",):
        run = ["--small", "--batch-size", "4"] + run
        return (cmd(extra=run) + "   # measure the plan on the reduced network "
                "(the full one is slow on a CPU)")
    return cmd(extra=run) + "   # measure the plan against plain Chainer"


def _write_json(report: Dict[str, Any], path: str) -> None:
    try:
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=_json_default)
    except OSError as e:
        raise UsageError(f"cannot write {path} ({e.strerror})") from None


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def _draw(report: Dict[str, Any], out_dir: str) -> List[str]:
    from .plotting import MissingMatplotlib, draw_report
    try:
        return draw_report(report, out_dir)
    except MissingMatplotlib as e:
        print(f"note: {e}", file=sys.stderr)
        return []


# ---------------------------------------------------------------- plot
def plot_main(argv: Sequence[str]) -> int:
    """``chainer-recompute plot REPORT.json [--out DIR]``: redraw
    memory.png and schedule.png from a report."""
    verbose = "-v" in argv or "--verbose" in argv
    p = _Parser(prog=f"{PROG} plot",
                description="Redraw memory.png and schedule.png from a report.json written "
                            "by --out or --json.")
    p.add_argument("report", metavar="REPORT.json")
    p.add_argument("--out", metavar="DIR", help="where to write the PNGs (default: the "
                                                 "report's folder)")
    p.add_argument("-v", "--verbose", action="store_true")
    from .plotting import MissingMatplotlib, ReportError, draw_report, load_report
    try:
        args = p.parse_args(list(argv))
        report = load_report(args.report)
        out = _prepare_out(args.out) if args.out else (os.path.dirname(args.report) or ".")
        for path in draw_report(report, out):
            print(f"wrote {path}")
        return 0
    except (UsageError, ReportError, MissingMatplotlib) as e:
        return _fail(e, verbose, EXIT_USAGE)
    except Exception as e:  # noqa: BLE001
        return _fail(f"{type(e).__name__}: {e} (a bug? run with -v for the traceback)",
                     verbose, 1)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
