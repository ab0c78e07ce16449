r"""Gaussian-mixture computations behind the test prior (:mod:`frolic_tta.prior`).

The GDA head is a Gaussian mixture with a shared covariance (Section 3.2),
:math:`p(x) = \sum_j \pi_j\,\mathcal N(x; \mu_j, \Sigma)`. Two solvers, each a pass over
the local shard and one ``reduce_fn`` call per step, with every stop test on reduced values:

* :func:`mixture_weights` -- the weights :math:`\pi` alone with the components fixed
  (maximum-likelihood label shift, Saerens et al. 2002): a concave problem, EM steps on
  :math:`\pi` with SQUAREM, over stored component log-likelihoods.
* :func:`fit_mixture` -- EM on the whole mixture (means, shared covariance, weights):
  M-step :math:`\hat\pi_j = \frac1N\sum_i q_{ij}`, :math:`m_j = \sum_i q_{ij}x_i/\sum_i
  q_{ij}`, :math:`\hat\Sigma` the soft scatter of :mod:`frolic_tta.gda`; E-step :math:`q_i =
  \mathrm{softmax}(f_g(x_i) + \ln\hat\pi)` (Eq. 9's logits are the class log-likelihoods up
  to a constant per sample), accelerated with SQUAREM (Varadhan and Roland 2008) on the soft
  statistics, so every rank extrapolates identically.

Shapes: N samples, K classes, d embedding dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from frolic_tta.gda import GaussianHead, MomentSums, fit_gaussian_head
from frolic_tta.logits import DEFAULT_CHUNK_SIZE, LogitSource, ReduceFn, identity_reduce
from frolic_tta.options import Shrinkage


@dataclass(frozen=True)
class _MixtureSums:
    """Named pieces of one pass of the mixture's likelihood over a shard (packed for one
    reduction)."""

    count: Tensor  # ()
    log_likelihood: Tensor  # () sum_i lse(g_i + ln pi)
    uniform_log_likelihood: Tensor  # () sum_i lse(g_i) - N ln K
    responsibility: Tensor  # (K,) sum_i q_i

    def pack(self) -> Tensor:
        head = torch.stack([self.count, self.log_likelihood, self.uniform_log_likelihood])
        return torch.cat([head, self.responsibility])

    @classmethod
    def unpack(cls, packed: Tensor) -> _MixtureSums:
        return cls(packed[0], packed[1], packed[2], packed[3:])


def _mixture_sums(source: LogitSource, log_prior: Tensor) -> _MixtureSums:
    """One pass over the component log-likelihoods ``g`` of the local shard (float64 sums)."""
    k = source.num_classes
    total = torch.zeros(3, dtype=torch.float64)
    responsibility = torch.zeros(k, dtype=torch.float64)
    for _, logits in source.chunks():
        uniform = torch.logsumexp(logits, dim=1).sum(dtype=torch.float64)
        shifted = logits + log_prior.to(logits)
        norm = torch.logsumexp(shifted, dim=1, keepdim=True)
        total[0] += logits.shape[0]
        total[1] += float(norm.sum(dtype=torch.float64))
        total[2] += float(uniform) - logits.shape[0] * math.log(k)
        responsibility += torch.exp_(shifted.sub_(norm)).sum(0).double().cpu()
    return _MixtureSums(total[0], total[1], total[2], responsibility)


def mixture_weights(
    source: LogitSource,
    init: Tensor | None = None,
    *,
    tol: float = 1e-9,
    max_passes: int = 500,
    reduce_fn: ReduceFn | None = None,
) -> tuple[Tensor, float, int, bool]:
    r"""Maximum-likelihood mixture weights for fixed component log-likelihoods.

    Maximises :math:`\ell(\pi) = \sum_i \ln\sum_j \pi_j e^{g_{ij}}` over the simplex by EM
    (:math:`\pi \leftarrow \frac1N\sum_i \mathrm{softmax}(g_i + \ln\pi)`), two steps at a time
    extrapolated by SQUAREM's S3 step and kept only if the likelihood does not drop.
    :math:`\ell` is concave, so the maximiser is unique where the components are distinct.

    Args:
        source: ``(N_local, K)`` component log-likelihoods :math:`g` of the local shard.
        init: ``(K,)`` starting weights (default uniform).
        tol: stop when an EM step moves :math:`\pi` by less than ``tol`` in L1.
        max_passes: cap on passes (each one reduction).
        reduce_fn: sums a tensor over shards.

    Returns:
        ``(pi (K,), Lambda, passes, converged)`` with :math:`\Lambda = 2(\ell(\hat\pi) -
        \ell(\mathbf 1/K))` clamped at 0.
    """
    reduce_fn = reduce_fn or identity_reduce
    k = source.num_classes
    tiny = torch.finfo(torch.float64).tiny
    pi = torch.full((k,), 1.0 / k, dtype=torch.float64) if init is None else init.double()

    def step(prior: Tensor) -> tuple[Tensor, _MixtureSums]:
        local = _mixture_sums(source, prior.clamp(min=tiny).log())
        sums = _MixtureSums.unpack(reduce_fn(local.pack()))
        new = sums.responsibility / sums.count
        return new / new.sum(), sums

    passes, converged = 0, False
    first, at_pi = step(pi)
    passes += 1
    while passes < max_passes:
        if float((first - pi).abs().sum()) < tol:
            pi, converged = first, True
            break
        second, at_first = step(first)
        passes += 1
        r, v = first - pi, second - 2 * first + pi
        norm_v = float(v.norm())
        candidate = second
        if norm_v > 0.0:
            alpha = min(-float(r.norm()) / norm_v, -1.0)
            jump = pi - 2.0 * alpha * r + alpha * alpha * v
            if bool((jump > 0).all()):
                candidate = jump / jump.sum()
        after, at_candidate = step(candidate)
        passes += 1
        if candidate is not second and float(at_candidate.log_likelihood) < float(
            at_first.log_likelihood
        ):  # the jump lost likelihood: continue from the plain EM steps
            candidate = second
            after, at_candidate = step(candidate)
            passes += 1
        pi, first, at_pi = candidate, after, at_candidate
    ratio = max(0.0, 2.0 * float(at_pi.log_likelihood - at_pi.uniform_log_likelihood))
    return pi, ratio, passes, converged


@dataclass(frozen=True)
class _Responsibilities:
    """Named pieces of one E-step pass over a shard (packed for one reduction)."""

    log_likelihood: Tensor  # () sum_i lse(f_g(x_i) + ln pi)
    count: Tensor  # (K,) sum_i q_i
    weighted: Tensor  # (K, d) sum_i q_i x_i^T

    def pack(self) -> Tensor:
        return torch.cat([self.log_likelihood.reshape(1), self.count, self.weighted.flatten()])

    @classmethod
    def unpack(cls, packed: Tensor, k: int) -> _Responsibilities:
        return cls(packed[0], packed[1 : k + 1], packed[k + 1 :].reshape(k, -1))


def responsibility_sums(
    features: Tensor,
    head: GaussianHead,
    log_prior: Tensor,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> _Responsibilities:
    r"""The E-step's sums over the local shard, float64: :math:`\sum_i
    \operatorname{lse}(f_g(x_i) + \ln\pi)`, :math:`\sum_i q_i` and :math:`\sum_i q_i x_i^\top`
    for :math:`q_i = \mathrm{softmax}(f_g(x_i) + \ln\pi)`."""
    k, d = head.class_means.shape
    total = torch.zeros((), dtype=torch.float64, device=features.device)
    count = torch.zeros(k, dtype=torch.float64, device=features.device)
    weighted = torch.zeros(k, d, dtype=torch.float64, device=features.device)
    for start, logits in head.affine().source(features, chunk_size).chunks():
        logits = logits + log_prior.to(logits)
        norm = torch.logsumexp(logits, dim=1, keepdim=True)
        posterior = torch.exp(logits - norm)
        block = features[start : start + logits.shape[0]].to(posterior.dtype)
        total += norm.sum(dtype=torch.float64)
        count += posterior.sum(0).double()
        weighted += (posterior.t() @ block).double()
    return _Responsibilities(total.cpu(), count.cpu(), weighted.cpu())


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
) -> tuple[MomentSums, float]:
    """One EM step from the soft statistics of ``sums``: the next sums and the log-likelihood
    at the input parameters (one pass, one reduction)."""
    k, d = sums.soft_sum.shape
    head = fit_gaussian_head(sums, prototypes, "soft", shrinkage)
    prior = sums.soft_count / sums.count
    log_prior = torch.log(prior.clamp(min=prior_floor / k)).cpu()
    local = responsibility_sums(features, head, log_prior, chunk_size)
    reduced = _Responsibilities.unpack(reduce_fn(local.pack()), k)
    device = sums.soft_count.device
    new = replace(sums, soft_count=reduced.count.to(device), soft_sum=reduced.weighted.to(device))
    return new, mixture_log_likelihood(head, sums, float(reduced.log_likelihood))


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


def fit_mixture(
    features: Tensor,
    prototypes: Tensor,
    sums: MomentSums,
    *,
    shrinkage: Shrinkage = "auto",
    tol: float = 1e-4,
    max_passes: int = 100,
    prior_floor: float = 1e-30,
    reduce_fn: ReduceFn | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> tuple[MomentSums, int, bool]:
    r"""EM on the shared-covariance mixture from the responsibilities in ``sums``, with SQUAREM.

    Two EM steps are extrapolated along their differences and one more step is taken from
    there, kept when the mixture's log-likelihood does not drop (else the plain second step).

    Args:
        features: ``(N_local, d)`` features of the local shard.
        prototypes: ``(K, d)`` (used only where a class has no mass).
        sums: reduced sums whose soft statistics are the initial responsibilities.
        shrinkage: of the soft covariance (:func:`~frolic_tta.gda.fit_gaussian_head`).
        tol: stop when a cycle moves :math:`\hat\pi` by less than ``tol`` in L1.
        max_passes: cap on passes (each one pass over the features and one reduction).
        prior_floor: :math:`\hat\pi_j \ge` ``prior_floor`` / K inside :math:`\ln\hat\pi`.
        reduce_fn: sums a tensor over shards (identity by default).
        chunk_size: rows per chunk.

    Returns:
        ``(sums, passes, converged)``: the soft statistics of the last responsibilities.
    """
    reduce_fn = reduce_fn or identity_reduce
    n = float(sums.count)

    def step(state: MomentSums) -> tuple[MomentSums, float]:
        return _em_map(features, prototypes, state, shrinkage, prior_floor, reduce_fn, chunk_size)

    passes, converged = 0, False
    while passes < max_passes:
        prior = sums.soft_count / n
        first, _ = step(sums)
        passes += 1
        if passes + 2 > max_passes:
            sums = first
        else:
            second, reference = step(first)
            jump = _extrapolate(sums, first, second)
            sums = second
            passes += 1
            if jump is not None:
                try:
                    after, likelihood = step(jump)
                except (ValueError, torch.linalg.LinAlgError):
                    after, likelihood = second, -math.inf  # not positive definite
                passes += 1
                if likelihood >= reference:
                    sums = after
        if float((sums.soft_count / n - prior).abs().sum()) < tol:
            converged = True
            break
    return sums, passes, converged
