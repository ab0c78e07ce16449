"""InMaP's cost (``FrolicOptions(zero_shot="inmap")``): the proxies from stored features.

Run: ``python benchmarks/inmap.py`` (about 2 minutes on 2 CPU cores; ``--quick``: seconds).
Writes ``benchmarks/results/inmap.json`` (``inmap_cuda.json`` with ``--device cuda``).

Features: ``common.clip_like`` (unit norm, ImageNet-like geometry), N x K x d float32, as the
module caches them. Timed: the pseudo-labels (``inmap_proxies(iterations=0)``: 20 Sinkhorn
passes and one labelling pass), ``--steps`` proxy steps, and the moment-sums pass that
``fit_frolic`` adds. Every proxy step does the same work (two ``(N, d) x (d, K)`` products and
one reduction), so InMaP's 2,000 steps are extrapolated as labels + 2,000 x (time per step);
``--steps 2000`` measures them all. Also timed: the proxies with the convergence test of
``FrolicOptions().solver.inmap_tolerance`` (the steps it took, measured, not extrapolated).
"""

from __future__ import annotations

import argparse

import common

from frolic_tta.inmap import fit_proxies, inmap_proxies
from frolic_tta.options import FrolicOptions
from frolic_tta.pipeline import shard_moment_sums

DEFAULT_STEPS = 2000  # InMaP's iters_proxy


def measure(n: int, k: int, d: int, steps: int, device: str) -> dict:
    features, prototypes, labels = common.clip_like(n, k, d)
    features, prototypes = features.to(device), prototypes.to(device)

    def timed(fn):
        common.sync(device)
        start = common.now()
        out = fn()
        common.sync(device)
        return common.now() - start, out

    labels_s, _ = timed(lambda: inmap_proxies(features, prototypes, iterations=0))
    total_s, (proxies, tau) = timed(lambda: inmap_proxies(features, prototypes, iterations=steps))
    step_s = (total_s - labels_s) / steps
    tolerance = FrolicOptions().solver.inmap_tolerance
    converged_s, fit = timed(lambda: fit_proxies(features, prototypes, tolerance=tolerance))
    sums_s, _ = timed(lambda: shard_moment_sums(features, proxies.float(), tau))
    labels = labels.to(device)
    accuracy = {
        "text": float(((features @ prototypes.T).argmax(1) == labels).double().mean()),
        f"proxies after {steps} steps": float(
            ((features @ proxies.float().T).argmax(1) == labels).double().mean()
        ),
        f"proxies after {fit.steps} steps (converged)": float(
            ((features @ fit.prototypes.float().T).argmax(1) == labels).double().mean()
        ),
    }
    return {
        "n": n,
        "k": k,
        "d": d,
        "steps_measured": steps,
        "labels_s": labels_s,
        "step_s": step_s,
        "moment_sums_s": sums_s,
        "inmap_default_s": labels_s + DEFAULT_STEPS * step_s + sums_s,
        "passes": 20 + 1 + DEFAULT_STEPS + 1,
        "tolerance": tolerance,
        "converged_steps": fit.steps,
        "converged_s": converged_s + sums_s,
        "converged_passes": fit.passes + 1,
        "zero_shot_accuracy": accuracy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small case, all 2,000 steps")
    parser.add_argument("--steps", type=int, default=10, help="proxy steps measured")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    info = common.machine_info(args.device)
    if args.quick:
        case = measure(10_000, 100, 128, DEFAULT_STEPS, args.device)
    else:
        case = measure(50_000, 1_000, 512, args.steps, args.device)
    info = common.finish_info(info)
    name = "inmap_quick" if args.quick else "inmap"
    name += "_cuda" if args.device.startswith("cuda") else ""
    path = common.write_result(name, {"machine": info, "case": case})
    headers = ["N × K × d", "labels s", "s / step", "sums s", "2,000 steps s", "passes"]
    headers += ["converged s", "converged passes"]
    size = f"{case['n']:,} × {case['k']:,} × {case['d']}"
    row = [size, case["labels_s"], case["step_s"], case["moment_sums_s"]]
    row += [case["inmap_default_s"], case["passes"], case["converged_s"], case["converged_passes"]]
    print(common.markdown_table(headers, [row]))
    print(case["zero_shot_accuracy"], f"(wrote {path})")


if __name__ == "__main__":
    main()
