r"""What the fusion choice (``fusion="selected"``) keeps, and what the head alone would score.

Run: ``python benchmarks/fusion_choice.py`` (about 3 minutes on 2 cores); prints one line per
world and seed and writes ``benchmarks/results/fusion_choice.json``. ``--quick``: 1 seed.

The default keeps :math:`f_g/\tau_g` alone (instead of the pooled fusion) where the mixture
refitted under its debiased labels is more likely than the pooled one's by more than
:math:`Kr/2` nats (:mod:`frolic_tta.fusion`, the *margin*), and, where N/2 > K r, where the
held-out likelihood rises significantly from the zero-shot labels to the pooled ones to the
head alone's, and the zero-shot labels' sample means beat the prototypes' image
(:mod:`frolic_tta.held_out`, the *trend*: its three Z in ``priors.fusion_trend``).
For every world this prints:

* ``gap``: the in-sample :math:`\ell(\text{head alone}) - \ell(\text{pooled})` the rule reads
  (the fit's ``fusion_gap`` plus :math:`Kr/2`; since 2026-11-27 22:30 UTC an upper bound where
  the pooled fusion's evidence lower bound decided, :mod:`frolic_tta.fusion`), beside the
  threshold :math:`Kr/2`, and
  ``here``, the same recomputed by this script in float64 (a check of its own math: the
  candidates' matchings are this script's, so it agrees to their tolerance, not exactly);
* ``held-out``: the same difference with each half of the samples scored by the mixtures
  refitted on the other half (2 folds, a seeded random split; float64), and its Vuong
  statistic :math:`Z = \sum_i d_i / (\sqrt N s_d)` (:math:`d_i` the per-sample difference);
* top-1 of the default's :math:`f_d`, of the pooled and of the head-alone candidate, each
  matched to the fit's test prior (:func:`frolic_tta.estimate_label_bias`, ``target``);
* a third candidate the rule does not have, :math:`f_c/\tau_c` alone (matched the same way):
  its in-sample and held-out :math:`\ell(\text{zero-shot alone}) - \ell(\text{pooled})`, Z
  and top-1 (could the same likelihood keep :math:`f_c` where the head is worse?).

Worlds: ``no_harm.py``'s (prototypes are the class means, 18 fits; the README's example, 3),
the README's example at N = 800 (40 samples per class, 3),
the CLIP-like label-shift worlds of ``label_shift.py --quick`` (N = 5,000, K = 50, d = 128)
and the digits model of ``peers.py --quick``. ``--clip-full``: only the CLIP-like worlds, at
``peers.py``'s full size (N = 20,000, the 30 % world too, 3 seeds) and ``label_shift.py``'s two
ImageNet-size worlds (N = 50,000, K = 1,000, d = 512, 1 seed; about 5 minutes), written to
``fusion_choice_clip_full.json``. ``--sweep``: only ``no_harm_sweep.py``'s means worlds (3 seeds,
every K; about 8 minutes), ``fusion_choice_sweep.json``. ``--large``: only means worlds large
enough for the held-out trend (K = 50, N = 20,000 and K = 100, N = 30,000; every test set, 3
seeds) and ``finalize.py``'s ImageNet-like geometry at three sizes where it is read (2 seeds;
about 3 minutes), ``fusion_choice_large.json``; with ``--tau-c`` another :math:`\tau_c`
(default 0.01), ``fusion_choice_large_tau<value>.json``.

The last lines sum what the trend changes against the margin alone (the default's f_d, but
this script's pooled candidate where the trend switched): the library's trend (its hashed folds,
read where N/2 > K r), and ``monotone``, the same trend on this script's random folds read in
every world (Z of the head alone over the pooled above 3.09 and Z of the zero-shot labels over
the pooled under -3.09, one-sided 0.1 % each). A rule is as good as the worlds it separates.
"""

from __future__ import annotations

import argparse
import itertools
import math
import warnings
from collections.abc import Iterator

import common
import no_harm
import torch
from label_shift import build, world_specs

import frolic_tta
from frolic_tta.evidence import data_span
from frolic_tta.prototype_means import LEVEL
from frolic_tta.synthetic import clip_world, means_world, shifted_prior

CLIP_WORLDS = ("clip balanced", "clip long-tailed 10", "clip long-tailed 100", "clip natural")
Case = tuple[str, int, torch.Tensor, torch.Tensor, torch.Tensor, float]


def clip_worlds(seeds: int, full: bool) -> Iterator[Case]:
    """The CLIP-like label-shift worlds (``full``: N = 20,000, the 30 % world and the two
    ImageNet-size ones, 1 seed each)."""
    specs = world_specs(not full)
    extra = ("clip 30% of classes", "imagenet balanced", "imagenet long-tailed 10")
    for name in (*CLIP_WORLDS, *extra) if full else CLIP_WORLDS:
        for seed in range(specs[name].get("seeds", seeds)):
            world, x, z, tau_c = build(specs[name], seed)
            yield f"{name} N={specs[name]['n']}", seed, x, z, world.labels, tau_c


def sweep_worlds(seeds: int) -> Iterator[Case]:
    """``no_harm_sweep.py``'s means worlds (every K)."""
    from no_harm_sweep import worlds as swept

    for spec, world in swept(seeds):
        name = f"means K={spec['k']} d={spec['d']} N={spec['n']} {spec['kind']} {spec['noise']}"
        yield name, spec["seed"], world.features, world.prototypes, world.labels, 0.01


LARGE = ((50, 64, 20000, 0.45), (100, 128, 30000, 0.3))
"""``--large``: means worlds (K, d, N, noise) where each fold outnumbers the means' parameters
(N/2 > K r), so the held-out trend is read; zero-shot 0.47-0.49 and 0.76-0.77."""


def large_worlds(seeds: int, tau_c: float = 0.01) -> Iterator[Case]:
    """Means worlds at :data:`LARGE`'s sizes, every test set of ``no_harm_sweep.py``, fitted at
    ``tau_c``."""
    from no_harm_sweep import KINDS

    for k, d, n, noise in LARGE:
        for kind in KINDS:
            for seed in range(seeds):
                prior = shifted_prior(kind, k, seed) if kind.startswith("long") else None
                world = means_world(
                    n, k, d, noise, seed=seed, test_prior=prior, sample=kind == "natural"
                )
                name = f"means K={k} d={d} N={n} {kind} {noise}"
                yield name, seed, world.features, world.prototypes, world.labels, tau_c


LARGE_CLIP = ((20000, 50, 128), (30000, 100, 128), (50000, 100, 128))
"""``--large``: ``finalize.py``'s ImageNet-like geometry (``common.clip_like``) where the trend is
read: biased prototypes at low signal (zero-shot 0.25-0.38), 2 seeds."""


def large_clip_worlds(tau_c: float = 0.01) -> Iterator[Case]:
    """The ImageNet-like worlds of :data:`LARGE_CLIP`, fitted at ``tau_c``."""
    for n, k, d in LARGE_CLIP:
        for seed in range(2):
            x, z, y = common.clip_like(n, k, d, "imagenet-like", seed=seed)
            yield f"imagenet-like K={k} d={d} N={n}", seed, x, z, y, tau_c


def worlds(seeds: int) -> Iterator[Case]:
    """``(name, seed, features, prototypes, labels, tau_c)`` of every world."""
    for name, seed, world in no_harm.worlds(seeds):
        yield name, seed, world.features, world.prototypes, world.labels, 0.01
    for seed in range(seeds):  # 40 samples per class: the head alone 5-7 pt above f_d
        world = clip_world(num_samples=800, seed=seed)
        yield "README clip_world N=800", seed, world.features, world.prototypes, world.labels, 0.01
    yield from clip_worlds(seeds, full=False)
    from digits_clip import QUICK_STEPS, encode, pretrain

    digits = pretrain(0, 20.0, QUICK_STEPS)
    x, z, y = encode(digits)
    yield "digits model (peers --quick)", 0, x, z, y, 1.0 / digits.logit_scale


def debiased(logits: torch.Tensor, prior: torch.Tensor, eps: float) -> torch.Tensor:
    r"""``logits`` matched to ``prior``: :math:`f - \ln\hat\beta + \ln\pi` (float64)."""
    beta = frolic_tta.estimate_label_bias(logits, target=prior, eps=eps)
    return logits.double() - beta.log() + prior.double().log()


def candidate_scores(
    result: frolic_tta.FrolicResult, prior: torch.Tensor, features: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    r"""The fusion's three candidates of ``result``: the pooled fusion
    :math:`\frac12(f_g/\tau_g + f_c/\tau_c)`, the head alone and the zero-shot classifier
    alone, each matched to ``prior`` (float64); on ``features``: ``result``'s head applied to
    other rows."""
    head = result.head
    if features is None:
        gda, zero_shot = result.gda_logits, result.zero_shot_logits
    else:
        gda, zero_shot = head.gaussian.gda().logits(features), head.zero_shot().logits(features)
    alone, zero_shot = gda.double() / head.tau_g, zero_shot.double() / head.tau_c
    logits = {
        "pooled": 0.5 * (alone + zero_shot),
        "head alone": alone,
        "zero-shot alone": zero_shot,
    }
    eps = result.options.solver.eps
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return {key: debiased(value, prior, eps) for key, value in logits.items()}


def held_out(
    x: torch.Tensor, labels: torch.Tensor, prior: torch.Tensor, span: torch.Tensor | None, folds
) -> torch.Tensor:
    r"""Per-sample :math:`\ln\sum_j \pi_j \mathcal N(x_i;\mu_j,\Sigma)` (up to a constant), each
    fold scored by the mixture refitted under the soft ``labels`` on the other folds (one fold:
    in sample, the rule's own statistic)."""
    out = torch.empty(x.shape[0], dtype=torch.float64)
    for f, test in enumerate(folds):
        others = [fold for g, fold in enumerate(folds) if g != f]
        train = torch.cat(others) if others else test
        out[test] = refit_scores(x[train], labels[train], x[test], prior, span)
    return out


def refit_scores(
    train: torch.Tensor,
    labels: torch.Tensor,
    test: torch.Tensor,
    prior: torch.Tensor,
    span: torch.Tensor | None,
) -> torch.Tensor:
    r"""``test``'s rows scored by the mixture refitted on ``train`` under its soft ``labels``
    (means, shared covariance on ``span``, weights ``prior``; float64)."""
    mean = train.mean(0)
    masses = labels.sum(0)
    means = (labels.t() @ train) / masses.clamp(min=1e-300)[:, None]
    centred = means - mean
    scatter = (train - mean).t() @ (train - mean) / train.shape[0]
    within = scatter - (centred * (masses / train.shape[0])[:, None]).t() @ centred
    y = test - mean
    if span is not None:
        within, y, centred = span.t() @ within @ span, y @ span, centred @ span
    factor = torch.linalg.cholesky(0.5 * (within + within.t()))
    weight = torch.cholesky_solve(centred.t(), factor).t()
    g = y @ weight.t() - 0.5 * (centred * weight).sum(1)
    quad = 0.5 * (y.t() * torch.cholesky_solve(y.t(), factor)).sum(0)
    log_det = torch.log(factor.diagonal()).sum()
    return torch.logsumexp(g + prior.log(), 1) - quad - log_det


def measure(x, z, labels, tau_c) -> dict[str, float | bool]:
    """One world: the default's fit, the rule's gap, the held-out gap and three accuracies."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        result = frolic_tta.frolic(x, z, tau_c=tau_c, normalize=True)
    head, features = result.head, result.features
    prior = result.priors.test_prior.double()
    span = data_span(result.sums)
    rank = features.shape[1] if span is None else span.shape[1]
    threshold = 0.5 * z.shape[0] * rank
    scores = candidate_scores(result, prior)
    x64 = features.double()
    split = torch.randperm(x64.shape[0], generator=torch.Generator().manual_seed(0))
    folds = list(split.chunk(2))
    per = {key: held_out(x64, s.softmax(1), prior, span, folds) for key, s in scores.items()}
    diff = per["head alone"] - per["pooled"]
    other = per["zero-shot alone"] - per["pooled"]
    whole = [torch.arange(x64.shape[0])]  # in sample: this script's math against the fit's gap
    rows = result.ablations(labels)
    own = {key: held_out(x64, s.softmax(1), prior, span, whole) for key, s in scores.items()}
    trend = result.priors.fusion_trend
    margin = result.priors.fusion_gap > 0.0
    return {
        "head alone chosen": head.zero_shot_weight == 0.0,
        "margin chose": margin,
        "trend": None if trend is None else list(trend),
        "trend chose": head.zero_shot_weight == 0.0 and not margin,
        "prototype z": result.priors.prototype_z,
        "gap": result.priors.fusion_gap + threshold,
        "gap here": float((own["head alone"] - own["pooled"]).sum()),
        "threshold": threshold,
        "held-out gap": float(diff.sum()),
        "held-out Z": float(diff.sum() / (math.sqrt(diff.shape[0]) * diff.std())),
        "zero-shot gap here": float((own["zero-shot alone"] - own["pooled"]).sum()),
        "zero-shot held-out gap": float(other.sum()),
        "zero-shot held-out Z": float(other.sum() / (math.sqrt(other.shape[0]) * other.std())),
        "f_c": frolic_tta.accuracy(result.zero_shot_logits, labels),
        "f_d": frolic_tta.accuracy(result.logits, labels),
        "pooled": frolic_tta.accuracy(scores["pooled"], labels),
        "head alone": frolic_tta.accuracy(scores["head alone"], labels),
        "zero-shot alone": frolic_tta.accuracy(scores["zero-shot alone"], labels),
        **{key: frolic_tta.accuracy(rows[key], labels) for key in ("f_g", "f_c - ln beta")},
    }


def monotone(row: dict) -> bool:
    """The candidate rule (module docstring): the held-out likelihood rises from f_c to the
    pooled labels to the head alone's, each step beyond the 0.1 % level."""
    return row["held-out Z"] > LEVEL and row["zero-shot held-out Z"] < -LEVEL


def summary(runs: list[dict]) -> str:
    """What each trend changes against the margin alone: fits switched, f_d's change, misses."""
    # the margin alone: f_d, but this script's pooled candidate where the trend switched
    margin = [r["pooled"] if r["trend chose"] else r["f_d"] for r in runs]
    rules = {
        "library's trend": [r["f_d"] for r in runs],
        "monotone (every world, random folds)": [
            r["head alone"] if monotone(r) and not r["margin chose"] else m
            for r, m in zip(runs, margin, strict=True)
        ],
    }

    def misses(values: list[float]) -> str:
        under_c = sum(v < r["f_c"] - 0.005 - 1e-9 for v, r in zip(values, runs, strict=True))
        top = [max(r["f_c"], r["f_g"], r["f_c - ln beta"]) for r in runs]
        under = sum(v < t - 0.005 - 1e-9 for v, t in zip(values, top, strict=True))
        return f"{under_c} under f_c - 0.5 pt, {under} under max(f_c, f_g, f_c - ln beta) - 0.5 pt"

    lines = [f"the margin alone: {misses(margin)}"]
    for name, new in rules.items():
        change = [100 * (a - b) for a, b in zip(new, margin, strict=True)]
        moved = [c for c, a, b in zip(change, new, margin, strict=True) if a != b]
        if name.startswith("library"):
            switched = sum(r["trend chose"] for r in runs)
        else:
            switched = sum(monotone(r) and not r["margin chose"] for r in runs)
        worst = f"worst {min(change):+.2f}, best {max(change):+.2f}" if moved else "none moved"
        lines.append(
            f"{name}: {switched} of {len(runs)} fits switch to the head alone; f_d change mean "
            f"{sum(change) / len(change):+.3f} pt, {worst}; {misses(new)}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed")
    parser.add_argument("--clip-full", action="store_true", help="CLIP-like worlds, N = 20,000")
    parser.add_argument("--sweep", action="store_true", help="no_harm_sweep.py's means worlds")
    parser.add_argument("--large", action="store_true", help="large worlds: N/2 > K r")
    parser.add_argument("--tau-c", type=float, default=0.01, help="tau_c of --large's fits")
    args = parser.parse_args()
    if args.tau_c != 0.01 and not args.large:
        parser.error("--tau-c applies to --large only")
    info = common.machine_info()
    runs = []
    seeds = 1 if args.quick else 3
    cases = clip_worlds(seeds, full=True) if args.clip_full else worlds(seeds)
    if args.sweep:
        cases = sweep_worlds(seeds)
    if args.large:
        cases = itertools.chain(large_worlds(seeds, args.tau_c), large_clip_worlds(args.tau_c))
    for name, seed, x, z, labels, tau_c in cases:
        row = {"world": name, "seed": seed, **measure(x, z, labels, tau_c)}
        runs.append(row)
        trend = " / ".join(f"{t:.1f}" for t in row["trend"] or ())
        kept = "pooled"
        if row["head alone chosen"]:
            kept = "head alone: " + ("margin" if row["margin chose"] else "trend")
        print(
            f"{name:40s} seed {seed}: gap {row['gap']:8.1f} (here {row['gap here']:8.1f}; "
            f"threshold {row['threshold']:6.0f}), "
            f"held-out {row['held-out gap']:7.1f} Z {row['held-out Z']:5.1f} | f_c "
            f"{row['f_c']:.4f} f_d {row['f_d']:.4f} ({kept}) pooled {row['pooled']:.4f} "
            f"head alone {row['head alone']:.4f} ({100 * (row['head alone'] - row['pooled']):+.2f}"
            f" pt) | zero-shot alone: gap {row['zero-shot gap here']:7.1f}, held-out "
            f"{row['zero-shot held-out gap']:7.1f} Z {row['zero-shot held-out Z']:5.1f}, "
            f"{row['zero-shot alone']:.4f} "
            f"({100 * (row['zero-shot alone'] - row['pooled']):+.2f} pt)"
            + (f" | trend Z {trend}" if trend else "")
            + (" | monotone: head alone" if monotone(row) else ""),
            flush=True,
        )
    print(summary(runs))
    payload = {"machine": common.finish_info(info), "runs": runs}
    name = "fusion_choice_clip_full" if args.clip_full else "fusion_choice"
    name = "fusion_choice_sweep" if args.sweep else name
    name = "fusion_choice_large" if args.large else name
    name += "" if args.tau_c == 0.01 else f"_tau{args.tau_c:g}"
    print(f"wrote {common.write_result(name, payload).relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
