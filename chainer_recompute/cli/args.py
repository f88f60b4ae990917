"""The command line's options: the parser, the checks of each value, and
the options that define a plan as a user would type them back."""
from __future__ import annotations

import argparse
import os
import re
from typing import Any, List, Sequence

from ..core.memory_model import SCOPES
from ..core.units import ACCEPTED_FORMS

PROG = "chainer-recompute"
SOLVERS = ("auto", "hier", "approx", "exact", "chen", "chen-greedy", "none")
#: Exit status of every bad input.
EXIT_USAGE = 2
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
    """A budget that :func:`~chainer_recompute.core.budget_spec.parse_budget`
    reads (a size, ``least``, ``60%``, ``device``), kept as typed."""
    from ..core.budget_spec import parse_budget
    from ..core.errors import BudgetError
    try:
        b = parse_budget(text)
    except BudgetError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return b.text if b.kind != "bytes" else text.strip()


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default, unless it is None (its help says what
    happens then) or False (a plain switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False):
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from ..models import MODELS
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
                   help="memory budget: 'least' (the least feasible budget), a size: "
                        f"{ACCEPTED_FORMS}, '60%%' (a share of what plain backprop needs) "
                        "or 'device' (what --device can give, less 10%%). G means GiB (2^30), "
                        "GB means 10^9")
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
                   help="tc: least recomputation; mc: coarsest blocks (most recomputation)")
    p.add_argument("--cost", default="measured", choices=("measured", "flops", "paper"),
                   help="cost model T_v for the solver")
    p.add_argument("--keep", action="append", default=None, metavar="PATH",
                   help="never drop the outputs of the functions this link applies (a path "
                        "as namedlinks() names it, e.g. /predictor/res5; repeat for more): "
                        "every plan, the least budget's included, keeps them")
    p.add_argument("--workspace", default=None, metavar="SIZE|auto",
                   help="bound one convolution call's column buffer: a size ('64M') or "
                        "auto (chosen with the plan); calls over it build it in one copy, "
                        "bit-identical (default: Chainer's kernels)")
    p.add_argument("--dry-run", action="store_true",
                   help="plan only (the default without --iterations), and say so: the graph "
                        "is recorded at --capture-batch and scaled; nothing runs at the full "
                        "batch")
    p.add_argument("--capture-batch", type=_count, default=2, metavar="N",
                   help="record the graph at this batch size (at most --batch-size) and "
                        "scale it linearly to --batch-size; 0: record at the full batch. "
                        "1 is refused below --batch-size: at batch 1 Chainer's convolutions "
                        "make one column buffer fewer than at larger batches, so a batch-1 "
                        "recording under-counts")
    p.add_argument("--capture-input", choices=("auto", "full"), default="auto",
                   help="auto: the segmentation networks (unet, pspnet) are recorded at three "
                        "smaller input sizes and extrapolated to theirs; full: at their size")
    p.add_argument("--iterations", type=_count, default=0, metavar="N",
                   help="training iterations to run with the plan (0: plan only); the "
                        "first (recorded) and second (planned) are left out of the averages")
    p.add_argument("--vanilla", action="store_true",
                   help="with --iterations: also run plain Chainer and measure it")
    p.add_argument("--no-memory-check", action="store_true",
                   help="run --iterations or --check-gradients even where the estimate made "
                        "before the run (from the small-batch recording) says it does not fit "
                        "in the memory available")
    p.add_argument("--check-gradients", action="store_true",
                   help="compare the loss and gradients of two steps with plain backprop (the "
                        "first records the graph, the second runs the plan)")
    p.add_argument("--device", default="@numpy",
                   help=f"Chainer device: {DEVICE_FORMS}")
    p.add_argument("--out", metavar="DIR",
                   help="write report.json, memory.png, schedule.png and tradeoff.png "
                        "there")
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


_UNIT_WORD = re.compile(r"^(?:[kmgt](?:i?b|i)?|b|%)$", re.IGNORECASE)
_NUMBER = re.compile(r"^[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?$")


def _join_negative_values(argv: Sequence[str]) -> List[str]:
    """``--budget -1G`` -> ``--budget=-1G``: argparse would take ``-1G``
    for an option and say "expected one argument"; ``--budget 8 GB`` (two
    words) -> ``--budget=8 GB``.

    >>> _join_negative_values(['--budget', '8', 'GB', '--dry-run'])
    ['--budget=8 GB', '--dry-run']
    """
    out: List[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--budget" and i + 2 < len(argv) and _NUMBER.match(argv[i + 1]) \
                and _UNIT_WORD.match(argv[i + 2]):
            out.append(f"{tok}={argv[i + 1]} {argv[i + 2]}")
            i += 3
            continue
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
    for path in getattr(args, "keep", None) or ():
        out += ["--keep", path]
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


def _workspace(args: argparse.Namespace) -> Any:
    """--workspace as apply() takes it (None, 'auto' or bytes)."""
    from ..core.workspace import parse_workspace
    try:
        return parse_workspace(getattr(args, "workspace", None))
    except ValueError as e:
        raise UsageError(str(e)) from None
