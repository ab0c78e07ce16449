"""ImageNet-21k finalize, traced as it runs: each phase and every 10th pass with its time.

Run: ``python benchmarks/trace_21k.py --device cuda`` (issue 35, item 2's world: N = 200,000,
K = 21,841, d = 512, ~9 samples per class drawn from a uniform prior, zero-shot ~0.35, chunks of
4,096 rows; on an H200, 2026-11-27: 24 s). ``--balanced`` runs ``finalize.py``'s own 21k world
(labels ``i % K``, zero-shot ~0.29) instead; ``--n`` sets N (the CPU needs about 9 s a pass at
N = 30,000); ``--keep-logits`` holds the N x K logits (``fit_frolic``'s default: 17.5 GB at
N = 200,000) instead of recomputing them every pass.

What ``finalize.py`` measures in a subprocess, after an audit run and only at the end, this
prints line by line from one run (flushed, so a run stopped by a time limit still shows how far
it came): ``FrolicMoments`` sums over batches of 8,192 features, then ``fit_frolic`` with
``keep_logits=False``; passes are ``reduce_fn`` calls (each ends one pass over the N x K
logits); each weight solve and matching prints its passes and time as it ends. The block
Newton steps' quadratic programs run on the host (float64, on the reduced Hessian): their
count and time are printed at the end. The last lines give the test prior's own account
(``priors``: converged, passes, shift weight) and the zero-shot and Frolic
(:meth:`~frolic_tta.FrolicHead.score`) accuracies.
"""

from __future__ import annotations

import argparse

import common
import torch

import frolic_tta.debias as debias
import frolic_tta.evidence as evidence
import frolic_tta.mixture_newton as mixture_newton
import frolic_tta.prior as prior
from frolic_tta.metrics import FrolicMoments
from frolic_tta.options import FrolicOptions
from frolic_tta.pipeline import fit_frolic

TAU_C, EPS = 0.01, 0.01


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--keep-logits", action="store_true", help="hold the N x K logits")
    parser.add_argument(
        "--balanced", action="store_true", help="finalize.py's 21k world instead of item 2's"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    geometry = "imagenet-like" if args.balanced else "imagenet-21k"
    x, z, labels = common.clip_like(args.n, 21_841, 512, geometry, sampled=not args.balanced)
    x, z = x.to(device), z.to(device)
    print(common.machine_info(args.device), flush=True)
    start = common.now()
    moments = FrolicMoments(z, TAU_C, keep_logits=False).to(device)
    for row in range(0, args.n, 8192):
        moments.update(x[row : row + 8192])
    sums = moments.compute()
    common.sync(device)
    print(f"moments {common.now() - start:.1f} s", flush=True)
    passes = [0]
    programs = [0, 0.0]  # the Newton steps' quadratic programs: count, seconds
    program = mixture_newton._nonnegative_qp

    def timed_qp(*args: object) -> torch.Tensor:
        begin = common.now()
        try:
            return program(*args)
        finally:
            programs[0] += 1
            programs[1] += common.now() - begin

    mixture_newton._nonnegative_qp = timed_qp

    def counted(module: object, name: str) -> None:  # each solve's passes and time, as it ends
        solve = getattr(module, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            before, begin = passes[0], common.now()
            result = solve(*args, **kwargs)
            common.sync(device)
            where = module.__name__.rsplit(".", 1)[-1]
            print(
                f"{common.now() - start:8.2f} s  pass {passes[0]:4d}  {name} ({where}): "
                f"{passes[0] - before} passes, {common.now() - begin:.2f} s",
                flush=True,
            )
            return result

        setattr(module, name, wrapper)

    for module in (prior, evidence):
        counted(module, "mixture_weights")
    for module in (prior, evidence, debias):
        counted(module, "match_class_masses")
    start = common.now()

    def stamp(what: str) -> None:
        common.sync(device)
        print(f"{common.now() - start:8.2f} s  pass {passes[0]:4d}  {what}", flush=True)

    def reduce_fn(tensor: torch.Tensor) -> torch.Tensor:
        passes[0] += 1
        if passes[0] % 10 == 0:
            stamp("")
        return tensor

    fit = fit_frolic(
        x,
        z,
        FrolicOptions(),
        tau_c=TAU_C,
        solver={"eps": EPS},
        sums=sums,
        reduce_fn=reduce_fn,
        keep_logits=args.keep_logits,
        chunk_size=args.chunk_size,
        progress=lambda phase: stamp(f"-> {phase}"),
    )
    common.sync(device)
    seconds = common.now() - start
    priors = fit.priors
    print(
        f"fit {seconds:.1f} s, {passes[0]} passes; test prior: converged {priors.converged}, "
        f"{priors.passes} passes, shift weight {priors.shift_weight:.3f}, likelihood ratio "
        f"{priors.likelihood_ratio:.0f} (K - 1 = 21,840); {programs[0]} quadratic programs on "
        f"the host, {programs[1]:.1f} s",
        flush=True,
    )
    rows = range(0, args.n, 8192)
    zero_shot = torch.cat([(x[i : i + 8192] @ z.t()).argmax(1).cpu() for i in rows])
    frolic = torch.cat([fit.head.score(x[i : i + 8192]).argmax(1).cpu() for i in rows])
    print(
        f"accuracy: zero-shot {float((zero_shot == labels).double().mean()):.4f}, "
        f"Frolic {float((frolic == labels).double().mean()):.4f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
