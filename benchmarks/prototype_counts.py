r"""The head-means test on soft counts, on effective ones where needed (the library), or on both.

Run: ``python benchmarks/prototype_counts.py`` (about 3 minutes on 2 cores; ``--seeds 10``:
about 10); prints every fit whose f_d differs between the three and one line per K, and writes
``benchmarks/results/prototype_counts.json`` (``prototype_counts_seeds10.json``).

A soft mean is a weighted mean, whose noise is :math:`\hat\Sigma\sum_i q_{ij}^2 / n_j^2 =
\hat\Sigma / n^{\text{eff}}_j` with Kish's effective count :math:`n^{\text{eff}}_j = n_j^2 /
\sum_i q_{ij}^2 \ge n_j` (:mod:`frolic_tta.prototype_means`). Three readings of the test, each
fitted by the default pipeline on the same features:

* ``soft``: the soft counts :math:`n_j` for both tails (before 2026-11-28, b3b35ae);
* ``library``: the default, the soft counts' z, or the effective counts' where the soft
  counts' is under -3.09 (a lower bound there);
* ``effective``: the effective counts for both tails (the counts patched into
  :func:`~frolic_tta.prototype_means.prototype_statistic`, the ratio :math:`n^{\text{eff}}_j /
  n_j` taken from the library fit's head labels, :math:`f_c/\tau_c` debiased to the test prior
  where the label bias was removed: ``prototype_test.py``'s ``q``).

Each reading tests the scale :math:`\hat a` on its own counts too (the library's t).

Worlds: ``no_harm_sweep.py``'s (the prototypes are the class means, K = 5-100), the README's
example at N = 2,000 and at N = 800 (10 seeds: 40 samples per class), and the random-weight
encoder's 512 features (``tests/data/encoder_world.pt``, :math:`\tau_c` = 0.07 as
``tests/test_no_harm.py`` fits them).
"""

from __future__ import annotations

import argparse
import warnings
from collections import defaultdict
from pathlib import Path

import common
import no_harm_sweep
import torch
from prototype_test import head_labels

import frolic_tta
from frolic_tta import pipeline, prototype_means
from frolic_tta.synthetic import clip_world

LIBRARY = prototype_means.prototype_statistic
TESTED = pipeline.tested_means
READINGS = ("soft", "library", "effective")


def fits(x, z, **kwargs) -> dict:
    """The default fitted under each of :data:`READINGS`."""

    def soft_counts(head, prototypes, sums, span, squares=None):
        return TESTED(head, prototypes, sums, span)  # no effective counts for either tail

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out["library"] = frolic_tta.frolic(x, z, **kwargs)
        q = head_labels(out["library"])
        ratio = q.sum(0) / (q * q).sum(0).clamp_min(1e-300)  # n_eff / n

        def effective(means, covariance, counts, prototypes, span):
            return LIBRARY(means, covariance, counts * ratio.to(counts), prototypes, span)

        pipeline.tested_means = soft_counts
        try:
            out["soft"] = frolic_tta.frolic(x, z, **kwargs)
            prototype_means.prototype_statistic = effective
            out["effective"] = frolic_tta.frolic(x, z, **kwargs)
        finally:
            pipeline.tested_means, prototype_means.prototype_statistic = TESTED, LIBRARY
    return out


def row(x, z, labels, **kwargs) -> dict[str, float]:
    acc = {"f_c": frolic_tta.accuracy(x @ z.t(), labels)}
    for name, fit in fits(x, z, **kwargs).items():
        rows = fit.ablations()
        for key in ("f_g", "f_d"):
            acc[f"{key} {name}"] = frolic_tta.accuracy(rows[key], labels)
        acc[f"z {name}"] = fit.priors.prototype_z
    return acc


def changed(r: dict) -> bool:
    return len({r[f"f_d {name}"] for name in READINGS}) > 1


def describe(r: dict) -> str:
    z = " / ".join(f"{r[f'z {n}']:+.1f}" for n in READINGS)
    f_g = " / ".join(f"{r[f'f_g {n}']:.4f}" for n in READINGS)
    f_d = " / ".join(f"{r[f'f_d {n}']:.4f}" for n in READINGS)
    return f"z {z}, f_c {r['f_c']:.4f}, f_g {f_g}, f_d {f_d} ({' / '.join(READINGS)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    info = common.machine_info()
    runs = []
    for spec, w in no_harm_sweep.worlds(args.seeds):
        runs.append({**spec, **row(w.features, w.prototypes, w.labels)})
        r = runs[-1]
        if changed(r):
            where = f"K={r['k']} {r['kind']} noise {r['noise']} seed {r['seed']}"
            print(f"{where}: {describe(r)}", flush=True)
    groups, summary = defaultdict(list), []
    for r in runs:
        groups[r["k"]].append(r)
    for k, rows in groups.items():
        line: dict = {"k": k, "fits": len(rows)}
        for name in READINGS:
            values = [r[f"z {name}"] for r in rows]
            line[f"z range {name}"] = [min(values), max(values)]
            line[f"under f_c - 0.5 pt {name}"] = sum(
                r[f"f_d {name}"] < r["f_c"] - 0.005 - 1e-12 for r in rows
            )
            line[f"mean f_d - f_c {name}"] = sum(r[f"f_d {name}"] - r["f_c"] for r in rows) / len(
                rows
            )
        summary.append(line)
        parts = [
            f"{n} z {line[f'z range {n}'][0]:+.1f}..{line[f'z range {n}'][1]:+.1f}, "
            f"{line[f'under f_c - 0.5 pt {n}']} under f_c - 0.5 pt, mean f_d - f_c "
            f"{100 * line[f'mean f_d - f_c {n}']:+.2f} pt"
            for n in READINGS
        ]
        print(f"K={k:3d}, {len(rows):3d} fits: " + "; ".join(parts))
    others = []
    for n, seeds in ((2000, 3), (800, 10)):
        for seed in range(seeds):
            w = clip_world(num_samples=n, seed=seed)
            name = f"README's world N={n} seed {seed}"
            others.append({"world": name, **row(w.features, w.prototypes, w.labels)})
    saved = torch.load(Path(common.ROOT) / "tests" / "data" / "encoder_world.pt", weights_only=True)
    x = torch.nn.functional.normalize(saved["features"].float(), dim=1)
    z, labels = saved["prototypes"].float(), saved["labels"]
    others.append({"world": "random encoder", **row(x, z, labels, tau_c=0.07)})
    for r in others:
        print(f"{r['world']}: {describe(r)}")
    payload = {"machine": common.finish_info(info), "summary": summary, "others": others}
    payload["runs"] = runs
    name = "prototype_counts" if args.seeds == 3 else f"prototype_counts_seeds{args.seeds}"
    print(f"wrote {common.write_result(name, payload).relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
