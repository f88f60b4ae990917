"""Where the command's graph comes from: a saved graph file, or one of the
package's networks recorded on a Chainer device."""
from __future__ import annotations

import argparse
import os
from typing import Any, Dict, Tuple

from .args import DEVICE_FORMS, UsageError, _one_line


def _load_graph(args: argparse.Namespace) -> Tuple[Any, Dict[str, Any]]:
    from ..core.io import load_authors_graph, load_graph
    path = args.graph
    if not os.path.isfile(path):
        raise UsageError(f"--graph {path}: no such file; accepted: a graph saved with "
                         f"--save-graph (.json) or the authors' text format (cg_*.txt)")
    authors = not path.endswith(".json")
    from ..core.errors import RecomputeError
    try:
        graph = load_authors_graph(path) if authors else load_graph(path)
    except RecomputeError:
        raise  # names the file and the line already
    except OSError as e:
        raise UsageError(f"--graph {path}: cannot read it ({e.strerror})") from None
    except (ValueError, KeyError, IndexError) as e:
        from ..core.errors import GraphFormatError
        raise GraphFormatError(path, None, f"not a graph this command reads ({_one_line(e)}); "
                               f"accepted: a .json graph saved with --save-graph or the "
                               f"authors' cg_*.txt format") from None
    has_times = all(n.forward_time_s is not None for n in graph.nodes)
    if args.cost != graph.cost_model and (args.cost != "measured" or has_times):
        graph = graph.with_cost_model(args.cost)  # else: keep the file's (no measured times)
    source = {"graph": path, "format": "authors" if authors else "json",
              "nodes": graph.n, "batch_size": graph.batch_size,
              "default_scope": "activations" if authors else (
                  "total" if graph.step.state_bytes else "activations")}
    return graph, source


def _check_device(spec: str) -> Any:
    from ..runtime import _chainer  # noqa: F401
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
    from ..bench import dry_run_graph
    from ..models import MODELS
    _check_device(args.device)
    batch = args.batch_size or MODELS[args.model][1]
    if args.capture_batch == 1 and batch > 1:
        raise UsageError(
            f"--capture-batch 1 under-counts batch {batch}: at batch 1 NumPy spares "
            f"copies that every larger batch makes (a convolution's column buffer), so a "
            f"batch-1 recording scaled up predicts less than the step needs (the small "
            f"VGG19 at batch 8: plain Chainer's peak 20% under and the least budget 23% "
            f"under a recording at 8, and plans over their budgets); use --capture-batch "
            f"2 (the default) or more, or 0 to record the full batch")
    cb = args.capture_batch or batch
    graph, info = dry_run_graph(args.model, batch, small=args.small, device=args.device,
                                cost_model=args.cost, seed=args.seed, capture_batch=cb,
                                input_size=args.capture_input, progress=progress)
    source = {"model": args.model, "batch_size": batch, "small": args.small,
              "device": args.device, "nodes": graph.n, "capture": info,
              "default_scope": "total"}
    return graph, source
