"""The default where there is nothing to correct, and against its own Gaussian head (issue 35,
items 1 and 4): the failing cases rebuilt, every seed of ``benchmarks/no_harm.py``'s worlds
(which prints them). Item 1 holds with ``bias_test="aic"`` only (a strict xfail for the default)."""

from __future__ import annotations

import warnings

import pytest

import frolic_tta
from frolic_tta.synthetic import MEANS_WORLDS, clip_world, means_world, shifted_prior


def accuracies(world, **options) -> dict[str, float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        result = frolic_tta.frolic(world.features, world.prototypes, **options)
    rows = result.ablations(world.labels)
    return {key: frolic_tta.accuracy(rows[key], world.labels) for key in rows}


MEANS = MEANS_WORLDS


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("spec", MEANS, ids=lambda s: f"K{s[0]}-noise{s[2]}-{s[3]}")
def test_prototypes_that_are_the_means_are_not_made_worse_with_the_bias_test(spec, seed):
    # bias_test="aic" (opt-in): -0.2 to +4.0 pt; the default (the bias always removed) is down
    # to -2.7 pt (x10) and -4.2 pt (x100) here, where beta-hat absorbs the test set's imbalance
    k, d, noise, kind, n = spec
    prior = None if kind == "balanced" else shifted_prior(kind, k, seed)
    world = means_world(n, k, d, noise, seed=seed, test_prior=prior)
    rows = accuracies(world, bias_test="aic")
    assert rows["f_d"] >= rows["f_c"] - 0.005  # (against max(f_c, f_g, f_c - ln beta): one
    # seed of the x10 world at zero-shot 0.55 is 0.65 pt under it, the corrected reading's f_d)


@pytest.mark.xfail(
    strict=True,
    reason="issue 35 item 1, open for the default: the test prior sees no shift "
    "(w = 0), so beta-hat absorbs the test set's own imbalance (measured -2.4 pt); "
    "bias_test='aic' holds it but misses a planted bias at low signal (test_evidence.py)",
)
def test_prototypes_that_are_the_means_are_not_made_worse_by_the_default():
    # zero-shot 0.339, long-tailed x10, K = 10, d = 16: measured f_d 0.315 (f_c - ln beta 0.317)
    world = means_world(2000, 10, 16, noise=1.0, test_prior=shifted_prior("long-tailed:10", 10))
    rows = accuracies(world)
    assert rows["f_d"] >= rows["f_c"] - 0.005


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_readme_world_is_not_below_its_own_gaussian_head(seed):
    # the README's first example: f_g 0.587 / 0.629 / 0.642; before fusion="selected" the pooled
    # fusion gave f_c half the weight: f_f 0.401 / 0.448 / 0.459, f_d 0.502 / 0.526 / 0.528
    rows = accuracies(clip_world(num_samples=2000, seed=seed))
    assert rows["f_d"] >= max(rows["f_c"], rows["f_g"], rows["f_c - ln beta"]) - 0.005
