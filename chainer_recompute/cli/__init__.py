"""The command line: plan recomputation for a network (or a saved graph),
show what it saves, and optionally run and measure it.

::

    chainer-recompute --model resnet152 --budget 8G --dry-run
    chainer-recompute --model pspnet --small --batch-size 8 --iterations 3 --vanilla
    chainer-recompute --graph cg_unet.txt --solver exact --budget 6GB
    chainer-recompute plot out/report.json

(``.venv/bin/python scripts/run_schedule.py`` is the same command without
installing.) Its sizes are binary: ``8G`` is 8 GiB, as a GPU's
memory is counted; ``8GB`` is 8·10^9 bytes. Bad input exits with code 2
and one line naming the problem and the accepted forms (``-v`` adds the
traceback); errors of the library (:class:`~chainer_recompute.core.errors.RecomputeError`)
exit the same way.
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import traceback
from typing import Any, Callable, Optional, Sequence

from ..core.keep import parse_keep
from .args import (EXIT_USAGE, PROG, UsageError, _argv_of, _join_negative_values, _one_line,
                   _Parser, _prepare_out, _workspace, build_parser)
from .planning import plan_report
from .preflight import (estimate_planned, estimate_recorded, needs_check, out_of_memory_message,
                        refuse_if_too_big)
from .report import _draw, _next_command, _write_json, format_report
from .runs import _check_gradients, _run_iterations
from .source import _load_graph, _record_model

logger = logging.getLogger(__name__)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plot":
        return plot_main(argv[1:])
    verbose = "-v" in argv or "--verbose" in argv
    from ..core.errors import RecomputeError
    restore_logging = None
    args = None
    try:
        args = build_parser().parse_args(_join_negative_values(argv))
        restore_logging = _configure_logging(args.verbose)
        return _run(args)
    except MemoryError as e:  # CuPy's OutOfMemoryError is one too
        return _fail(out_of_memory_message(e, args, getattr(args, "memory_estimate", None)),
                     verbose, 1, e)
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


def _fail(error: Any, verbose: bool, code: int, cause: Optional[BaseException] = None) -> int:
    if verbose and cause is not None:
        traceback.print_exception(type(cause), cause, cause.__traceback__)
    elif verbose and isinstance(error, BaseException):
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
def _budget_of(args: argparse.Namespace) -> Any:
    """``--budget`` parsed; ``device``: what ``--device`` can give now, less
    the margin (a saved graph is planned for the host's memory)."""
    from ..core.budget_spec import parse_budget
    b = parse_budget(args.budget)
    if b.kind != "device":
        return b
    from ..runtime.device import CPU, CupyDevice
    device = CPU
    if args.device.startswith("@cupy") and not args.graph:
        import cupy
        device = CupyDevice(cupy)
    return b.of_device(device.available_bytes())


def _with_keep(args: argparse.Namespace, graph: Any) -> Any:
    """``graph`` with the functions of the ``--keep`` links marked (kept by
    every plan); a path that names no recorded link is refused."""
    if not args.keep:
        return graph
    policy = parse_keep(args.keep)
    policy.check_graph(graph, option="--keep")
    return policy.mark(graph)


def _run(args: argparse.Namespace) -> int:
    from ..progress import Progress
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
        from ..core.io import save_graph
        save_graph(graph, args.save_graph)
    graph = _with_keep(args, graph)
    check = needs_check(args)
    if check:  # before planning: plain backprop's peak and the plan's floor
        with progress.step("estimating the memory of the run"):
            args.memory_estimate = estimate_recorded(args, graph, _workspace(args))
        refuse_if_too_big(args, args.memory_estimate, source["batch_size"],
                          source["capture"]["capture_batch"])
    scope = args.budget_scope or source.pop("default_scope", "total")
    source.pop("default_scope", None)
    subject = (f"{args.model} at batch {source['batch_size']}" if not args.graph
               else os.path.basename(args.graph))
    report = plan_report(graph, _budget_of(args), solver=args.solver, strategy=args.strategy,
                         workspace=_workspace(args),
                         scope=scope, progress=progress, subject=subject)
    report["source"] = source
    if args.keep:
        report["budget"]["keep"] = {"paths": list(parse_keep(args.keep).paths),
                                    "functions": len(graph.must_keep)}
    if check:  # after planning, before anything runs at the full batch
        args.memory_estimate = est = estimate_planned(args, graph, report)
        report["memory_estimate"] = {"need_bytes": est.need_bytes,
                                     "available_bytes": est.available_bytes,
                                     "where": est.where, "parts": [list(p) for p in est.parts]}
        refuse_if_too_big(args, est, source["batch_size"], source["capture"]["capture_batch"])
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


# ---------------------------------------------------------------- plot
def plot_main(argv: Sequence[str]) -> int:
    """``chainer-recompute plot REPORT.json [--out DIR]``: redraw
    memory.png, schedule.png and tradeoff.png from a report."""
    verbose = "-v" in argv or "--verbose" in argv
    p = _Parser(prog=f"{PROG} plot",
                description="Redraw memory.png, schedule.png and tradeoff.png from a "
                            "report.json written by --out or --json.")
    p.add_argument("report", metavar="REPORT.json")
    p.add_argument("--out", metavar="DIR", help="where to write the PNGs (default: the "
                                                 "report's folder)")
    p.add_argument("-v", "--verbose", action="store_true")
    from ..plotting import MissingMatplotlib, ReportError, draw_report, load_report
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

