r"""The test set's class prior :math:`\pi`, estimated by EM on Frolic's Gaussian mixture.

The paper assumes a balanced test set (Section 3.2, :math:`\pi_j = 1/K`; Proposition 2). When it
is not, its imbalance is read as model bias and "corrected" away. The GDA head is a Gaussian
mixture with a shared covariance,

.. math::
    p(x) = \sum_j \pi_j\,\mathcal N(x; \mu_j, \Sigma)\qquad\text{(Section 3.2)},

a model of the *images* that the text side's pre-training prior :math:`\beta` does not enter,
so its mixture weights estimate :math:`\pi` without any assumption on :math:`\beta`. EM from
the zero-shot responsibilities (the soft statistics accumulated while encoding):

* M-step: :math:`\hat\pi_j = \frac1N\sum_i q_{ij}`, :math:`m_j = \sum_i q_{ij}x_i / \sum_i
  q_{ij}`, :math:`\hat\Sigma = \hat M - \sum_j \hat\pi_j m_j m_j^\top` -- the soft scatter of
  :mod:`frolic_tta.gda` with :math:`q` in place of the zero-shot posterior;
* E-step: :math:`q_i = \mathrm{softmax}(f_g(x_i) + \ln\hat\pi)`, the mixture's posterior
  (Eq. 9's logits are the class log-likelihoods up to a constant per sample).

Each iteration is one pass over the features and one reduction of ``K (d + 1)`` sums; the
stop test (:math:`\|\Delta\hat\pi\|_1 < \epsilon`) is taken on reduced values, so every rank
takes the same steps. SQUAREM extrapolation (:func:`estimate_test_prior`) cuts the passes
EM needs where classes overlap. Only :math:`\hat\pi` is used: the pipeline's :math:`f_g`
stays the head fitted under the zero-shot posterior.
Shapes: N samples, K classes, d embedding dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from frolic_tta.gda import GaussianHead, MomentSums, fit_gaussian_head
from frolic_tta.logits import DEFAULT_CHUNK_SIZE, ReduceFn, identity_reduce
from frolic_tta.options import Shrinkage


@dataclass(frozen=True)
class TestPrior:
    r"""Result of :func:`estimate_test_prior`.

    The EM estimate :math:`\hat\pi` is noisy where N is small against the mixture's
    parameters (its error is then at the level of the imbalance it would correct), so it is
    shrunk towards a balanced test set by a positive-part James-Stein factor on the
    likelihood-ratio statistic :math:`\Lambda = 2(\ell(\hat\pi) - \ell(\mathbf 1/K))` of the
    fitted mixture:

    .. math::
        \tilde\pi = \tfrac1K\mathbf 1 + w\,(\hat\pi - \tfrac1K\mathbf 1),\qquad
        w = \max\Big(0,\ 1 - \frac{c\,(K-1)\,\nu}{\Lambda}\Big),\qquad
        \nu = 1 + \frac{2Kd}{N}.

    On a balanced test set :math:`\Lambda` would be about :math:`\chi^2_{K-1}` for a mixture
    with known components; its components are fitted on the same samples, and with few
    samples per mean parameter the weights chase their noise: :math:`\nu` is the inflation
    measured on balanced data (:math:`\Lambda/(K-1)` = 0.8, 5.8, 23 at :math:`Kd/N` = 0.3, 3.2,
    10; ``benchmarks/label_shift.py``), and :math:`c` (``evidence``, default 2) the margin
    above it.

    Attributes:
        prior: ``(K,)`` :math:`\tilde\pi`, sums to 1.
        raw: ``(K,)`` the EM estimate :math:`\hat\pi` before shrinkage.
        weight: :math:`w` in [0, 1] (0: the test set is treated as balanced).
        likelihood_ratio: :math:`\Lambda`.
        sums: reduced moment sums whose soft statistics are the final responsibilities.
        head: the mixture's head fitted from ``sums``.
        iterations: EM passes run.
        converged: :math:`\|\Delta\hat\pi\|_1 < \epsilon` was reached.
    """

    prior: Tensor
    raw: Tensor
    weight: float
    likelihood_ratio: float
    sums: MomentSums
    head: GaussianHead
    iterations: int
    converged: bool


def responsibility_sums(
    features: Tensor,
    head: GaussianHead,
    log_prior: Tensor,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    r"""``[L_pi, L_u, sum_i q_i (K,), sum_i q_i x_i^T (K*d,)]`` of the local shard, float64.

    :math:`q_i = \mathrm{softmax}(f_g(x_i) + \ln\pi)`; :math:`L_\pi = \sum_i
    \operatorname{lse}(f_g(x_i) + \ln\pi)` and :math:`L_u` the same with a uniform prior (their
    difference is the log-likelihood ratio of :math:`\pi` against a balanced test set).
    """
    k, d = head.class_means.shape
    totals = torch.zeros(2, dtype=torch.float64, device=features.device)
    count = torch.zeros(k, dtype=torch.float64, device=features.device)
    weighted = torch.zeros(k, d, dtype=torch.float64, device=features.device)
    for start, logits in head.affine().source(features, chunk_size).chunks():
        uniform = torch.logsumexp(logits, dim=1).sum(dtype=torch.float64)
        totals[1] += uniform - logits.shape[0] * math.log(k)
        logits = logits + log_prior.to(logits)
        norm = torch.logsumexp(logits, dim=1, keepdim=True)
        posterior = torch.exp(logits - norm)
        block = features[start : start + logits.shape[0]].to(posterior.dtype)
        totals[0] += norm.sum(dtype=torch.float64)
        count += posterior.sum(0).double()
        weighted += (posterior.t() @ block).double()
    return torch.cat([totals, count, weighted.flatten()]).cpu()


def mixture_log_likelihood(head: GaussianHead, sums: MomentSums, lse_sum: float) -> float:
    r"""Log-likelihood of the data under the mixture, up to a constant, from the pass's
    :math:`\sum_i \operatorname{lse}(f_g(x_i) + \ln\pi)` (centred logits) and the sums.

    The centred logits differ from :math:`\ln\mathcal N(x_i; m_j, \Sigma)` by
    :math:`\frac12(x_i - \hat\mu)^\top\Sigma^{-1}(x_i - \hat\mu) + \frac12\ln|\Sigma|`,
    whose sum over samples is :math:`\frac N2(\operatorname{tr}(\Sigma^{-1}C) + \ln|\Sigma|)`
    with :math:`C = \hat M - \hat\mu\hat\mu^\top`: no extra pass.
    """
    n = float(sums.count)
    mean = sums.feature_sum / n
    total = sums.outer_sum / n - torch.outer(mean, mean)
    factor = torch.linalg.cholesky(head.shared_covariance)
    trace = float(torch.cholesky_solve(total, factor).diagonal().sum())
    log_det = 2.0 * float(torch.log(factor.diagonal()).sum())
    return lse_sum - 0.5 * n * (trace + log_det)


def _em_map(
    features: Tensor,
    prototypes: Tensor,
    sums: MomentSums,
    shrinkage: Shrinkage,
    prior_floor: float,
    reduce_fn: ReduceFn,
    chunk_size: int | None,
) -> tuple[MomentSums, float, float]:
    """One EM step from the soft statistics of ``sums``: the next sums, the log-likelihood and
    the likelihood-ratio statistic against a uniform prior, both at the input parameters (one
    pass, one reduction)."""
    k, d = sums.soft_sum.shape
    head = fit_gaussian_head(sums, prototypes, "soft", shrinkage)
    prior = sums.soft_count / sums.count
    log_prior = torch.log(prior.clamp(min=prior_floor / k)).cpu()
    reduced = reduce_fn(responsibility_sums(features, head, log_prior, chunk_size))
    reduced = reduced.to(sums.soft_count.device)
    new = replace(sums, soft_count=reduced[2 : k + 2], soft_sum=reduced[k + 2 :].reshape(k, d))
    ratio = 2.0 * float(reduced[0] - reduced[1])
    return new, mixture_log_likelihood(head, sums, float(reduced[0])), ratio


def _extrapolate(s0: MomentSums, s1: MomentSums, s2: MomentSums) -> MomentSums | None:
    """SQUAREM's step (Varadhan and Roland 2008, S3) on the soft statistics, or ``None`` if
    it leaves the valid region (a class count <= 0)."""
    k = s0.soft_count.shape[0]

    def flat(s: MomentSums) -> Tensor:
        return torch.cat([s.soft_count, s.soft_sum.flatten()])

    r = flat(s1) - flat(s0)
    v = flat(s2) - flat(s1) - r
    norm_v = float(v.norm())
    if norm_v == 0.0:
        return None
    alpha = min(-float(r.norm()) / norm_v, -1.0)
    theta = flat(s0) - 2.0 * alpha * r + alpha * alpha * v
    if not bool((theta[:k] > 0).all()):
        return None
    return replace(s0, soft_count=theta[:k], soft_sum=theta[k:].reshape(s0.soft_sum.shape))


def estimate_test_prior(
    features: Tensor,
    prototypes: Tensor,
    sums: MomentSums,
    *,
    shrinkage: Shrinkage = "auto",
    iterations: int = 12,
    evidence: float = 2.0,
    eps: float = 1e-3,
    prior_floor: float = 1e-30,
    reduce_fn: ReduceFn | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> TestPrior:
    r"""EM on the shared-covariance Gaussian mixture, from the responsibilities in ``sums``,
    accelerated by SQUAREM (Varadhan and Roland 2008).

    EM converges slowly where classes overlap (the mixture weights move a little per step);
    SQUAREM extrapolates two EM steps along their differences and takes one more EM step from
    there, accepted when the mixture's log-likelihood does not drop (else the plain second
    step is kept). Its state is the soft statistics, so every rank extrapolates identically.

    Args:
        features: ``(N_local, d)`` features of the local shard.
        prototypes: ``(K, d)``.
        sums: reduced sums whose soft statistics are the initial responsibilities (the
            zero-shot posterior of :class:`~frolic_tta.metrics.FrolicMoments`).
        shrinkage: of the soft covariance (:func:`~frolic_tta.gda.fit_gaussian_head`).
        iterations: cap on EM passes (each one pass over the features and one reduction).
        evidence: :math:`c` of the shrinkage towards uniform (:class:`TestPrior`); ``0`` keeps
            the EM estimate as it is.
        eps: stop when :math:`\|\hat\pi^t - \hat\pi^{t-1}\|_1 < \epsilon` between cycles.
        prior_floor: :math:`\hat\pi_j \ge` ``prior_floor`` / K inside :math:`\ln\hat\pi`.
        reduce_fn: sums a tensor over shards (identity by default).
        chunk_size: rows per chunk.

    Returns:
        :class:`TestPrior`.
    """
    reduce_fn = reduce_fn or identity_reduce
    n = float(sums.count)

    def step(state: MomentSums) -> tuple[MomentSums, float, float]:
        return _em_map(features, prototypes, state, shrinkage, prior_floor, reduce_fn, chunk_size)

    passes, converged, ratio = 0, False, 0.0
    while passes < iterations:
        prior = sums.soft_count / n
        first, _, ratio = step(sums)
        passes += 1
        if passes + 2 > iterations:
            sums = first
        else:
            second, reference, ratio = step(first)
            jump = _extrapolate(sums, first, second)
            sums = second
            if jump is not None:
                try:
                    after, likelihood, jump_ratio = step(jump)
                except (ValueError, torch.linalg.LinAlgError):
                    after, likelihood, jump_ratio = second, -math.inf, ratio  # not PD
                if likelihood >= reference:
                    sums, ratio = after, jump_ratio
            passes += 1 if jump is None else 2
        if float((sums.soft_count / n - prior).abs().sum()) < eps:
            converged = True
            break
    raw = sums.soft_count / n
    k, d = sums.soft_sum.shape
    null = (k - 1) * (1.0 + 2.0 * k * d / n)  # the statistic's size on balanced data
    weight = max(0.0, 1.0 - evidence * null / ratio) if ratio > 0 else 0.0
    uniform = torch.full_like(raw, 1.0 / k)
    head = fit_gaussian_head(sums, prototypes, "soft", shrinkage)
    return TestPrior(
        uniform + weight * (raw - uniform), raw, weight, ratio, sums, head, passes, converged
    )


@dataclass(frozen=True)
class Priors:
    r"""What a fit estimated about class priors (for results, reports and plots).

    Attributes:
        test_prior: ``(K,)`` :math:`\tilde\pi`, the test set's class prior used (uniform with
            ``test_prior="uniform"``).
        raw_test_prior: ``(K,)`` the EM estimate before shrinkage, or ``None``.
        shift_weight: the shrinkage weight :math:`w` (0: treated as balanced).
        likelihood_ratio: :math:`\Lambda` of the EM estimate against uniform, or ``None``.
        beta: ``(K,)`` the fused classifier's label bias :math:`\hat\beta` (Eq. 13 on
            :math:`f_f`), the offset :math:`f_d` removes; it also absorbs the class sizes of
            the Gaussian head, so it is an offset more than a prior.
        beta_undetermined: ``(K,)`` bool, classes of ``beta`` the data do not determine.
        zero_shot_beta: ``(K,)`` the zero-shot model's pre-training label prior (Proposition 2
            on its own posterior :math:`f_c/\tau_c`), bounded by ``beta_ratio_bound``.
        zero_shot_beta_undetermined: ``(K,)`` bool, its classes at the bound or not moved by
            the data.
    """

    test_prior: Tensor
    raw_test_prior: Tensor | None
    shift_weight: float
    likelihood_ratio: float | None
    beta: Tensor
    beta_undetermined: Tensor
    zero_shot_beta: Tensor
    zero_shot_beta_undetermined: Tensor

    def summary(self, digits: int = 6) -> dict[str, object]:
        """JSON-friendly spreads, flags and per-class vectors (``digits`` significant)."""

        def spread(values: Tensor, undetermined: Tensor) -> dict[str, object]:
            values = values.double().cpu()
            return {
                "min": float(f"{float(values.min()):.{digits}g}"),
                "max": float(f"{float(values.max()):.{digits}g}"),
                "max_over_min": float(f"{float(values.max() / values.min()):.{digits}g}"),
                "undetermined": int(undetermined.sum()),
                "determined": not bool(undetermined.any()),
            }

        def listed(values: Tensor | None) -> list[float] | None:
            if values is None:
                return None
            return [float(f"{float(v):.{digits}g}") for v in values.double().cpu()]

        return {
            "test_prior": {
                "estimated": self.raw_test_prior is not None,
                "shift_weight": round(self.shift_weight, digits),
                "likelihood_ratio": None
                if self.likelihood_ratio is None
                else float(f"{self.likelihood_ratio:.{digits}g}"),
                "max_over_min": float(
                    f"{float(self.test_prior.max() / self.test_prior.min()):.{digits}g}"
                ),
            },
            "beta": spread(self.beta, self.beta_undetermined),
            "zero_shot_beta": spread(self.zero_shot_beta, self.zero_shot_beta_undetermined),
            "per_class": {
                "test_prior": listed(self.test_prior),
                "raw_test_prior": listed(self.raw_test_prior),
                "beta": listed(self.beta),
                "beta_undetermined": self.beta_undetermined.tolist(),
                "zero_shot_beta": listed(self.zero_shot_beta),
                "zero_shot_beta_undetermined": self.zero_shot_beta_undetermined.tolist(),
            },
        }
