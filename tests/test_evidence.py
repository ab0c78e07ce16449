"""The test of a label bias (``bias_test="aic"``, opt-in, :mod:`frolic_tta.evidence`): its
likelihood against an independent float64 mixture density, its decision on worlds with and
without a planted bias, the same decision on every shard, and where it fails (a strict xfail)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import frolic_tta
from frolic_tta.evidence import data_span, mixture_model
from frolic_tta.gda import fit_gaussian_head
from frolic_tta.logits import identity_reduce
from frolic_tta.mixture import log_likelihood, mixture_weights
from frolic_tta.pipeline import shard_moment_sums
from frolic_tta.synthetic import clip_like_world, clip_world, means_world, shifted_prior
from tests.sharding import fit_interleaved


def fit(world, **options):
    options = {"bias_test": "aic", **options}  # (the default)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return frolic_tta.frolic(world.features, world.prototypes, **options)


def test_the_mixture_likelihood_is_the_float64_gaussian_mixture_density():
    world = means_world(400, 5, 8, noise=0.6, seed=1)
    features, prototypes = world.features.double(), world.prototypes.double()
    sums = shard_moment_sums(features, prototypes, 0.01)
    head = fit_gaussian_head(sums, prototypes)
    model, terms = mixture_model(head.class_means, head.class_weights, sums, None)
    prior = torch.tensor([0.1, 0.3, 0.2, 0.25, 0.15], dtype=torch.float64)
    source = model.source(features, None, True)
    ell, gap = log_likelihood(source, prior, identity_reduce)
    n, d = features.shape
    ours = ell + terms - 0.5 * n * d * math.log(2 * math.pi)
    # independently: the soft labels' means and within-class scatter, sample by sample
    labels = torch.softmax(features @ prototypes.t() / 0.01, dim=1)
    means = labels.t() @ features / labels.sum(0)[:, None]
    spread = features[:, None, :] - means[None]  # (N, K, d)
    within = torch.einsum("ik,ikd,ike->de", labels, spread, spread) / n
    density = torch.distributions.MultivariateNormal(means, covariance_matrix=within)
    per_class = density.log_prob(features[:, None, :]) + prior.log()
    reference = float(torch.logsumexp(per_class, dim=1).sum())
    assert ours == pytest.approx(reference, rel=1e-10)
    # the Frank-Wolfe gap bounds what the weights can still gain
    best, *_ = mixture_weights(source, prior, tol=1e-12)
    assert gap >= log_likelihood(source, best, identity_reduce)[0] - ell >= 0.0


def test_the_weight_solve_stops_at_a_ceiling_only_where_the_maximum_is_below_it():
    # compare_mixtures solves M's weights only until l_M(pi-hat) <= l_U - (K - 1) is certain
    prior = shifted_prior("long-tailed:10", 8)
    world = means_world(1500, 8, 12, noise=0.8, seed=3, test_prior=prior)
    features, prototypes = world.features.double(), world.prototypes.double()
    sums = shard_moment_sums(features, prototypes, 0.01)
    head = fit_gaussian_head(sums, prototypes, "soft", "auto")
    model, _ = mixture_model(head.class_means, head.class_weights, sums, data_span(sums))
    source = model.source(features)
    start = torch.full((8,), 1.0 / 8, dtype=torch.float64)
    best, _, full, converged = mixture_weights(source, start, tol=1e-12)
    top = log_likelihood(source, best, identity_reduce)[0]
    assert converged and full > 4
    # a ceiling above the maximum: stopped early, and what it certified holds
    early, _, passes, certain = mixture_weights(source, start, tol=1e-12, ceiling=top + 1.0)
    ell, gap = log_likelihood(source, early, identity_reduce)
    assert certain and passes < full and top <= ell + gap <= top + 1.0 + 1e-6
    # a ceiling the maximum exceeds cannot be certified: the same solve to the end
    same, _, passes, _ = mixture_weights(source, start, tol=1e-12, ceiling=top - 1e-3)
    assert passes == full and torch.equal(same, best)
    # there, a lift is asked for once l(pi) passes the ceiling, and its higher one stops it
    asked = []
    lift = lambda: asked.append(1) or top + 1.0  # noqa: E731
    _, _, passes, certain = mixture_weights(source, start, tol=1e-12, ceiling=top - 1e-3, lift=lift)
    assert asked == [1] and certain and passes < full


def test_a_constant_coordinate_does_not_enter_the_comparison():
    # Proposition 2's features end in a constant 1: every head's covariance is singular there,
    # and shrinkage or a ridge in that direction put 580 nats between two heads; on the data's
    # span the features with and without it give one likelihood
    world = means_world(300, 4, 6, noise=0.7, seed=2)
    ones = torch.ones(300, 1, dtype=torch.float64)
    plain = (world.features.double(), world.prototypes.double())
    padded = (torch.cat([plain[0], ones], 1), torch.cat([plain[1], 0 * ones[:4]], 1))
    prior = torch.full((4,), 0.25, dtype=torch.float64)
    values = []
    for features, prototypes in (plain, padded):
        sums = shard_moment_sums(features, prototypes, 0.05)
        span = data_span(sums)
        assert (span is None) == (features.shape[1] == 6)
        head = fit_gaussian_head(sums, prototypes)
        model, terms = mixture_model(head.class_means, head.class_weights, sums, span)
        values.append(log_likelihood(model.source(features), prior, identity_reduce)[0] + terms)
    assert values[1] == pytest.approx(values[0], rel=1e-10)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_planted_text_bias_is_corrected(seed):
    # the README's world: a modality gap and a per-class text bias; the corrected mixture is
    # hundreds of nats more likely (450 to 550 above K - 1 = 19 with M's weights solved to the
    # end). M's solve stops once that is certain: the evidence is then a lower bound (14 to 143
    # nats where the segment's bound stops it, frolic_tta.weight_bound; 73 to 346 before)
    result = fit(clip_world(num_samples=2000, seed=seed))
    assert result.priors.label_bias_evidence > 0.0
    off = fit(clip_world(num_samples=2000, seed=seed), bias_test="off")
    assert torch.equal(result.logits, off.logits)  # the same fit as before the test


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prototypes_that_are_the_means_are_left_uncorrected(seed):
    # issue 35 item 1: zero-shot 0.33 on a long-tailed x10 test set, prototypes = class means;
    # before the test, beta-hat absorbed the imbalance: f_d 2.0 to 2.7 pt below f_c
    prior = shifted_prior("long-tailed:10", 10, seed)
    world = means_world(2000, 10, 16, noise=1.0, seed=seed, test_prior=prior)
    result = fit(world)
    assert result.priors.label_bias_evidence < 0.0
    truth = torch.bincount(world.labels, minlength=10).double() / 2000
    uniform = torch.full((10,), 0.1, dtype=torch.float64)
    error = float((result.priors.test_prior - truth).abs().sum())
    assert error < float((uniform - truth).abs().sum())  # the old default's prior: uniform
    f_c = frolic_tta.accuracy(result.zero_shot_logits, world.labels)
    assert frolic_tta.accuracy(result.logits, world.labels) >= f_c - 0.005


def test_every_shard_takes_the_same_decision():
    prior = shifted_prior("long-tailed:10", 10, 0)
    world = means_world(900, 10, 16, noise=1.0, test_prior=prior)
    whole = frolic_tta.fit_frolic(world.features, world.prototypes, bias_test="aic")
    _, fits = fit_interleaved(world, 3, bias_test="aic")
    for part in fits:
        evidence = part.priors.label_bias_evidence
        assert evidence == pytest.approx(whole.priors.label_bias_evidence, rel=1e-9, abs=1e-6)
        assert torch.allclose(part.priors.test_prior, whole.priors.test_prior, atol=1e-12)


LOW_SIGNAL = {  # planted text bias, low signal: the raw labels' mixture is the more likely
    # K = 6, d = 16, N = 600, long-tailed x10, zero-shot 0.30-0.49: left uncorrected in 4 seeds
    # of 4; f_d 0.387 / 0.335 / 0.305 against 0.468 / 0.465 / 0.427 removed (seeds 1-3)
    "K6-long-tailed": (600, 6, 16, "long-tailed:10"),
    # K = 50, d = 32, N = 2,000, balanced, zero-shot 0.19: evidence -147 nats, f_d 0.201
    # against 0.284 with the bias removed
    "K50-balanced": (2000, 50, 32, None),
    # the same world at 4x the samples: not a small-sample effect, the raw labels win by more
    # (evidence -147 / -206 / -372 nats at N = 2,000 / 8,000 / 32,000; f_d 0.177 against 0.278
    # removed here). The code issue 35 was filed against removed the bias always
    "K50-balanced-N8000": (8000, 50, 32, None),
}


@pytest.mark.xfail(
    strict=True,
    reason="open (issue 35 item 1): at low signal the comparison prefers the raw labels' "
    "mixture (by 21 to 206 nats, more with more samples) although the text bias is planted "
    "(measured -8 to -13 pt)",
)
@pytest.mark.parametrize("name", LOW_SIGNAL)
def test_a_planted_bias_at_low_signal_is_still_corrected(name):
    n, k, d, kind = LOW_SIGNAL[name]
    prior = None if kind is None else shifted_prior(kind, k, 2)
    world = clip_like_world(n, k, d, seed=2 if kind else 0, test_prior=prior)
    tested, removed = fit(world), fit(world, bias_test="off")
    accuracy = [frolic_tta.accuracy(r.logits, world.labels) for r in (tested, removed)]
    assert accuracy[0] >= accuracy[1] - 0.005


def test_the_buffered_decisions_equal_the_streamed_ones():
    # with the logit buffer the bias test reads U's components from it (the head's logits) and
    # the fusion choice takes f_g / tau_g from the pass that fuses; without it (keep_logits=False)
    # both are products. On the README's world (corrected, the head alone chosen) the two paths
    # differ only by float32 rounding of what they read: a few ulps of the logits' scale per row
    world = clip_world(num_samples=2000, seed=0)
    buffered = frolic_tta.fit_frolic(world.features, world.prototypes)
    streamed = frolic_tta.fit_frolic(world.features, world.prototypes, keep_logits=False)
    tolerance = 2000 * float(buffered.logits.abs().max()) * 2.0**-20
    for name in ("label_bias_evidence", "fusion_gap"):
        ours, theirs = getattr(buffered.priors, name), getattr(streamed.priors, name)
        assert ours > 0.0 and abs(ours - theirs) <= tolerance, (name, ours, theirs)
    assert buffered.head.zero_shot_weight == streamed.head.zero_shot_weight == 0.0
    scores = streamed.head.score(world.features)
    assert torch.equal(scores.argmax(1), buffered.logits.argmax(1))


def test_the_refit_that_wins_stops_the_raw_readings_solve(monkeypatch):
    # K = 50, d = 16, N = 200 (zero-shot 0.105): U at its shrunk weights loses to M's mixture,
    # U refitted at its own ML weights wins. The refit now runs once l_M passes U's mark, and
    # lifts the ceiling that stops M's solve; before, M's weights ran to their tolerance first
    world = clip_like_world(200, 50, 16, noise=0.5, seed=1)
    lifted = frolic_tta.fit_frolic(world.features, world.prototypes)
    index, fits = fit_interleaved(world, 2)
    for rows, part in zip(index, fits, strict=True):  # the same stop and decision everywhere
        assert part.priors.passes == lifted.priors.passes
        assert part.priors.label_bias_evidence > 0.0
        assert torch.equal(part.logits.argmax(1), lifted.logits[rows].argmax(1))
    solve = frolic_tta.evidence.mixture_weights  # the refit after M's solve, as before
    monkeypatch.setattr(
        frolic_tta.evidence, "mixture_weights", lambda *a, lift=None, **k: solve(*a, **k)
    )
    full = frolic_tta.fit_frolic(world.features, world.prototypes)
    # the same decision and fit: only where M's solve stops (measured 50 passes against 139)
    assert torch.equal(lifted.logits, full.logits)
    assert torch.equal(lifted.priors.test_prior, full.priors.test_prior)
    assert lifted.priors.passes < full.priors.passes - 50
    # the evidence is then a lower bound (what M's weights could still gain left out)
    assert 0.0 < lifted.priors.label_bias_evidence < full.priors.label_bias_evidence
