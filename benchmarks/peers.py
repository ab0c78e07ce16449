"""The default against the authors' released method, the paper as written and InMaP, with costs.

Run: ``python benchmarks/peers.py`` (3 seeds of the CLIP-like label-shift worlds, the two
ImageNet-size worlds, 4 digits models; hours on 2 CPU cores, dominated by the 2,000-step InMaP
runs at ImageNet size: ``--device cuda`` where there is a GPU); ``--quick``: 1 seed, N = 5,000,
no ImageNet size, one digits model (about 10 minutes). Writes
``benchmarks/results/peers.json`` (``peers_quick.json``); ``python benchmarks/report.py`` turns
``peers.json``, else ``peers_quick.json``, into the table of docs/method.md.

Methods, on the same features (``frolic_tta.frolic`` unless said):

* ``default``: ``FrolicOptions()``;
* ``released preset``: ``released_options()``, the authors' ``main_zeroshot.py``
  (:mod:`frolic_tta.released`; two InMaP runs of 2,000 steps);
* ``paper as written``: ``paper_options()`` (Eq. 7, Algorithm 2, a balanced test set);
* ``InMaP alone``: InMaP's proxies (``frolic_tta.inmap.fit_proxies``, its defaults) with the
  convergence test of ``FrolicOptions()`` (``frolic_tta.inmap.convergence``), scored by
  themselves;
* ``InMaP + Frolic``: ``FrolicOptions(zero_shot="inmap")`` (its proxies' labels balanced to
  the EM test prior, then Frolic; ``proxies alone`` in the JSON: those proxies by themselves);
* ``InMaP alone, 2,000 steps`` and ``InMaP + Frolic, 2,000 steps``: the same with
  InMaP's fixed step count (``solver.inmap_tolerance=None``).

Costs: wall seconds of each method from features to logits, and its *InMaP passes* over the
features (Sinkhorn + labels + proxy steps; Frolic's own handful of passes not counted).
Worlds: ``label_shift.py``'s builders (``clip`` worlds and, in the full run, ``imagenet``:
K = 1,000, d = 512, N = 50,000); the digits model: ``digits_clip.py`` (N = 300, K = 10).
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable
from typing import Any

import common
import torch
from label_shift import build, summarise, world_specs

import frolic_tta
from frolic_tta import accuracy
from frolic_tta.inmap import convergence, fit_proxies
from frolic_tta.logits import identity_reduce
from frolic_tta.options import FrolicOptions, paper_options, released_options
from frolic_tta.pipeline import l2_normalize, text_test_prior

STOP = convergence(FrolicOptions())  # InMaP's stopping rule in the default options
INMAP_FULL = 20 + 1 + 2000  # Sinkhorn passes, the labelling pass, InMaP's 2,000 steps
METHODS = [
    "default",
    "released preset",
    "paper as written",
    "InMaP alone",
    "InMaP + Frolic",
    "InMaP alone, 2,000 steps",
    "InMaP + Frolic, 2,000 steps",
]
QUICK_WORLDS = ["clip balanced", "clip long-tailed 10", "clip long-tailed 100", "clip natural"]
FULL_WORLDS = [*QUICK_WORLDS, "clip 30% of classes", "imagenet balanced", "imagenet long-tailed 10"]


def timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    common.sync(device)
    start = time.perf_counter()
    out = fn()
    common.sync(device)
    return time.perf_counter() - start, out


def evaluate(x: torch.Tensor, z: torch.Tensor, y: torch.Tensor, tau_c: float, device: str) -> dict:
    """Accuracy, seconds and InMaP passes of every method on one feature set."""
    x, z, y = x.to(device), z.to(device), y.to(device)
    out: dict[str, dict[str, float]] = {}

    def frolic(options: FrolicOptions) -> frolic_tta.FrolicResult:
        return frolic_tta.frolic(x, z, options, tau_c=tau_c, normalize=True)

    for name, options, passes in (
        ("default", FrolicOptions(), 0),
        ("released preset", released_options(), 2 * INMAP_FULL),
        ("paper as written", paper_options(), 0),
    ):
        seconds, result = timed(lambda options=options: frolic(options), device)
        out[name] = {"acc": accuracy(result.logits, y), "seconds": seconds, "passes": passes}
    seconds, fit = timed(lambda: fit_proxies(x, z, tau_c, **STOP), device)
    logits = x.to(fit.prototypes) @ fit.prototypes.T
    out["InMaP alone"] = {"acc": accuracy(logits, y), "seconds": seconds, "passes": fit.passes}
    out["InMaP alone"]["steps"] = fit.steps
    seconds, result = timed(lambda: frolic(FrolicOptions(zero_shot="inmap")), device)
    out["InMaP + Frolic"] = {"acc": accuracy(result.logits, y), "seconds": seconds}
    out["InMaP + Frolic"]["proxies alone"] = accuracy(result.ablations(None)["inmap"], y)
    # its proxies again, outside the timing, for their steps (labels balanced to pi-tilde)
    unit, text = l2_normalize(x), l2_normalize(z)  # as frolic(normalize=True)
    target = text_test_prior(unit, text, tau_c, None, FrolicOptions(), identity_reduce, None)
    balanced = fit_proxies(unit, text, tau_c, target=target, **STOP)
    same = torch.allclose(balanced.prototypes, result.head.prototypes.to(balanced.prototypes))
    out["InMaP + Frolic"].update(passes=balanced.passes, steps=balanced.steps, same=same)
    seconds, fit = timed(lambda: fit_proxies(x, z, tau_c), device)
    logits = x.to(fit.prototypes) @ fit.prototypes.T
    full = {"seconds": seconds, "passes": INMAP_FULL}
    out["InMaP alone, 2,000 steps"] = {"acc": accuracy(logits, y), **full}
    seconds, result = timed(
        lambda: frolic(FrolicOptions(zero_shot="inmap", solver={"inmap_tolerance": None})), device
    )
    out["InMaP + Frolic, 2,000 steps"] = {"acc": accuracy(result.logits, y), **full}
    out["InMaP + Frolic, 2,000 steps"]["seconds"] = seconds
    out["zero-shot"] = {"acc": accuracy(x @ z.T, y), "seconds": 0.0, "passes": 0}
    return out


def digits_runs(quick: bool, device: str) -> dict[str, Any]:
    """The digits model (``digits_clip.py``): its held-out features, one run per seed."""
    from digits_clip import DEFAULT_STEPS, QUICK_STEPS, encode, pretrain

    steps = QUICK_STEPS if quick else DEFAULT_STEPS
    runs = []
    for seed in range(1 if quick else 4):
        digits = pretrain(seed, 20.0, steps)
        x, z, y = encode(digits)
        runs.append(evaluate(x, z, y, 1.0 / digits.logit_scale, device))
    return {"spec": {"model": "digits_clip", "steps": steps, "imbalance": 20.0}, "seeds": len(runs),
            **summarise(runs)}  # fmt: skip


def run_description(quick: bool, seeds: int, only: list[str] | None = None) -> dict[str, Any]:
    """What the run covered, for the table's heading (``only``: the ``--only`` worlds)."""
    from digits_clip import DEFAULT_STEPS, QUICK_STEPS

    command = "python benchmarks/peers.py" + (" --quick" if quick else "")
    if only:
        command += " --only " + " ".join(f'"{name}"' for name in only)
    return {
        "command": command,
        "clip": "N = 5,000" if quick else "N = 20,000",
        "seeds": 1 if quick else seeds,
        "digits seeds": 1 if quick else 4,
        "digits steps": QUICK_STEPS if quick else DEFAULT_STEPS,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 seed, N = 5,000, no ImageNet")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", nargs="*", help="world names to run (default: all)")
    args = parser.parse_args(argv)
    info = common.machine_info(args.device)
    specs = world_specs(args.quick)
    names = QUICK_WORLDS if args.quick else FULL_WORLDS
    results: dict[str, Any] = {}
    for name in [*names, "digits model"]:
        if args.only and name not in args.only:
            continue
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # undetermined-bias and ridge warnings
            if name == "digits model":
                results[name] = digits_runs(args.quick, args.device)
            else:
                spec = specs[name]
                seeds = range(1 if args.quick else spec.get("seeds", args.seeds))
                runs = []
                for seed in seeds:
                    world, x, z, tau_c = build(spec, seed)
                    runs.append(evaluate(x, z, world.labels, tau_c, args.device))
                results[name] = {"spec": spec, "seeds": len(runs), **summarise(runs)}
        accs = {m: results[name][m]["acc"]["mean"] for m in METHODS}
        text = " ".join(f"{m} {a:.3f}" for m, a in accs.items())
        print(f"{name}: {text} ({time.perf_counter() - started:.0f} s)", flush=True)
    payload = {
        "machine": common.finish_info(info),
        "methods": METHODS,
        "stop": STOP,
        "run": run_description(args.quick, args.seeds, args.only),
        "worlds": results,
    }
    from report_peers import peers_section

    print(peers_section(payload))
    name = "peers_quick" if args.quick else "peers"
    name += "_cuda" if args.device.startswith("cuda") else ""
    print(f"wrote {common.write_result(name, payload).relative_to(common.ROOT)}")
    return payload


if __name__ == "__main__":
    main()
