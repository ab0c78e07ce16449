"""The default under test label shift, on separable and confident data, and in the balanced
setting, on worlds with known test priors (``benchmarks/label_shift.py`` measures the same at
full size)."""

from __future__ import annotations

import warnings

import pytest
import torch

import frolic_tta
from frolic_tta import accuracy
from frolic_tta.options import FrolicOptions
from frolic_tta.synthetic import (
    clip_like_world,
    prior_shift_world,
    shifted_prior,
    zero_shot_view,
)
from tests.sharding import run_sharded

BALANCED = FrolicOptions(test_prior="uniform")


def fit(x, z, options=None, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Proposition 2's Gaussian world is not unit-norm: its features are used as they are
        return frolic_tta.frolic(x, z, options, normalize=False, **kwargs)


def rows(result, labels):
    return {key: accuracy(logits, labels) for key, logits in result.ablations(labels).items()}


@pytest.mark.parametrize("kind", ["long-tailed:10", "long-tailed:100", "subset:0.3"])
def test_label_shift_does_no_harm_and_nears_the_known_prior(kind):
    world = clip_like_world(5000, test_prior=shifted_prior(kind, 50))
    result = fit(world.features, world.prototypes)
    acc = rows(result, world.labels)
    assert acc["f_d"] >= max(acc["f_c"], acc["f_f"]) + 0.05
    assert (
        acc["f_d"] >= acc["f_d balanced"] + 0.1
    )  # the balanced assumption corrects the shift away
    assert acc["f_d"] >= acc["oracle"] - 0.15  # oracle: masses matched to the true frequencies
    truth = torch.bincount(world.labels, minlength=50).double() / len(world.labels)
    uniform = torch.full((50,), 1 / 50, dtype=torch.float64)
    error = float((result.priors.test_prior - truth).abs().sum())
    assert error < 0.5 * float((uniform - truth).abs().sum())
    assert result.priors.shift_weight > 0.8


@pytest.mark.parametrize("world_name", ["clip", "prop2"])
def test_balanced_worlds_keep_the_previous_default(world_name):
    if world_name == "clip":
        world = clip_like_world(5000, seed=1)
        x, z, tau_c = world.features, world.prototypes, 0.01
    else:
        world = prior_shift_world(20000, 10, 16, separation=0.5, ratio=20.0, seed=1)
        (x, z), tau_c = zero_shot_view(world), 1.0
    default, previous = fit(x, z, tau_c=tau_c), fit(x, z, BALANCED, tau_c=tau_c)
    assert accuracy(default.logits, world.labels) >= accuracy(previous.logits, world.labels) - 0.01
    if world.prior is not None:  # the zero-shot model's pre-training prior is beta*
        assert float((default.priors.zero_shot_beta - world.prior).abs().sum()) < 0.1


def test_separable_sampled_data_does_no_harm():
    world = clip_like_world(5000, 400, 256, noise=0.08, tilt=0.1, text_bias=0.02, sample=True)
    result = fit(world.features, world.prototypes)
    acc = rows(result, world.labels)
    assert acc["f_d"] >= max(acc["f_c"], acc["f_f"]) and acc["f_d"] >= acc["f_d balanced"]


def test_the_pooled_fusion_earns_its_weight_under_a_long_tail():
    """Issue 15: Proposition 2's world (overlapping classes, beta* max/min 20) with a test prior
    long-tailed 10. Eq. 12's sum of two experts at the zero-shot confidence is twice as sharp
    as either, and the label bias matched on it put f_d 1.5 points below f_c - ln beta; the
    pool (fusion="pooled"; the default "selected" keeps it here) keeps f_d within 0.5 point of
    the best simpler row."""
    prior = shifted_prior("long-tailed:10", 10, seed=0)
    world = prior_shift_world(5000, 10, 16, 0.5, 20.0, seed=0, test_prior=prior)
    (x, z), tau_c = zero_shot_view(world), 1.0
    accs = {
        fusion: rows(fit(x, z, tau_c=tau_c, fusion=fusion), world.labels)
        for fusion in ("pooled", "matched", "selected")
    }
    pooled, summed = accs["pooled"], accs["matched"]
    assert FrolicOptions().fusion == "selected" and accs["selected"] == pooled
    best = max(pooled["f_c"], pooled["f_c - ln beta"], pooled["f_f"])
    assert pooled["f_d"] >= best - 0.005
    assert summed["f_d"] < best - 0.01  # the failure, rebuilt
    # measured 0.96 pt (1.02 with the test prior's weights in-sample, solver.prior_cross_fit off)
    assert pooled["f_d"] > summed["f_d"] + 0.005
    assert pooled["f_f"] == summed["f_f"]  # the pool does not move argmax f_f


def test_few_samples_per_class_keep_the_balanced_default():
    """10 samples per class in 256 dims: the EM weights are noise, however much the mixture and
    f_f agree (a rule trusting their agreement dropped f_d from 0.93 to 0.78 here)."""
    world = clip_like_world(4000, 400, 256)
    result = fit(world.features, world.prototypes)
    acc = rows(result, world.labels)
    assert acc["f_d"] >= acc["f_d balanced"] - 0.01
    assert result.priors.shift_weight < 0.1


def test_confident_posteriors_keep_beta_a_bounded_prior_and_say_so():
    world = clip_like_world(5000, seed=4)
    which = r"do not determine beta-hat of f_c \(the zero-shot model's pre-training prior\) in"
    with pytest.warns(UserWarning, match=which):
        result = frolic_tta.frolic(world.features, world.prototypes, tau_c=0.0005)
    priors = result.priors
    ratio = float(priors.zero_shot_beta.max() / priors.zero_shot_beta.min())
    assert ratio <= 1e8 * (1 + 1e-6)  # beta_ratio_bound
    assert bool(priors.zero_shot_beta_undetermined.any())
    summary = priors.summary()["zero_shot_beta"]
    assert summary["determined"] is False and summary["undetermined"] >= 1
    assert accuracy(result.logits, world.labels) >= accuracy(result.zero_shot_logits, world.labels)


def test_oracle_is_well_posed_on_confident_bayes_posteriors():
    """Issue 10 item 5: the exact (S - I + 11^T) solve dropped accuracy 1.00 -> 0.30 here."""
    world = prior_shift_world(300, 10, 16, separation=1.5, ratio=20.0, seed=0)
    beta = frolic_tta.estimate_label_bias(world.bayes_logits, labels=world.labels)
    assert accuracy(world.bayes_logits - beta.log(), world.labels) >= 0.99
    assert bool(torch.isfinite(beta).all())


def test_sharded_default_equals_whole_with_an_estimated_prior():
    world = clip_like_world(3001, 20, 64, test_prior=shifted_prior("long-tailed:10", 20))
    x, z = world.features.double(), world.prototypes.double()
    whole = fit(x, z)
    parts = run_sharded(
        lambda shard, reduce_fn: fit(shard, z, reduce_fn=reduce_fn), [x[:1900], x[1900:]]
    )
    assert whole.priors.shift_weight > 0.5
    for part in parts:
        torch.testing.assert_close(part.head.test_prior, whole.head.test_prior, rtol=0, atol=1e-9)
        torch.testing.assert_close(part.head.beta, whole.head.beta, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        torch.cat([p.logits for p in parts]), whole.logits, rtol=1e-6, atol=1e-6
    )


def test_paper_options_stay_reachable():
    world = clip_like_world(2000, seed=2)
    paper = fit(world.features, world.prototypes, frolic_tta.options.paper_options())
    assert paper.options.test_prior == "uniform" and paper.priors.raw_test_prior is None
    assert "f_d balanced" not in paper.ablations(world.labels)
