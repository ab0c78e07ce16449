r"""Does the fusion choice's held-out trend read the classifiers, or the head's own fit?

Run: ``python benchmarks/trend_leakage.py`` (about 3 minutes on 2 cores, most of it the two
ImageNet-size worlds; ``--quick``: without them); prints one line per world and writes
``benchmarks/results/trend_leakage.json``.

The held-out trend (:mod:`frolic_tta.held_out`) refits each candidate's mixture on one fold and
scores the other. The candidates' labels there come from the fit on *all* samples: the head
alone's :math:`f_g` (and half of the pooled fusion) was fitted on the scoring fold too, so that
fold's samples reach their own score through the labels. :math:`f_c/\tau_c` alone does not
depend on the samples. This script reads the trend three ways (float64, ``fusion_choice.py``'s
``candidate_scores``, ``held_out`` and ``refit_scores``; one random split):

* ``full``: the library's way, every label from the fit on all samples, two halves;
* ``crossed``: each half labelled by the whole method fitted on that half alone
  (``frolic_tta.frolic`` on its rows), its mixture refitted there and scoring the other half:
  the labels saw the fold their mixture is refitted on, not the one scored;
* ``three-way``: each third scored by the mixture refitted on the next third, labelled there by
  the method fitted on the third after: no sample is in its labels' fit or its mixture's.

Each prints Vuong's Z of the head alone against the pooled fusion and of the zero-shot
classifier alone against the pooled fusion (the rule keeps the head alone where the first is
above 3.09 and the second below -3.09), beside the top-1 differences (pt) of the candidates each
one compares (``full``: the fit on all samples; the others: the labels of the parts' own fits),
every candidate matched to the full fit's test prior. Worlds: the README's at N = 800 and 2,000
(where the head alone gains), the CLIP-like label-shift worlds at ``peers.py``'s size (N =
20,000, where the trend is read and the head alone gains), the two ImageNet-size ones (where the
trend would fail and is gated off, N/2 < K r), and two means worlds where the head alone loses
(``no_harm_sweep.py``, K = 100).
"""

from __future__ import annotations

import argparse
import math
import warnings

import common
import torch
from fusion_choice import candidate_scores, held_out, refit_scores
from label_shift import build, world_specs

import frolic_tta
from frolic_tta.evidence import data_span
from frolic_tta.synthetic import clip_world, means_world, shifted_prior

CANDIDATES = ("pooled", "head alone", "zero-shot alone")
WAYS = ("full", "crossed", "three-way")


def fit(features: torch.Tensor, prototypes: torch.Tensor, tau_c: float) -> frolic_tta.FrolicResult:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return frolic_tta.frolic(features, prototypes, tau_c=tau_c, normalize=True)


def vuong(per: dict[str, torch.Tensor], key: str) -> float:
    diff = per[key] - per["pooled"]
    return float(diff.sum() / (math.sqrt(diff.shape[0]) * diff.std()))


def measure(x: torch.Tensor, z: torch.Tensor, y: torch.Tensor, tau_c: float) -> dict:
    whole = fit(x, z, tau_c)
    prior = whole.priors.test_prior.double()
    span = data_span(whole.sums)
    features = whole.features.double()
    n = features.shape[0]
    split = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    halves, thirds = list(split.chunk(2)), list(split.chunk(3))
    full = candidate_scores(whole, prior)
    per = {
        "full": {
            key: held_out(features, s.softmax(1), prior, span, halves) for key, s in full.items()
        }
    }
    crossed = {key: torch.empty_like(value) for key, value in full.items()}
    for rows in halves:  # each half labelled by the method fitted on it alone
        for key, value in candidate_scores(fit(x[rows], z, tau_c), prior).items():
            crossed[key][rows] = value
    per["crossed"] = {
        key: held_out(features, s.softmax(1), prior, span, halves) for key, s in crossed.items()
    }
    # each third scored by the mixture refitted on the next third, labelled there by the method
    # fitted on the third after: no sample is in its labels' fit or in its mixture's
    three = {key: torch.empty_like(value) for key, value in full.items()}
    per["three-way"] = {key: torch.empty(n, dtype=torch.float64) for key in CANDIDATES}
    for t, test in enumerate(thirds):
        train, labeller = thirds[(t + 1) % 3], thirds[(t + 2) % 3]
        scores = candidate_scores(fit(x[labeller], z, tau_c), prior, whole.features[train])
        for key, value in scores.items():
            three[key][train] = value  # every third is a training third once
            per["three-way"][key][test] = refit_scores(
                features[train], value.softmax(1), features[test], prior, span
            )
    out: dict = {
        "N": n,
        "K": z.shape[0],
        "rank": features.shape[1] if span is None else span.shape[1],
    }
    for way, scores in zip(WAYS, (full, crossed, three), strict=True):
        top1 = {key: frolic_tta.accuracy(s, y) for key, s in scores.items()}
        out[way] = {
            "Z head alone": vuong(per[way], "head alone"),
            "Z zero-shot alone": vuong(per[way], "zero-shot alone"),
            "top-1": top1,
            "head alone - pooled, pt": 100.0 * (top1["head alone"] - top1["pooled"]),
            "zero-shot alone - pooled, pt": 100.0 * (top1["zero-shot alone"] - top1["pooled"]),
        }
    return out


def worlds(quick: bool):
    for seed in range(3):
        world = clip_world(num_samples=800, seed=seed)
        yield f"README N=800 seed {seed}", world.features, world.prototypes, world.labels, 0.01
    world = clip_world(num_samples=2000, seed=0)
    yield "README N=2000 seed 0", world.features, world.prototypes, world.labels, 0.01
    specs = world_specs(False)
    names = ["clip balanced", "clip long-tailed 10"]
    names += [] if quick else ["imagenet balanced", "imagenet long-tailed 10"]
    for name in names:
        world, x, z, tau_c = build(specs[name], 0)
        yield f"{name} N={specs[name]['n']} seed 0", x, z, world.labels, tau_c
    for kind, seed in (("natural", 1), ("long-tailed:100", 0)):
        prior = shifted_prior(kind, 100, seed) if kind.startswith("long") else None
        world = means_world(
            10000, 100, 128, 0.3, seed=seed, test_prior=prior, sample=kind == "natural"
        )
        name = f"means K=100 {kind} 0.3 seed {seed}"
        yield name, world.features, world.prototypes, world.labels, 0.01


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="without the ImageNet-size worlds")
    args = parser.parse_args()
    info = common.machine_info()
    rows = []
    for name, x, z, y, tau_c in worlds(args.quick):
        row = {"world": name, **measure(x, z, y, tau_c)}
        rows.append(row)
        parts = []
        for way in WAYS:
            r = row[way]
            pair = f"({r['Z head alone']:6.1f}, {r['Z zero-shot alone']:6.1f})"
            gains = (
                f"({r['head alone - pooled, pt']:+5.2f}, {r['zero-shot alone - pooled, pt']:+6.2f})"
            )
            parts.append(f"{way} Z {pair} top-1 {gains}")
        print(f"{name:34s} " + " | ".join(parts), flush=True)
    payload = {"machine": common.finish_info(info), "quick": args.quick, "rows": rows}
    print(f"wrote {common.write_result('trend_leakage', payload).relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
