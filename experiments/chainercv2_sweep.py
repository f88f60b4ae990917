#!/usr/bin/env python
"""Networks this project was not designed for: the image classifiers of
chainercv2 (imgclsmob's Chainer model zoo), each trained plain and under
``apply(L.Classifier(net), budget='least')``, compared bit for bit.

Each network trains twice from the same seeds on seeded random images
(CIFAR-10's networks at 32 x 32, the ImageNet ones at 224 x 224 with 10
classes), batch 4, ``MomentumSGD(0.01)`` and ``WeightDecay(1e-4)``,
``opt.update(model, x, t)`` as a ``StandardUpdater`` runs it. Batch 4 is
planned from captures at batch 1 and 2 (docs/defaults.md). After every step
the two runs' records must be identical (tests/harness.py: loss,
parameters, gradients, optimizer state, step counts, persistents, NumPy's
random state). Each step's peak is the absolute peak of a tracemalloc meter
around ``opt.update`` (parameters, gradients, optimizer state and
everything the step makes), printed beside the runner's prediction.

Each network runs in a process of its own (``--one``), so that one that
fails or runs out of time is a row of the table. chainercv2 is in the
``thirdparty`` extra (``pip install -e '.[thirdparty]'``)::

    OPENBLAS_NUM_THREADS=1 .venv/bin/python experiments/chainercv2_sweep.py --jobs 2
    OPENBLAS_NUM_THREADS=1 .venv/bin/python experiments/chainercv2_sweep.py resnet20_cifar10 ghostnet
    OPENBLAS_NUM_THREADS=1 .venv/bin/python experiments/chainercv2_sweep.py --batch 8 --optimizer adam --budget 60% resnet20_cifar10

(``--batch``, ``--optimizer adam`` and ``--budget`` change the defaults
above; ``--accumulate k`` makes each step a loop's gradient accumulation:
``cleargrads()``, then ``k`` slices of ``batch / k`` images, each made when
its turn comes as a loader would, forward and ``backward()``, then
``opt.update()``.)
"""
import argparse
import concurrent.futures
import gc
import json
import os
import random
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

#: CIFAR-10's networks (32 x 32): residual, pre-activation, squeeze-excite,
#: grouped, pyramid, dense, wide, binary-weight, residual-of-residual,
#: random (shake-shake, shake-drop, stochastic depth), attention-coupled
CIFAR = ("resnet20_cifar10 preresnet20_cifar10 resnext20_16x4d_cifar10 seresnet20_cifar10 "
         "sepreresnet20_cifar10 pyramidnet110_a48_cifar10 densenet40_k12_cifar10 "
         "densenet40_k12_bc_cifar10 xdensenet40_2_k24_bc_cifar10 wrn16_10_cifar10 "
         "wrn20_10_1bit_cifar10 ror3_56_cifar10 rir_cifar10 shakeshakeresnet20_2x16d_cifar10 "
         "shakedropresnet20_cifar10 resdropresnet20_cifar10 diaresnet20_cifar10 "
         "diapreresnet20_cifar10 nin_cifar10").split()
#: ImageNet networks (224 x 224, 10 classes)
IMAGENET = ("mobilenetv2_w1 mobilenetv3_large_w1 efficientnet_b0 ghostnet shufflenetv2_w1 "
            "squeezenet_v1_1 mnasnet_b1 mixnet_s hrnet_w18_small_v1 dla34 octresnet10_ad2 "
            "resnesta18 fbnet_cb proxylessnas_mobile igcv3_w1 peleenet condensenet74_c4_g4 "
            "channelnet darts bagnet9 selecsls42 hardnet39ds vovnet27s spnasnet "
            "menet108_8x1_g3 diracnet18v2 alexnet resnet10 senet16 dpn68 sqnxt23_w1 "
            "shufflenet_g1_w1 fdmobilenet_w1 efficientnet_edge_small_b dicenet_w1 espnetv2_w1 "
            "sknet50 regnetx002 airnet50_1x64d_r2").split()


def train(name, applied, steps, batch, budget="least", optimizer="momentum", accumulate=1):
    """One run: per step its records, peak, time and (applied) the runner's
    path, functions dropped and predicted peak."""
    import numpy as np
    import chainer
    import chainer.links as L
    import chainer_recompute as cr
    from chainercv2.model_provider import get_model
    from chainer_recompute.runtime.memory import MemoryMeter
    from harness import outer_meter, records
    size = 32 if "cifar" in name else 224
    np.random.seed(0)
    random.seed(0)
    out = {"records": [], "peaks": [], "times": [], "stats": []}
    with outer_meter():
        kwargs = {} if "cifar" in name else {"classes": 10, "in_size": (size, size)}
        model = L.Classifier(get_model(name, pretrained=False, **kwargs))
        opt = (chainer.optimizers.Adam() if optimizer == "adam"
               else chainer.optimizers.MomentumSGD(0.01))
        opt.setup(model)
        opt.add_hook(chainer.optimizer_hooks.WeightDecay(1e-4))
        if applied:
            cr.apply(model, budget=budget, verbose=False)
        rs = np.random.RandomState(1)
        for _ in range(steps):
            if accumulate == 1:
                x = rs.randn(batch, 3, size, size).astype(np.float32)
                t = rs.randint(0, 10, batch).astype(np.int32)
            gc.collect()
            t0 = time.perf_counter()
            with MemoryMeter() as m:
                if accumulate == 1:
                    opt.update(model, x, t)
                else:  # each slice made when its turn comes, as a loader would
                    model.cleargrads()
                    for _ in range(accumulate):
                        xs = rs.randn(batch // accumulate, 3, size, size).astype(np.float32)
                        ts = rs.randint(0, 10, batch // accumulate).astype(np.int32)
                        model(xs, ts).backward()
                        del xs, ts
                    opt.update()
            out["times"].append(time.perf_counter() - t0)
            out["peaks"].append(m.result.absolute_peak_bytes)
            out["records"].append(records(model, model.loss))
            if applied:
                st = cr.runner_of(model).last_stats
                out["stats"].append([st.path, st.n_dropped, st.n_nodes, st.predicted_peak_bytes,
                                     st.budget_bytes])
    return out


def one(name, steps, batch, budget="least", optimizer="momentum", accumulate=1):
    """The row of one network (a JSON line)."""
    row = {"name": name}
    runs = []
    for applied in (False, True):
        try:
            runs.append(train(name, applied, steps, batch, budget, optimizer, accumulate))
        except Exception as e:  # noqa: BLE001 - a row of the table
            first = str(e).splitlines()[0] if str(e) else ""
            row["error"] = (f"{'apply()' if applied else 'plain Chainer'} fails: "
                            f"{type(e).__name__}: {first}"[:200])
            return row
    plain, ours = runs
    differ = [(k, [key for key in a if a[key] != b.get(key)][:3])
              for k, (a, b) in enumerate(zip(plain["records"], ours["records"]))]
    row.update(identical=not any(d for _, d in differ),
               first_difference=next(([k, d] for k, d in differ if d), None),
               plain_peaks=plain["peaks"], peaks=ours["peaks"], stats=ours["stats"],
               plain_times=plain["times"], times=ours["times"])
    return row


def run_one(name, steps, batch, timeout, budget="least", optimizer="momentum", accumulate=1):
    cmd = [sys.executable, "-W", "ignore", os.path.abspath(__file__), "--one", name,
           "--steps", str(steps), "--batch", str(batch), "--budget", budget,
           "--optimizer", optimizer, "--accumulate", str(accumulate)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"name": name, "error": f"over {timeout} s"}
    lines = [s for s in p.stdout.splitlines() if s.startswith("ROW ")]
    if not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return {"name": name, "error": f"exit {p.returncode}: {tail[:200]}"}
    return json.loads(lines[-1][4:])


def table(rows):
    print("| network | functions | identical | plain, steady | applied, steady | "
          "predicted / measured | dropped | time / plain's | first step / budget | "
          "steps 2+ / budget |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | | {r['error']} | | | | | | | |")
            continue
        plain, ours = max(r["plain_peaks"][1:]), max(r["peaks"][1:])
        path, dropped, n, predicted, budget = r["stats"][-1]
        time_ratio = (sum(r["times"][2:]) / sum(r["plain_times"][2:])
                      if len(r["times"]) > 2 else float("nan"))
        same = "yes" if r["identical"] else f"**no** (step {r['first_difference'][0]})"
        firsts = {s[0] for s in r["stats"]}
        print(f"| {r['name']} | {n} | {same}{'' if firsts == {'planned'} else ' ' + str(sorted(firsts))} "
              f"| {plain:,} B | {ours:,} B ({ours / plain:.3f}x) | {predicted / ours:.4f} "
              f"| {dropped} | {time_ratio:.2f}x | {r['peaks'][0] / r['stats'][0][4]:.2f} "
              f"| {max(r['peaks'][2:] or [0]) / budget:.3f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="chainercv2 model names (default: the lists above)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per network")
    ap.add_argument("--budget", default="least", help="apply()'s budget (default 'least')")
    ap.add_argument("--optimizer", choices=("momentum", "adam"), default="momentum",
                    help="MomentumSGD(0.01) with WeightDecay(1e-4) (default), or Adam() with it")
    ap.add_argument("--accumulate", type=int, default=1,
                    help="k: each step backpropagates k slices of the batch, then one update")
    ap.add_argument("--jsonl", help="also write the rows here")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("ROW " + json.dumps(one(args.one, args.steps, args.batch, args.budget,
                                      args.optimizer, args.accumulate)), flush=True)
        return
    names = args.names or CIFAR + IMAGENET
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda n: run_one(n, args.steps, args.batch, args.timeout,
                                               args.budget, args.optimizer, args.accumulate),
                               names))
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    table(rows)


if __name__ == "__main__":
    main()
