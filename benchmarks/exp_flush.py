"""What :func:`frolic_tta.logits.flushed_exp` saves against ``torch.exp`` on the CPU.

Run: ``python benchmarks/exp_flush.py`` (about 5 minutes on 2 cores; writes
``benchmarks/results/exp_flush.json``).

The CPU's vectorised ``exp`` is 15 to 50 times slower on a vector with a result below float32's
smallest normal. ``flushed_exp`` clamps at :math:`e^{-87}` first and sets what it clamped to 0.
This script fits the default 8 times per world, ``flushed_exp`` (as shipped) and plain
``torch.exp`` (in every module that calls it) in A B B A order, and reports the median fit
time of each, whether tau_g, beta and the logits are bit-identical, and how many exponentials
were flushed.
Worlds: fewer samples than classes (N = 2,000, K = 5,000, d = 512: the mixture's EM passes
over log-likelihoods more than 87 nats deep) and the ImageNet-size world of ``finalize.py``.
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import common
import torch

from frolic_tta import calibration, gda, logits, matching, mixture, mixture_newton, scores
from frolic_tta.metrics import FrolicMoments
from frolic_tta.pipeline import fit_frolic

MODULES = (calibration, gda, matching, mixture, mixture_newton, scores)


def _plain(values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return torch.exp(values, out=values if out is None else out)


def world(n: int, k: int, d: int, repeats: int) -> dict[str, object]:
    """Alternating runs of both exponentials on one world."""
    x, z, labels = common.clip_like(n, k, d)
    moments = FrolicMoments(z, 0.01, keep_logits=True)
    for start in range(0, n, 256):
        moments.update(x[start : start + 256])
    sums, kept = moments.compute(), moments.zero_shot_logits()
    flushed = [0]

    def counting(values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        low = logits.FLUSH_BELOW.get(values.dtype)
        flushed[0] += 0 if low is None else int((values < low + 0.01).sum())
        return logits.flushed_exp(values, out)

    walls: dict[str, list[float]] = {"flushed_exp": [], "torch.exp": []}
    fits = {}
    for run in range(2 * repeats + 1):  # the first (counting) run is not timed
        name = "torch.exp" if (run - 1) % 4 in (1, 2) else "flushed_exp"  # A B B A: no order
        exp = counting if run == 0 else {"torch.exp": _plain}.get(name, logits.flushed_exp)
        for module in MODULES:
            module.flushed_exp = exp
        scratch = kept.clone()  # fit_frolic overwrites the zero-shot logits it is given
        start = common.now()
        fit = fit_frolic(
            x, z, tau_c=0.01, solver={"eps": 0.01}, sums=sums, zero_shot_logits=scratch
        )
        if run:
            walls[name].append(common.now() - start)
            fits[name] = fit
    for module in MODULES:
        module.flushed_exp = logits.flushed_exp
    a, b = fits["flushed_exp"], fits["torch.exp"]
    result = {
        "n": n,
        "k": k,
        "d": d,
        "fit_s": {name: statistics.median(w) for name, w in walls.items()},
        "fit_s_runs": walls,
        "flushed_entries": flushed[0],
        "identical": a.head.tau_g == b.head.tau_g
        and torch.equal(a.head.beta, b.head.beta)
        and torch.equal(a.logits, b.logits),
        "accuracy": float((a.logits.argmax(1) == labels).double().mean()),
    }
    print(result, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the N < K world warns about undetermined classes
    info = common.machine_info("cpu")
    worlds = [world(2000, 5000, 512, args.repeats), world(50_000, 1000, 512, args.repeats)]
    payload = {"machine": common.finish_info(info), "worlds": worlds}
    print(f"wrote {common.write_result('exp_flush', payload).relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
