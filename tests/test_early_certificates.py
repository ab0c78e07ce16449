"""Bounds that end a solve early without changing what it decides (issue 35, item 6):
Cover's bound on what mixture weights can still gain, the bias test's first passes by chunks,
and the fusion choice's evidence lower bounds. Each is checked against the exact quantity it
bounds and against a fit that runs to the end."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch

import frolic_tta
from frolic_tta import evidence, fusion
from frolic_tta.gda import fit_gaussian_head
from frolic_tta.logits import TensorLogits, identity_reduce, materialise
from frolic_tta.mixture import (
    _mixture_sums,
    log_likelihood,
    log_likelihood_beside,
    mixture_weights,
)
from frolic_tta.pipeline import shard_moment_sums
from frolic_tta.synthetic import clip_like_world, means_world
from tests.sharding import fit_interleaved


def quiet_fit(world):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return frolic_tta.fit_frolic(world.features, world.prototypes)


def test_covers_bound_holds_and_is_far_below_the_frank_wolfe_gap_on_hard_posteriors():
    # separated components (hard posteriors) and weights far from the maximiser
    g = torch.Generator().manual_seed(0)
    centres = torch.arange(6, dtype=torch.float64) * 4.0
    labels = torch.multinomial(
        torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05]), 3000, True, generator=g
    )
    x = centres[labels] + torch.randn(3000, generator=g, dtype=torch.float64)
    source = TensorLogits(-0.5 * (x[:, None] - centres[None, :]) ** 2, 1000)
    best, *_ = mixture_weights(source, tol=1e-13)
    top = log_likelihood(source, best, identity_reduce)[0]
    for start in ([1 / 6] * 6, [0.01, 0.01, 0.01, 0.01, 0.48, 0.48]):
        pi = torch.tensor(start, dtype=torch.float64)
        ell, bound = log_likelihood(source, pi, identity_reduce)
        sums = _mixture_sums(source, pi.log())
        frank_wolfe = float(sums.gradient.max() - sums.count)
        assert top - ell <= bound <= frank_wolfe  # a bound, and never looser than the old one
        assert bound == pytest.approx(3000 * math.log1p(frank_wolfe / 3000), rel=1e-12)
    assert bound < 0.2 * frank_wolfe  # at the skewed start: 3000 ln(1 + gap/N), not the gap


def unbounded_first_passes(monkeypatch):
    """The bias test as if M's two passes by chunks bounded nothing: M's solve in the buffer."""
    segment, calls = evidence.segment_pass, []

    def blind(*args):
        pi, at = segment(*args)
        calls.append(1)
        if len(calls) > 2:
            return pi, at
        return pi, SimpleNamespace(log_likelihood=at.log_likelihood, headroom=lambda: math.inf)

    monkeypatch.setattr(evidence, "segment_pass", blind)


@pytest.mark.parametrize("size", [(2000, 20), (3000, 100)])
def test_a_bias_settled_by_chunks_leaves_the_head_in_its_buffer(monkeypatch, size):
    # d = 32, a planted text bias. K = 20: U wins by about 1,100 nats and M's first pass proves
    # it. K = 100: U wins by about 4,500; Cover's bounds at m_c and one EM step on did not
    # prove it (M's solve then ran in the buffer: 9 passes), the segment's from m_c to U's
    # weights (frolic_tta.weight_bound) does in M's first pass. Computed by chunks: no product
    # fills the buffer with M's components and none puts the head's logits back
    world = clip_like_world(*size, 32, noise=0.2, seed=0)
    filled = []
    original = evidence.fill
    monkeypatch.setattr(evidence, "fill", lambda *a: filled.append(1) or original(*a))
    passes = []
    compare = evidence.compare_mixtures

    def counted(*args, **kwargs):
        outcome = compare(*args, **kwargs)
        passes.append(outcome.passes)
        return outcome

    monkeypatch.setattr(evidence, "compare_mixtures", counted)
    early = quiet_fit(world)
    assert filled == [] and early.priors.label_bias_evidence > 0.0
    assert passes[0] == 2  # U's likelihood and M's first pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        index, parts = fit_interleaved(world, 2)
    for rows, part in zip(index, parts, strict=True):  # the same stop on every shard
        assert part.priors.passes == early.priors.passes
        assert part.priors.fusion_gap == pytest.approx(early.priors.fusion_gap, rel=1e-6)
        assert torch.equal(part.logits.argmax(1), early.logits[rows].argmax(1))
    assert filled == []
    # the same fit where the first passes prove nothing: M's solve in the buffer, as before
    unbounded_first_passes(monkeypatch)
    full = quiet_fit(world)
    assert len(filled) == 2 and full.priors.label_bias_evidence > 0.0
    assert torch.equal(early.logits, full.logits)
    assert torch.equal(early.priors.test_prior, full.priors.test_prior)
    assert early.priors.passes < full.priors.passes


def test_the_fusion_bound_is_the_float64_evidence_lower_bound():
    world = means_world(400, 5, 8, noise=0.6, seed=1)
    features, prototypes = world.features.double(), world.prototypes.double()
    sums = shard_moment_sums(features, prototypes, 0.01)
    head = fit_gaussian_head(sums, prototypes)
    logits = head.gda().source(features, None, True)
    values = torch.cat([chunk for _, chunk in logits.chunks()]) / 3.0  # a softer posterior
    source = TensorLogits(values, 100)
    bias = SimpleNamespace(log_offset=torch.zeros(5, dtype=torch.float64), exponentials=None)
    prior = torch.tensor([0.1, 0.3, 0.2, 0.25, 0.15], dtype=torch.float64)
    args = (features, prototypes, source, bias, sums, prior, None, identity_reduce, None)
    bound = fusion.label_likelihood(*args, floor=-math.inf)
    exact = fusion.label_likelihood(*args)
    n, d = features.shape
    const = 0.5 * n * d * math.log(2 * math.pi)  # left out of both, the same for every model
    # independently: sum_ij q_ij (ln pi_j + ln N(x_i; mu_j, S)) + H(q), S the soft labels'
    # within-class scatter (the refit's), sample by sample
    q = torch.softmax(values, dim=1)
    means = q.t() @ features / q.sum(0)[:, None]
    spread = features[:, None, :] - means[None]
    within = torch.einsum("ik,ikd,ike->de", q, spread, spread) / n
    density = torch.distributions.MultivariateNormal(means, covariance_matrix=within)
    per_class = density.log_prob(features[:, None, :]) + prior.log()
    reference = float((q * per_class).sum() - torch.special.xlogy(q, q).sum())
    assert bound - const == pytest.approx(reference, rel=1e-10)
    assert bound < exact  # a lower bound of l, strictly where q is not the mixture's posterior
    assert fusion.label_likelihood(*args, floor=bound + 1e-3) == exact  # not enough: l itself


def test_the_cross_bound_is_the_float64_evidence_lower_bound_less_its_rounding():
    # the pooled labels' ELBO under another mixture's components, read in that mixture's pass
    world = means_world(400, 5, 8, noise=0.6, seed=1)
    features, prototypes = world.features, world.prototypes  # float32: rounding to cover
    head = fit_gaussian_head(shard_moment_sums(features, prototypes, 0.01), prototypes)
    components = head.gda().source(features, 100)
    pooled = TensorLogits(features @ prototypes.t() / 0.05, 100)  # another classifier
    offset = torch.tensor([0.3, -0.2, 0.1, 0.0, -0.4], dtype=torch.float64)
    prior = torch.tensor([0.1, 0.3, 0.2, 0.25, 0.15], dtype=torch.float64)
    cross = fusion._CrossBound(components, pooled, offset, prior.log())
    ell, (bound, rounding) = log_likelihood_beside(
        cross, prior, identity_reduce, lambda: cross.sums
    )
    assert ell == log_likelihood(components, prior, identity_reduce)[0]  # the same pass's l
    # independently, in float64 from the same float32 logits: sum_ij q_ij (g_ij + ln pi_j) + H(q)
    g = materialise(components).double()
    q = torch.softmax(materialise(pooled).double() + offset, dim=1)
    reference = float((q * (g + prior.log())).sum() - torch.special.xlogy(q, q).sum())
    # within the derived rounding (measured 1.6e-5 nats against 6.4e-3), far below Kr/2 = 20
    assert abs(float(bound) - reference) <= float(rounding) < 1e-3 * 20
    assert float(bound - rounding) <= reference < float(torch.logsumexp(g + prior.log(), 1).sum())
    # the pooled logits chunked otherwise: rows apart, no bound (not a wrong one)
    apart = fusion._CrossBound(components, TensorLogits(pooled.logits, 64), offset, prior.log())
    assert (
        log_likelihood_beside(apart, prior, identity_reduce, lambda: apart.sums)[1][0] == -math.inf
    )


def without_cross_bound(monkeypatch):
    """The fusion choice as before the cross bound: the head alone's pass bounds nothing."""
    beside = fusion.log_likelihood_beside

    def alone(source, prior, reduce_fn, _):
        ell, _ = beside(source, prior, reduce_fn, lambda: torch.zeros(2, dtype=torch.float64))
        return ell, torch.tensor([-math.inf, 0.0], dtype=torch.float64)

    monkeypatch.setattr(fusion, "log_likelihood_beside", alone)


@pytest.mark.parametrize("bound", ["cross", "pooled"])
def test_a_fusion_settled_by_a_bound_decides_as_the_full_comparison(monkeypatch, bound):
    # a confident CLIP-like world (zero-shot 0.97): the pooled fusion wins by about 250 nats.
    # The pooled labels under the head alone's mixture prove it in the head alone's pass (no
    # pass of the pooled fusion's own); without that bound, the pooled refit's own bound does,
    # without the product of its components
    world = clip_like_world(2000, 20, 32, noise=0.2, seed=0)
    original, refits = fusion.label_likelihood, []
    if bound == "pooled":
        without_cross_bound(monkeypatch)
    monkeypatch.setattr(
        fusion, "label_likelihood", lambda *a, **k: refits.append(1) or original(*a, **k)
    )
    early = quiet_fit(world)
    assert refits == ([] if bound == "cross" else [1])
    if bound == "cross":
        without_cross_bound(monkeypatch)
    monkeypatch.setattr(fusion, "label_likelihood", lambda *a, floor=None, **k: original(*a, **k))
    full = quiet_fit(world)
    assert full.priors.fusion_gap < early.priors.fusion_gap <= 0.0  # the bound decided: pooled
    assert full.priors.fusion_gap < -100.0
    assert torch.equal(early.logits, full.logits)
