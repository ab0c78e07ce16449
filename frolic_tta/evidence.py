r"""Is there a label bias to correct? Two image mixtures compared by their likelihood (AIC).

Frolic removes the zero-shot model's label bias :math:`\hat\beta_c` (Proposition 2) and
estimates the test prior :math:`\pi` on a Gaussian mixture whose soft labels are the debiased
zero-shot posterior (:mod:`frolic_tta.prior`). Where the classes overlap, a text bias and an
imbalanced test set look alike: both make the zero-shot model predict some classes more
often. A mixture fitted under labels matched to uniform class masses then takes the test
set's own imbalance for a bias, its weights lean towards uniform, and :math:`f_d` removes the
imbalance: on worlds whose prototypes *are* the class means, zero-shot right on a third of a
long-tailed test set, that cost 2 to 4 points (issue 35).

Both readings are models of the *images*, the same Gaussian mixture family
(:math:`p(x) = \sum_j \pi_j\,\mathcal N(x; \mu_j, \Sigma)`, Section 3.2):

* **corrected** (U): the means and shared covariance under the debiased posterior, the
  weights :math:`\tilde\pi_U` of :func:`~frolic_tta.prior.estimate_test_prior` (the default's
  model);
* **uncorrected** (M): the means and covariance under the raw zero-shot posterior (Eqs. 4-8),
  whose class masses :math:`m_c = \frac1N\sum_i \mathrm{softmax}(f_c(x_i)/\tau_c)` are the
  test prior it implies; its weights :math:`\hat\pi_M` are the maximum-likelihood ones on
  those components (:func:`~frolic_tta.mixture.mixture_weights`, from :math:`m_c`). Its test
  prior :math:`\tilde\pi_M` is :math:`\hat\pi_M` where they beat uniform weights by
  :math:`\Lambda_M = 2(\ell_M(\hat\pi_M) - \ell_M(\mathbf 1/K)) > c(K - 1)` (``shift_evidence``
  :math:`c`, the zero point of the corrected reading's James-Stein rule, :mod:`frolic_tta.prior`),
  else uniform: a preliminary test, not a shrinkage. Where the raw labels' components hardly
  tell the classes apart, :math:`\hat\pi_M` is noise (``benchmarks/ddp.py``'s random-weight
  encoder, :math:`\Lambda_M` = 1.2 against 4.5: 0 on 4 classes of 10, :math:`f_d` 0.092 under
  :math:`f_c` 0.102, 0.296 with uniform weights). Shrunk partway (the James-Stein rule itself),
  :math:`f_d` fell 0.65 pt under :math:`f_c` on a means world at zero-shot 0.33
  (``benchmarks/no_harm.py``; towards :math:`m_c`, 0.6 pt).

The corrected model estimates :math:`K - 1` more parameters (the label bias), so it is chosen
where its log-likelihood is higher by more than that (Akaike's criterion):

.. math::
    \ell_U - \ell_M > K - 1,\qquad
    \ell = \sum_i \ln\sum_j \pi_j\,\mathcal N(x_i; \mu_j, \Sigma).

Otherwise the data give no evidence of a bias and :math:`\tilde\pi_M` is the test prior (the
zero-shot posterior's labels then weight the head, and :math:`\hat\beta_c` matches
:math:`f_c` to :math:`\tilde\pi_M` only). With a planted text bias the gap is hundreds to
tens of thousands of nats (``benchmarks/no_harm.py``, ``benchmarks/label_shift.py``), and M's
weights are solved (from :math:`m_c`) only until that is certain: :math:`\ell_M(\hat\pi_M)
\le \ell_M(\pi) + g(\pi)` at any :math:`\pi` (:func:`~frolic_tta.mixture_newton.headroom`
:math:`g`), so the solve stops once :math:`\ell_M(\pi) + g(\pi) \le \ell_U - (K - 1)`. Its
first two passes (:math:`m_c`, one EM step on) are products by chunks; then M's components go
into the scratch buffer where there is one. Each also bounds :math:`g` on the segment from its
weights to U's (:mod:`frolic_tta.weight_bound`), far below Cover's bound at either end where
the posteriors are hard: at ImageNet size the first pass decides (benchmark world: 29,100 nats
against 77,600; ``tests/test_early_certificates.py``'s K = 100 world: 2 passes, 9 before).
Where :math:`\ell_M(\pi)` passes that mark, U at its own maximum-likelihood weights
(``refit``) runs, and :math:`\ell_U` is the larger of the two in the solve's stop test from
there on. U's likelihood reads the head's logits (:func:`head_terms`) where the features span
:math:`\mathbb R^d`, else takes a product.

**The two densities** (:func:`mixture_model`) are built from each head's means and label
masses, with the within-class covariance
:math:`S = T - \sum_j w_j(\mu_j-\hat\mu)(\mu_j-\hat\mu)^\top`
(:math:`T` the total covariance) on the span of the data: where the features lie in an affine
subspace (a constant coordinate, N < d), :math:`T`'s null space is every model's too, and a
shrinkage or ridge there would be compared instead of the labels (Proposition 2's world, whose
features end in a constant 1, put 580 nats between two heads that way). On that span each
:math:`S` is shrunk only where it is rank-deficient (OAS, as ``shrinkage="auto"``).
Every quantity is a reduced sum, so every shard takes the same decision; :math:`\ell =
\sum_i \ln\sum_j \pi_j e^{g_{ij}} - \frac12\operatorname{tr}(\Sigma^{-1}C) - \frac N2\ln|\Sigma|`
+ const, with :math:`g_{ij} = w_j^\top(x_i - \hat\mu) + b_j` and :math:`C` the scatter.
Shapes: N samples, K classes, d embedding dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from frolic_tta.gda import (
    RANK_TOLERANCE,
    GaussianHead,
    MomentSums,
    fit_gaussian_head,
    ridge_factor,
    shared_covariance,
)
from frolic_tta.logits import AffineMap, LogitSource, ReduceFn, TensorLogits, fill
from frolic_tta.matching import floored, match_class_masses
from frolic_tta.mixture import log_likelihood, mixture_weights, segment_pass
from frolic_tta.options import FrolicOptions
from frolic_tta.prior import TestPriorEstimate
from frolic_tta.shrinkage import oas_shrinkage, shrink
from frolic_tta.soft_sums import posterior_sums, refitted_sums
from frolic_tta.span import centred_scatter, data_span  # data_span: still imported from here


@dataclass(frozen=True)
class BiasEvidence:
    r"""The outcome of :func:`compare_mixtures`.

    Attributes:
        corrected: the corrected mixture (U) is chosen: the label bias is removed.
        gap: :math:`\ell_U - \ell_M` in nats (a lower bound where M's weights were not
            solved to the end: less their headroom).
        penalty: :math:`K - 1`, the label bias's free parameters.
        prior: ``(K,)`` :math:`\tilde\pi_M` where the uncorrected model is chosen, else ``None``.
        raw: ``(K,)`` :math:`\hat\pi_M` (idem).
        weight: 1 where the uncorrected model is chosen with its weights :math:`\hat\pi_M`,
            0 where it is chosen with uniform weights (:math:`\Lambda_M \le c(K - 1)`) or is
            not chosen.
        likelihood_ratio: :math:`\Lambda_M = 2(\ell_M(\hat\pi_M) - \ell_M(\mathbf 1/K))`
            where the uncorrected model is chosen, else 0.
        passes: passes over the logits or features.
        converged: the weight solve of M reached its tolerance (``True`` where none ran).
        scratch_used: ``scratch`` was overwritten.
    """

    corrected: bool
    gap: float
    penalty: float
    prior: Tensor | None = None
    raw: Tensor | None = None
    weight: float = 0.0
    likelihood_ratio: float = 0.0
    passes: int = 0
    converged: bool = True
    scratch_used: bool = False


def mixture_model(
    means: Tensor, weights: Tensor, sums: MomentSums, span: Tensor | None
) -> tuple[AffineMap, float]:
    r"""The component log-densities of class ``means`` ``(K, d)`` with label masses
    ``weights`` ``(K,)`` (a head's ``class_means``, ``class_weights``) on ``span``
    (module docstring): ``(g, terms)`` with ``g`` the centred logits
    :math:`w_j^\top(x - \hat\mu) + b_j` and ``terms`` :math:`-\frac12\operatorname{tr}
    (\Sigma^{-1}C) - \frac N2\ln|\Sigma|` (float64; :math:`\frac{Nr}2\ln 2\pi` left out,
    the same for every model)."""
    centred, factor, scatter = within_factor(means, weights, sums, span)
    weight, bias = discriminant(centred, factor)  # (K, r), (K,)
    weight = weight if span is None else weight @ span.t()
    mean = sums.feature_sum / float(sums.count)
    return AffineMap(weight, bias, mean), _terms(factor, scatter, float(sums.count))


def discriminant(centred: Tensor, factor: Tensor) -> tuple[Tensor, Tensor]:
    r"""``(W (K, r), b (K,))`` of the centred class means ``(K, r)`` under the covariance whose
    Cholesky factor is ``factor``: :math:`w_j = \Sigma^{-1}\mu_j`, :math:`b_j = -\frac12
    \mu_j^\top w_j` (the component log-densities less their class-free terms)."""
    weight = torch.cholesky_solve(centred.t(), factor).t()
    return weight, -0.5 * (centred * weight).sum(1)


def within_factor(
    means: Tensor, weights: Tensor, sums: MomentSums, span: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    r"""``(centred means (K, r), Cholesky factor (r, r), scatter C (r, r))`` on ``span`` of
    :func:`mixture_model`'s within-class covariance (shrunk where rank-deficient)."""
    count, mean, scatter = centred_scatter(sums)
    centred = means - mean  # (K, d)
    within = scatter / count - (centred * weights[:, None]).t() @ centred
    if span is not None:
        within, scatter = span.t() @ within @ span, span.t() @ scatter @ span
        centred = centred @ span
    within = 0.5 * (within + within.t())
    floor = RANK_TOLERANCE * float(torch.diagonal(within).sum()) / within.shape[0]
    if float(torch.linalg.eigvalsh(within)[0]) <= floor:  # as shrinkage="auto"
        within = shrink(within, oas_shrinkage(within, count))
    factor, info = torch.linalg.cholesky_ex(within)
    if int(info) != 0:
        _, factor, _ = ridge_factor(within)
    return centred, factor, scatter


def head_terms(head: GaussianHead, sums: MomentSums) -> float:
    r"""``terms`` of :func:`mixture_model` for the mixture of ``head`` itself (its means and
    :math:`\hat\Sigma`, on all of :math:`\mathbb R^d`), whose centred component logits are
    ``head.gda()``'s: a buffer holding them is read instead of recomputed."""
    count, _, scatter = centred_scatter(sums)
    return _terms(torch.linalg.cholesky(head.shared_covariance), scatter, count)


def _terms(factor: Tensor, scatter: Tensor, count: float) -> float:
    r""":math:`-\frac12\operatorname{tr}(\Sigma^{-1}C) - \frac N2\ln|\Sigma|`, ``factor`` of Σ."""
    trace = float(torch.cholesky_solve(scatter, factor).diagonal().sum())
    return -0.5 * trace - count * float(torch.log(factor.diagonal()).sum())


def compare_mixtures(
    features: Tensor,
    corrected: GaussianHead,
    corrected_prior: Tensor,
    uncorrected: tuple[Tensor, Tensor],
    sums: MomentSums,
    *,
    tol: float,
    prior_floor: float,
    reduce_fn: ReduceFn,
    chunk_size: int | None,
    exact: bool,
    evidence: float,
    scratch: Tensor | None = None,
    refit: Callable[[], tuple[Tensor, Tensor, Tensor, int]] | None = None,
    corrected_logits: LogitSource | None = None,
) -> BiasEvidence:
    r"""Choose between the corrected and the uncorrected mixture (module docstring).

    Args:
        features: ``(N_local, d)`` the local shard.
        corrected: U's head (under the debiased posterior).
        corrected_prior: ``(K,)`` U's weights :math:`\tilde\pi_U`.
        uncorrected: M's class means ``(K, d)`` and label masses ``(K,)`` (under the raw
            zero-shot posterior, from ``sums``).
        sums: the reduced moment sums (their soft counts give :math:`m_c`).
        tol: of M's weight solve (:func:`~frolic_tta.mixture.mixture_weights`).
        prior_floor: :math:`\tilde\pi_j \ge` ``prior_floor`` / K.
        reduce_fn: sums a tensor over shards.
        chunk_size: rows per chunk.
        exact: float64 products (:func:`~frolic_tta.logits.exact_arithmetic`).
        evidence: :math:`c` (``solver.shift_evidence``): where M is chosen, its weights
            :math:`\hat\pi_M` only where :math:`\Lambda_M > c(K - 1)`, else uniform (module
            docstring).
        scratch: ``(N_local, K)`` that M's weight solve may overwrite (then ``scratch_used``),
            or ``None``: its passes recompute the products.
        refit: where U at :math:`\tilde\pi_U` does not win, the corrected reading at its own
            maximum-likelihood weights: ``() -> (means, masses, weights, passes)``, the class
            means and label masses under the zero-shot posterior matched to U's unshrunk
            :math:`\hat\pi_U` (the weights; module docstring), or ``None``.
        corrected_logits: ``corrected.gda()``'s logits of the shard, already at hand (the
            buffer the test prior's solve read, which ``scratch`` may be): U is then the
            mixture of the head's own :math:`\hat\Sigma` (:func:`head_terms`), read without a
            product, where the features span :math:`\mathbb R^d`; ``None``: U's product.

    Returns:
        :class:`BiasEvidence`.
    """
    k = corrected.weight.shape[0]
    penalty = float(k - 1)
    span = data_span(sums)
    if span is not None and span.shape[1] == 0:  # identical features: nothing to compare
        return BiasEvidence(True, float("nan"), penalty)
    if corrected_logits is not None and span is None:  # U's logits are at hand
        source_u, terms_u = corrected_logits, head_terms(corrected, sums)
    else:
        means, masses = corrected.class_means, corrected.class_weights
        model_u, terms_u = mixture_model(means, masses, sums, span)
        source_u = model_u.source(features, chunk_size, exact)
    model_m, terms_m = mixture_model(*uncorrected, sums, span)
    ell_u = log_likelihood(source_u, corrected_prior, reduce_fn)[0] + terms_u
    masses = floored(sums.soft_count / sums.count, prior_floor)
    towards = floored(corrected_prior, prior_floor)  # each pass's segment ends at U's weights
    source_m = model_m.source(features, chunk_size, exact)
    passes = 1
    if scratch is not None:  # M's passes read the scratch buffer (one product, not one a pass)
        # once two by chunks (at m_c, then one EM step on) have not settled it
        pi, ell_m = masses, -math.inf
        for _ in range(2):  # the segment only while it can stop the solve (as mixture_weights)
            spent = ell_m + terms_m > ell_u - penalty
            pi, at = segment_pass(source_m, pi, None if spent else towards, reduce_fn)
            ell_m, left = float(at.log_likelihood), at.headroom()
            passes += 1
            if ell_u - (ell_m + terms_m + left) > penalty:  # less what M could still gain
                return BiasEvidence(True, ell_u - ell_m - terms_m - left, penalty, passes=passes)
        source_m = fill(scratch, source_m)
        passes += 1

    def at_own_weights() -> float:  # U at its own ML weights (refit); M's higher ceiling
        nonlocal ell_u, passes, refit
        assert refit is not None  # (lift is given only with it)
        means, refit_masses, weights, more = refit()
        model, terms = mixture_model(means, refit_masses, sums, span)
        source = model.source(features, chunk_size, exact)
        ell_u = max(ell_u, log_likelihood(source, weights, reduce_fn)[0] + terms)
        passes, refit = passes + more + 1, None
        return ell_u - penalty - terms_m

    # M's weights from m_c only as far as they could matter: the solve stops once
    # l_M < l_U - (K - 1) is certain whatever the weights (its headroom). Once l_M passes that
    # ceiling the refit is certain to be needed: it runs then, and its likelihood lifts the
    # ceiling, so M's solve stops short of its tolerance where the refit wins
    raw, ratio, inner, converged = mixture_weights(
        source_m,
        masses,
        tol=tol,
        reduce_fn=reduce_fn,
        ceiling=ell_u - penalty - terms_m,
        lift=None if refit is None else at_own_weights,
        towards=towards,
    )
    _, at = segment_pass(source_m, floored(raw, prior_floor), towards, reduce_fn)
    ell_m, left = float(at.log_likelihood) + terms_m, at.headroom()  # the bound that stopped it
    passes += inner + 1
    used = scratch is not None
    if ell_u - ell_m > penalty:  # (always where a ceiling stopped the solve)
        lower = ell_u - ell_m - max(left, 0.0)  # less what M's weights could still gain
        return BiasEvidence(
            True, lower, penalty, passes=passes, converged=converged, scratch_used=used
        )
    if refit is not None:  # not lifted during M's solve
        at_own_weights()
    if ell_u - ell_m > penalty:
        return BiasEvidence(
            True, ell_u - ell_m, penalty, passes=passes, converged=converged, scratch_used=used
        )
    # M's weights where they beat uniform by more than c (K - 1) (Lambda), else uniform (a
    # preliminary test at the corrected reading's James-Stein zero point): where the raw labels'
    # components hardly tell the classes apart, their ML weights are noise; shrunk partway (the
    # James-Stein rule itself), f_d fell 0.65 pt under f_c on a means world at zero-shot 0.33
    weight = 1.0 if ratio > evidence * penalty else 0.0
    prior = floored(raw if weight else torch.full_like(raw, 1.0 / k), prior_floor)
    return BiasEvidence(
        False, ell_u - ell_m, penalty, prior, raw, weight, ratio, passes, converged, used
    )


def tested_estimate(
    features: Tensor,
    prototypes: Tensor,
    zero_shot: LogitSource,
    sums: MomentSums,
    estimate: TestPriorEstimate,
    options: FrolicOptions,
    *,
    reduce_fn: ReduceFn,
    chunk_size: int | None,
    buffer: Tensor | None,
    bound: float | None,
    eps: float,
) -> tuple[TestPriorEstimate, float]:
    r"""``estimate`` (the corrected model's, with its head) where the images show a label bias,
    else the uncorrected model's: its head, its test prior :math:`\tilde\pi_M`, and
    :math:`f_c/\tau_c` (``zero_shot``) matched to that prior (``eps``, ``bound``); with the
    evidence :math:`\ell_U - \ell_M - (K - 1)` in nats (> 0: corrected).
    ``options.bias_test="off"`` or no head: ``estimate`` as it is, evidence ``nan``."""
    if options.bias_test == "off" or estimate.head is None:
        return estimate, float("nan")
    _, means, masses, _ = shared_covariance(sums, prototypes, "soft", None)  # M's; no solve
    solver = options.solver
    matching = {"bound": bound, "eps": eps, "max_iter": solver.max_iter, "reduce_fn": reduce_fn}
    matching["prior_floor"] = solver.prior_floor

    # the buffer holds the head's logits (its last refit): U read from it, where U is the
    # head's own mixture (the within-class scatter, shrunk by the rule mixture_model applies)
    at_hand = None
    if buffer is not None and options.shrinkage == "auto":
        at_hand = TensorLogits(buffer, chunk_size, zero_shot.exact)

    def refit() -> tuple[Tensor, Tensor, Tensor, int]:
        weights = floored(estimate.raw, solver.prior_floor)
        bias = match_class_masses(zero_shot, weights, init=estimate.bias.beta, **matching)
        packed = posterior_sums(zero_shot, bias.log_offset, features, bias.exponentials, sums.count)
        refitted = refitted_sums(sums, reduce_fn(packed))
        _, means, masses, _ = shared_covariance(refitted, prototypes, "soft", None)
        return means, masses, weights, bias.evaluations + 1

    outcome = compare_mixtures(
        features,
        estimate.head,
        estimate.prior,
        (means, masses),
        sums,
        tol=solver.prior_tol,
        prior_floor=solver.prior_floor,
        reduce_fn=reduce_fn,
        chunk_size=chunk_size,
        exact=zero_shot.exact,
        scratch=buffer,
        refit=refit,
        corrected_logits=at_hand,
        evidence=solver.shift_evidence,
    )
    evidence = outcome.gap - outcome.penalty
    passes = estimate.passes + outcome.passes
    converged = estimate.converged and outcome.converged
    head = estimate.head  # M's head is solved only where M is chosen
    if not outcome.corrected:
        head = fit_gaussian_head(sums, prototypes, "soft", options.shrinkage)
    if outcome.scratch_used and buffer is not None:  # the chosen head's logits, as on entry
        fill(buffer, head.gda().source(features, chunk_size, zero_shot.exact))
        passes += 1
    if outcome.corrected:
        return replace(estimate, passes=passes, converged=converged), evidence
    assert outcome.prior is not None and outcome.raw is not None  # set where not corrected
    # from U's matching (its prior is the nearest solved): at 21k, N = 200,000, 15 passes cold
    bias = match_class_masses(zero_shot, outcome.prior, init=estimate.bias.beta, **matching)
    tested = TestPriorEstimate(
        prior=outcome.prior,
        raw=outcome.raw,
        weight=outcome.weight,
        likelihood_ratio=outcome.likelihood_ratio,
        bias=bias,
        rounds=estimate.rounds,
        passes=passes + bias.evaluations,
        converged=converged,
        head=head,
    )
    return tested, evidence
