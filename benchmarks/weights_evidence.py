r"""Do an image mixture's weights say whether the test set is imbalanced, at low signal?

Run: ``python benchmarks/weights_evidence.py`` (about a minute on 2 cores); prints one line per
world and writes ``benchmarks/results/weights_evidence.json``.

The label-bias test (:mod:`frolic_tta.evidence`) misses a planted text bias at low signal, and
more samples make the miss stronger (``benchmarks/no_harm.py``, docs/method.md). This script
asks whether the nested test would do better: the maximum-likelihood Gaussian mixture of the
images (K means, one shared covariance, the weights) with its weights free against held
uniform, each run to convergence by plain EM from both labellings (the debiased and the raw
zero-shot posterior, :math:`\tau_c = 0.01`, :math:`\hat\beta_c` of the bias-removing fit),
the best of the two kept. A test set drawn from uniform class weights should give
:math:`2(\ell_\text{free} - \ell_\text{uniform}) \approx \chi^2_{K-1}`, about K - 1; an
imbalanced one more.

It is an independent float64 EM (not the package's solvers), 200 iterations, on worlds with
known truth: ``clip_like_world`` with a planted bias and a balanced or long-tailed test set
(the misses), the same generator at high signal, and the means worlds of issue 35 item 1 (no
bias; balanced, long-tailed x10 and x100). The columns: zero-shot accuracy, the statistic
against K - 1, and the effective number of classes :math:`e^{H(\pi)}` of the free weights
beside the truth's.
"""

from __future__ import annotations

import math
import warnings

import common
import torch

import frolic_tta
from frolic_tta.synthetic import World, clip_like_world, means_world, shifted_prior

ITERATIONS = 200


def em(features: torch.Tensor, labels: torch.Tensor, free: bool) -> tuple[float, torch.Tensor]:
    """``(log-likelihood, weights)`` after :data:`ITERATIONS` EM steps from soft ``labels``."""
    n, d = features.shape
    k = labels.shape[1]
    gram = features.t() @ features
    for _ in range(ITERATIONS):
        masses = labels.sum(0).clamp(min=1e-9)
        means = labels.t() @ features / masses[:, None]
        within = (gram - (means * masses[:, None]).t() @ means) / n
        factor = torch.linalg.cholesky(0.5 * (within + within.t()))
        weight = torch.cholesky_solve(means.t(), factor).t()  # (K, d)
        quadratic = 0.5 * (features * torch.cholesky_solve(features.t(), factor).t()).sum(1)
        log_det = 2.0 * float(torch.log(torch.diagonal(factor)).sum())
        prior = masses / n if free else torch.full((k,), 1.0 / k, dtype=features.dtype)
        logits = features @ weight.t() - 0.5 * (means * weight).sum(1) + prior.log()
        rows = torch.logsumexp(logits, 1) - quadratic - 0.5 * (log_det + d * math.log(2 * math.pi))
        labels = torch.softmax(logits, 1)
    return float(rows.sum()), prior


def effective(prior: torch.Tensor) -> float:
    """:math:`e^{H(\\pi)}`: the number of equal classes with the same entropy."""
    prior = prior[prior > 0]
    return float(torch.exp(-(prior * prior.log()).sum()))


def row(name: str, world: World) -> dict[str, float | str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        removed = frolic_tta.frolic(world.features, world.prototypes, bias_test="off")
    features = world.features.double()
    logits = features @ world.prototypes.double().t() / removed.head.tau_c
    starts = {
        "raw": torch.softmax(logits, 1),
        "debiased": torch.softmax(logits - removed.head.zero_shot_beta.double().log(), 1),
    }
    fits = {(start, free): em(features, q, free) for start, q in starts.items() for free in (0, 1)}
    uniform = max(fits[(start, 0)][0] for start in starts)
    best = max(starts, key=lambda start: fits[(start, 1)][0])
    k = world.prototypes.shape[0]
    truth = torch.bincount(world.labels, minlength=k).double()
    return {
        "world": name,
        "K - 1": k - 1,
        "zero-shot": frolic_tta.accuracy(logits, world.labels),
        "2 (l_free - l_uniform)": 2.0 * (fits[(best, 1)][0] - uniform),
        "effective classes, free weights": effective(fits[(best, 1)][1]),
        "effective classes, truth": effective(truth / truth.sum()),
    }


def worlds() -> list[tuple[str, World]]:
    out = [
        ("clip_like K=50 d=32 N=2000 bias, balanced", clip_like_world(2000, 50, 32, seed=0)),
        ("clip_like K=50 d=32 N=8000 bias, balanced", clip_like_world(8000, 50, 32, seed=0)),
        (
            "clip_like K=6 d=16 N=600 bias, long-tailed:10",
            clip_like_world(600, 6, 16, seed=2, test_prior=shifted_prior("long-tailed:10", 6, 2)),
        ),
        ("clip_like K=50 d=128 N=8000 bias, balanced", clip_like_world(8000, 50, 128, seed=0)),
    ]
    for kind in (None, "long-tailed:10", "long-tailed:100"):
        for k, d, noise in ((10, 16, 1.0), (20, 32, 0.45)):
            prior = None if kind is None else shifted_prior(kind, k)
            world = means_world(2000, k, d, noise=noise, seed=0, test_prior=prior)
            out.append((f"means K={k} d={d} no bias, {kind or 'balanced'}", world))
    return out


def main() -> None:
    info = common.machine_info()
    rows = []
    for name, world in worlds():
        rows.append(row(name, world))
        r = rows[-1]
        print(
            f"{name:46s} zero-shot {r['zero-shot']:.3f}  2(l_free - l_uniform) "
            f"{r['2 (l_free - l_uniform)']:8.1f} against K - 1 = {r['K - 1']:3d}  effective "
            f"classes {r['effective classes, free weights']:5.1f} (truth "
            f"{r['effective classes, truth']:.1f})",
            flush=True,
        )
    payload = {"machine": common.finish_info(info), "iterations": ITERATIONS, "rows": rows}
    print(f"wrote {common.write_result('weights_evidence', payload).relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
