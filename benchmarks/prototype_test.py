r"""A candidate rule for "leave f_c alone where nothing can be learned", measured, not adopted.

Run: ``python benchmarks/prototype_test.py`` (about 2 minutes on 2 cores); prints a summary per
family of worlds, the fits the rule would change, and writes
``benchmarks/results/prototype_test.json``.

The default misses f_d >= f_c - 0.5 pt on 8 of 96 prototypes-are-the-means fits at K <= 20
(``no_harm_sweep.py``): there the Gaussian head is a noisy copy of the prototypes' own
direction and the pooled fusion keeps half its loss. The candidate asks the images whether the
head's class means :math:`\hat\mu_j` are the prototypes' up to the modality gap and a scale,
:math:`\mu_j = c + a z_j` (beyond their sampling noise:

.. math::
    T = \sum_j n^{\text{eff}}_j\, r_j^\top\hat\Sigma^{-1} r_j,\quad
    r_j = \hat\mu_j - c - a z_j,\quad
    n^{\text{eff}}_j = \frac{(\sum_i q_{ij})^2}{\sum_i q_{ij}^2},\quad
    z = \frac{T - \nu}{\sqrt{2\nu}},\ \nu = (K - 1) r - 1,

with :math:`c, a` by weighted least squares in :math:`\hat\Sigma^{-1}`, :math:`z_j` as
:math:`f_c` reads them (all on the data's span), and :math:`q` the head's
soft labels (Kish's effective counts: each mean is a weighted mean of its soft labels). Where
:math:`z \le 3.09` (one-sided 0.1 %), the rule keeps :math:`f_c` alone (the fit's
``f_c - ln beta`` row: :math:`f_c/\tau_c` matched to the test prior), with the uncorrected
reading's preliminary test at Akaike's level (:math:`\Lambda_M > 2(K - 1)`, the label-bias
test's K - 1 nats) instead of :math:`c = 0.5` (uniform weights otherwise); elsewhere the
default's f_d. Everything is computed here from the default's fit; the library is unchanged.

``--directions`` tests :math:`\mu_j = c + a\hat\Sigma z_j` instead (the head's LDA directions
are the prototypes; prints only).

Worlds: ``no_harm_sweep.py``'s (K = 5-100), the README's example (3 seeds), the Gaussian world
of ``accuracy.py`` (``paper_world``: the means are the prototypes, the covariance anisotropic,
3 seeds), the CLIP-like and
Proposition 2 worlds of ``label_shift.py --quick`` (seed 0), the random-weight encoder's 512
features of ``tests/data/encoder_world.pt`` (``benchmarks/ddp.py``'s world) and the digits
model of ``peers.py --quick``.
"""

from __future__ import annotations

import argparse
import math
import warnings
from collections import defaultdict
from pathlib import Path

import common
import no_harm_sweep
import torch
from fusion_choice import debiased
from label_shift import build, world_specs

import frolic_tta
from frolic_tta.evidence import data_span
from frolic_tta.prototype_means import prototype_statistic
from frolic_tta.synthetic import clip_world, paper_world

CRITICAL = 3.09  # one-sided 0.1 %
PRETEST = 2.0  # Akaike: Lambda_M > 2 (K - 1)


def head_labels(result) -> torch.Tensor:
    """The default's head labels q ``(N, K)`` rebuilt from its fit: the zero-shot posterior,
    debiased where the label-bias test removed the bias (the corrected reading)."""
    scores = result.zero_shot_logits.double() / result.head.tau_c
    if result.priors.label_bias_evidence > 0:
        scores = scores - result.head.zero_shot_beta.double().log() + result.priors.test_prior.log()
    return scores.softmax(1)


def prototype_z(result, directions: bool = False) -> float:
    r"""The statistic :math:`z` of the module docstring, from the default's fit."""
    head = result.head
    means, sigma = head.gaussian.class_means, head.gaussian.shared_covariance
    z = head.prototypes.double()  # as f_c reads them
    span = data_span(result.sums)  # on the data's span (Proposition 2's constant coordinate)
    if span is not None:
        means, z, sigma = means @ span, z @ span, span.t() @ sigma @ span
    if directions:  # the hypothesis that the head's LDA directions are the prototypes
        z = z @ sigma
    q = head_labels(result)
    counts = q.sum(0)
    keep = counts > 1e-9
    effective = counts**2 / (q**2).sum(0).clamp_min(1e-300)
    residual = means - prototype_statistic(means, sigma, counts, z, None)[0]  # the library's fit
    factor = torch.linalg.cholesky(sigma)
    mahalanobis = (residual * torch.cholesky_solve(residual.t(), factor).t()).sum(1)
    dof = (int(keep.sum()) - 1) * means.shape[1] - 1
    statistic = float((effective * mahalanobis)[keep].sum())
    return (statistic - dof) / math.sqrt(2 * dof)


def measure(x, z, labels, directions: bool = False, **kwargs) -> dict[str, float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        result = frolic_tta.frolic(x, z, **kwargs)
        rows = {key: frolic_tta.accuracy(v, labels) for key, v in result.ablations(labels).items()}
    priors, k = result.priors, z.shape[0]
    statistic = prototype_z(result, directions)
    alone = rows["f_c - ln beta"]
    uncorrected = priors.label_bias_evidence <= 0
    if uncorrected and priors.shift_weight > 0 and priors.likelihood_ratio <= PRETEST * (k - 1):
        uniform = torch.full((k,), 1.0 / k, dtype=torch.float64)  # the pretest says no shift
        scores = result.zero_shot_logits.double() / result.head.tau_c
        alone = frolic_tta.accuracy(debiased(scores, uniform, result.options.solver.eps), labels)
    best = max(rows["f_c"], rows["f_g"], rows["f_c - ln beta"])
    rule = alone if statistic <= CRITICAL else rows["f_d"]
    return {"z": statistic, "f_c": rows["f_c"], "f_d": rows["f_d"], "rule": rule, "max": best}


def under(rows: list[dict[str, float]], key: str, bound: str) -> int:
    """How many ``rows`` have ``key`` more than 0.5 pt under ``bound``."""
    return sum(r[key] < r[bound] - 0.005 - 1e-12 for r in rows)


def worlds():
    """``(family, name, features, prototypes, labels, frolic kwargs)``."""
    for spec, w in no_harm_sweep.worlds():
        k, n = spec["k"], spec["n"]
        family = f"means K={k} N={n}" + ("" if k <= 20 else " (beyond K <= 20)")
        name = f"K={k} {spec['kind']} noise {spec['noise']} seed {spec['seed']}"
        yield family, name, w.features, w.prototypes, w.labels, {}
    for seed in range(3):
        w = clip_world(num_samples=2000, seed=seed)
        yield "README", f"seed {seed}", w.features, w.prototypes, w.labels, {}
    for seed in range(3):  # accuracy.py's: the means are the prototypes, Sigma is anisotropic
        w = paper_world(5000, seed=seed)
        kwargs = {"normalize": False}
        yield "paper's Gaussian world", f"seed {seed}", w.features, w.prototypes, w.labels, kwargs
    specs = world_specs(True)
    for name, spec in specs.items():
        world, x, z, tau_c = build(spec, 0)
        kwargs = {"tau_c": tau_c, "normalize": spec["kind"] != "prop2"}
        yield "label_shift.py --quick", name, x, z, world.labels, kwargs
    saved = torch.load(Path(common.ROOT) / "tests" / "data" / "encoder_world.pt", weights_only=True)
    x = torch.nn.functional.normalize(saved["features"].float(), dim=1)
    yield (
        "random encoder",
        "512 features",
        x,
        saved["prototypes"].float(),
        saved["labels"],
        {"tau_c": 0.07},
    )
    from digits_clip import QUICK_STEPS, encode, pretrain

    digits = pretrain(0, 20.0, QUICK_STEPS)
    x, z, y = encode(digits)
    yield "digits model", "peers --quick", x, z, y, {"tau_c": 1.0 / digits.logit_scale}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--directions",
        action="store_true",
        help="test mu_j = c + a Sigma z_j (LDA directions = prototypes) instead; no JSON",
    )
    args = parser.parse_args()
    info = common.machine_info()
    runs = []
    for family, name, x, z, labels, kwargs in worlds():
        row = {"family": family, "world": name, **measure(x, z, labels, args.directions, **kwargs)}
        runs.append(row)
        if row["rule"] != row["f_d"]:
            print(
                f"{family:24s} {name:40s} z {row['z']:6.1f}: f_c {row['f_c']:.4f} f_d "
                f"{row['f_d']:.4f} -> {row['rule']:.4f} "
                f"({100 * (row['rule'] - row['f_d']):+.2f} pt)",
                flush=True,
            )
    families = defaultdict(list)
    for row in runs:
        families[row["family"]].append(row)
    summary = []
    for family, rows in families.items():
        line = {
            "family": family, "fits": len(rows),
            "f_c alone": sum(r["z"] <= CRITICAL for r in rows),
            "z min": min(r["z"] for r in rows), "z max": max(r["z"] for r in rows),
            "default under f_c - 0.5": under(rows, "f_d", "f_c"),
            "rule under f_c - 0.5": under(rows, "rule", "f_c"),
            "default under max - 0.5": under(rows, "f_d", "max"),
            "rule under max - 0.5": under(rows, "rule", "max"),
            "largest change": max(abs(r["rule"] - r["f_d"]) for r in rows),
        }  # fmt: skip
        summary.append(line)
        print(
            f"{family:34s} {len(rows):3d} fits, z {line['z min']:7.1f} to {line['z max']:7.1f}, "
            f"f_c alone on {line['f_c alone']:3d}; under f_c - 0.5 pt: "
            f"{line['default under f_c - 0.5']} -> {line['rule under f_c - 0.5']}, under max - 0.5 "
            f"pt: {line['default under max - 0.5']} -> {line['rule under max - 0.5']}; largest "
            f"change {100 * line['largest change']:.2f} pt"
        )
    if not args.directions:
        payload = {"machine": common.finish_info(info), "summary": summary, "runs": runs}
        print(f"wrote {common.write_result('prototype_test', payload).relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
