r"""Label-free Gaussian discriminant head (paper Section 3.2, Eqs. 3-9).

Everything here is computed from a handful of **sums over samples** (:class:`MomentSums`), so a
sharded dataset gives the same head as one pass once the sums are reduced.

Two covariance estimators:

* ``"paper"`` -- Eq. 7 literally: :math:`\hat\Sigma = \hat M - \frac1K\sum_j z_j z_j^\top` with
  class means :math:`z_j`. On unit-norm CLIP features :math:`\operatorname{tr}\hat M = 1 =
  \operatorname{tr}(\frac1K Z^\top Z)`, so :math:`\hat\Sigma` has trace 0 and is never positive
  definite.
* ``"soft"`` (default) -- the within-class scatter under the zero-shot posterior
  :math:`p_{ij} = \mathrm{softmax}(f_c(x_i)/\tau_c)_j`:

  .. math::
      \hat\pi_j = \tfrac1N\textstyle\sum_i p_{ij},\quad
      m_j = \frac{\sum_i p_{ij} x_i}{\sum_i p_{ij}},\quad
      \hat\Sigma = \hat M - \sum_j \hat\pi_j m_j m_j^\top
      = \tfrac1N\textstyle\sum_{i,j} p_{ij}(x_i - m_j)(x_i - m_j)^\top \succeq 0,

  with ``shrinkage="auto"`` (default) left as is while it is numerically positive definite
  (:math:`\lambda_{\min} > 10^{-6}\operatorname{tr}\hat\Sigma/d`; true once N > d in
  practice) and otherwise shrunk towards :math:`\frac{\operatorname{tr}\hat\Sigma}{d} I` with
  the Oracle Approximating Shrinkage intensity (Chen et al. 2010, as scikit-learn's ``OAS``),
  which needs only :math:`\hat\Sigma` and N (``benchmarks/defaults.py``: OAS costs 1-2 points
  where the scatter is PD, and is required when N <= d). It is Eq. 5 with :math:`\pi` and the
  class means :math:`m_j` estimated; with the Bayes posterior as :math:`p` it tends to Eq. 7.

The head (Eq. 9): :math:`w_j = \hat\Sigma^{-1}\mu_j`, :math:`b_j = -\frac12\mu_j^\top w_j`,
solved by Cholesky (``"soft"``) or LU (``"paper"``, indefinite), never by ``inverse``. It is
evaluated in *centred* form, :math:`f_g(x)_j = \tilde w_j^\top(x - \hat\mu) + \tilde b_j` with
:math:`\tilde w_j = \hat\Sigma^{-1}(\mu_j - \hat\mu)`, :math:`\tilde b_j = -\frac12(\mu_j -
\hat\mu)^\top\tilde w_j`, which differs from Eq. 9 by
:math:`\hat\mu^\top\hat\Sigma^{-1}x - \frac12\hat\mu^\top\hat\Sigma^{-1}\hat\mu`, a constant per
sample: softmax, argmax, confidence, :math:`\tau_g` and :math:`\beta` are unchanged, but the
large common offset (and its float32 cancellation) is gone.
:meth:`GaussianHead.paper_parameters` returns Eq. 9's literal :math:`(w, b)`.
Shapes: N samples, K classes, d embedding dim.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from frolic_tta.errors import FrolicInputError, warn
from frolic_tta.logits import AffineMap, ReduceFn, chunk_rows, compute_dtype, flushed_exp
from frolic_tta.options import (
    COVARIANCES,
    Covariance,
    Shrinkage,
    check_choice,
    check_positive,
    check_shrinkage,
)
from frolic_tta.shrinkage import oas_shrinkage, shrink
from frolic_tta.validation import check_invertible


@dataclass
class MomentSums:
    r"""Additive sufficient statistics of one shard (float64).

    Attributes:
        count: ``()`` number of samples N.
        feature_sum: ``(d,)`` :math:`\sum_i x_i`.
        outer_sum: ``(d, d)`` :math:`\sum_i x_i x_i^\top`.
        soft_count: ``(K,)`` :math:`\sum_i p_{ij}` under the zero-shot posterior.
        soft_sum: ``(K, d)`` :math:`\sum_i p_{ij} x_i`.
        zero_shot_deficit: ``()`` :math:`\sum_i (1 - \max_j p_{ij})`, the target of
            :math:`\tau_g` (Eqs. 10-11), or ``None`` (a pass over the logits sums it).
        zero_shot_margin: ``()`` :math:`\sum_i (\max_j - \operatorname{mean}_j) f_{c,ij}/\tau_c`.
    """

    count: Tensor
    feature_sum: Tensor
    outer_sum: Tensor
    soft_count: Tensor
    soft_sum: Tensor
    zero_shot_deficit: Tensor | None = None
    zero_shot_margin: Tensor | None = None

    @property
    def mean(self) -> Tensor:
        r"""``(d,)`` the mean feature :math:`\hat\mu`."""
        return self.feature_sum / self.count

    def reduce(self, reduce_fn: ReduceFn) -> MomentSums:
        """Sum every field over shards with ``reduce_fn`` (``None`` fields stay ``None``)."""
        values = [getattr(self, f.name) for f in fields(self)]
        return MomentSums(*(None if v is None else reduce_fn(v) for v in values))

    def __add__(self, other: MomentSums) -> MomentSums:
        pairs = [(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)]
        return MomentSums(*(None if a is None or b is None else a + b for a, b in pairs))


def scaled_zero_shot(features: Tensor, prototypes: Tensor, tau_c: float) -> Tensor:
    r"""Zero-shot logits :math:`f_c/\tau_c = x Z^\top/\tau_c` from float64 products, ``(N, K)``
    float64 (the posterior's logits; finalize's buffer holds them rounded to float32)."""
    x = features.detach().to(torch.float64)
    return (x @ prototypes.detach().to(torch.float64).t()).div_(tau_c)


def zero_shot_buffer(
    features: Tensor,
    prototypes: Tensor,
    tau_c: float,
    chunk_size: int | None = None,
    given: Tensor | None = None,
) -> Tensor:
    r"""``(N, K)`` :math:`f_c/\tau_c` in the features' compute dtype (float32; float64 stays
    float64), rounded from float64 products chunk by chunk: what
    :class:`~frolic_tta.metrics.FrolicMoments` keeps, so a fit from kept logits and one from
    the features alone hold the same buffer. ``given``: those logits already computed (moved
    to the features' device and dtype, not recomputed).

    Raises:
        ValueError: ``given`` is not of shape ``(N, K)``.
    """
    expected = (features.shape[0], prototypes.shape[0])
    dtype = compute_dtype(features)
    if given is not None:
        if tuple(given.shape) != expected:
            raise ValueError(
                f"Expected `zero_shot_logits` of shape {expected} (N_local, K), "
                f"but got {tuple(given.shape)}"
            )
        return given.to(device=features.device, dtype=dtype)
    out = torch.empty(expected, dtype=dtype, device=features.device)
    rows = chunk_rows(prototypes.shape[0], chunk_size)
    for start in range(0, features.shape[0], rows):
        block = features[start : start + rows]
        out[start : start + block.shape[0]] = scaled_zero_shot(block, prototypes, tau_c)
    return out


def moment_sums(
    features: Tensor, prototypes: Tensor, tau_c: float, keep: list[Tensor] | None = None
) -> MomentSums:
    r"""The sums of one shard (functional twin of :class:`frolic_tta.metrics.FrolicMoments`).

    Args:
        features: ``(n, d)`` image features of the shard (any float dtype).
        prototypes: ``(K, d)`` class prototypes.
        tau_c: zero-shot temperature of the posterior used for the soft statistics.
        keep: a list to which the shard's zero-shot logits :math:`f_c/\tau_c` ``(n, K)`` are
            appended, rounded from the float64 products the posterior is computed from to the
            features' compute dtype (float32; float64 stays float64): finalize's first
            ``(N, K)`` buffer without a product of its own (``None``: not kept).

    Returns:
        :class:`MomentSums` in float64 (detached: no gradient flows through them).

    Raises:
        TypeError: ``tau_c`` is not a real number.
        ValueError: ``tau_c`` is not finite and > 0.
    """
    tau_c = check_positive("tau_c", tau_c)
    x = features.detach().to(torch.float64)
    scaled = scaled_zero_shot(x, prototypes, tau_c)
    if keep is not None:
        keep.append(scaled.to(compute_dtype(features)))
    # the softmax with the top class's term (exactly 1) left out of r = sum_{j != a} e_j, so
    # the deficit r / (1 + r) keeps its digits where 1 - max_j p_ij rounds to 0
    top, where = scaled.max(dim=1, keepdim=True)
    posterior = flushed_exp(torch.sub(scaled, top))
    rest = posterior.scatter_(1, where, 0.0).sum(1, keepdim=True)
    posterior.scatter_(1, where, 1.0).div_(1.0 + rest)
    return MomentSums(
        count=torch.full((), float(x.shape[0]), dtype=torch.float64, device=x.device),  # no copy
        feature_sum=x.sum(0),
        outer_sum=x.t() @ x,
        soft_count=posterior.sum(0),
        soft_sum=posterior.t() @ x,
        zero_shot_deficit=(rest / (1.0 + rest)).sum(),
        zero_shot_margin=(top.squeeze(1) - scaled.mean(1)).sum(),
    )


@dataclass
class GaussianHead:
    r"""A fitted label-free GDA head, float64.

    Attributes:
        weight: ``(K, d)`` centred rows :math:`\tilde w_j = \hat\Sigma^{-1}(\mu_j - \hat\mu)`.
        bias: ``(K,)`` :math:`\tilde b_j = -\frac12(\mu_j - \hat\mu)^\top\tilde w_j`.
        center: ``(d,)`` :math:`\hat\mu`, subtracted from x before ``weight``.
        class_means: ``(K, d)`` means :math:`\mu_j` the head was built from.
        shared_covariance: ``(d, d)`` :math:`\hat\Sigma` (after shrinkage).
        shrinkage: OAS intensity used (0 for ``"paper"``).
        class_weights: ``(K,)`` :math:`\hat\pi_j` (uniform for ``"paper"``).
    """

    weight: Tensor
    bias: Tensor
    center: Tensor
    class_means: Tensor
    shared_covariance: Tensor
    shrinkage: float
    class_weights: Tensor

    def gda(self) -> AffineMap:
        """:math:`f_g` as an :class:`~frolic_tta.logits.AffineMap` (centred)."""
        return AffineMap(self.weight, self.bias, self.center)

    def paper_parameters(self) -> tuple[Tensor, Tensor]:
        r"""Eq. 9 literally: ``(w (K, d), b (K,))`` with :math:`w_j = \hat\Sigma^{-1}\mu_j`."""
        weight = torch.linalg.solve(self.shared_covariance, self.class_means.t()).t()
        return weight, -0.5 * (self.class_means * weight).sum(1)


RANK_TOLERANCE = 1e-6


def shared_covariance(
    sums: MomentSums,
    prototypes: Tensor,
    covariance: Covariance = "soft",
    shrinkage: Shrinkage = "auto",
) -> tuple[Tensor, Tensor, Tensor, float]:
    r"""Estimate :math:`\hat\Sigma`, class means and class weights from reduced sums.

    Args:
        sums: reduced :class:`MomentSums` of the whole dataset.
        prototypes: ``(K, d)``.
        covariance: ``"soft"`` (default) or ``"paper"`` (Eq. 7); ``"released"`` is
            :func:`released_gaussian` (:func:`fit_gaussian_head` only).
        shrinkage: ``"auto"`` (OAS only if the scatter is numerically rank-deficient),
            ``"oas"``, a float in [0, 1], or ``None`` (``"soft"`` only).

    Returns:
        ``(covariance (d, d), class_means (K, d), class_weights (K,), shrinkage)``.
    """
    check_choice("covariance", covariance, COVARIANCES)
    check_shrinkage(shrinkage)
    n = float(sums.count)
    second_moment = sums.outer_sum / n
    z = prototypes.to(device=second_moment.device, dtype=torch.float64)
    k = z.shape[0]
    if covariance == "paper":
        sigma = second_moment - z.t() @ z / k
        return sigma, z, torch.full((k,), 1.0 / k, dtype=torch.float64, device=z.device), 0.0

    global_mean = sums.feature_sum / n
    weights = sums.soft_count / n
    occupied = sums.soft_count > 0
    safe = torch.where(occupied, sums.soft_count, torch.ones_like(sums.soft_count))
    means = torch.where(occupied[:, None], sums.soft_sum / safe[:, None], global_mean[None, :])
    # sum_j pi_j m_j m_j^T = (1/N) sum_j s_j s_j^T / n_j, without any K x K matrix
    between = (sums.soft_sum / safe[:, None]).t() @ sums.soft_sum / n
    sigma = second_moment - between
    sigma = 0.5 * (sigma + sigma.t())
    if shrinkage is None:
        rho = 0.0
    elif shrinkage == "oas":
        rho = oas_shrinkage(sigma, n)
    elif shrinkage == "auto":
        floor = RANK_TOLERANCE * float(torch.diagonal(sigma).sum()) / sigma.shape[0]
        deficient = float(torch.linalg.eigvalsh(sigma)[0]) <= floor
        rho = oas_shrinkage(sigma, n) if deficient else 0.0
    else:
        rho = float(shrinkage)
    return shrink(sigma, rho), means, weights, rho


RIDGE_MATTERS = 1e-3
"""Relative change of the head's direction above which the ridge is said to change it."""


def ridge_factor(covariance: Tensor) -> tuple[Tensor, Tensor, float]:
    r"""``(covariance + \lambda I, its Cholesky factor, \lambda)`` with the smallest
    :math:`\lambda = 10^{-10+m}\max(\operatorname{tr}\Sigma/d, 10^{-12})`, m = 0, 1, ..., that
    makes the factorisation succeed."""
    d = covariance.shape[0]
    scale = max(float(torch.diagonal(covariance).sum()) / d, 1e-12)
    for power in range(-10, 13):
        ridge = scale * 10.0**power
        shifted = covariance + ridge * torch.eye(
            d, dtype=covariance.dtype, device=covariance.device
        )
        factor, info = torch.linalg.cholesky_ex(shifted)
        if int(info) == 0:
            return shifted, factor, ridge
    raise ValueError(  # only non-finite entries get here; inputs are checked for those
        "Expected a finite within-class covariance, but no ridge makes it positive definite"
    )


def ridge_change(covariance: Tensor, centred: Tensor, weight: Tensor, ridge: float) -> float:
    r"""How much the head depends on the ridge: the distance between the unit-norm parameters
    :math:`(W, b)` at :math:`\lambda` and at :math:`10\lambda` (0: the same classifier up to a
    scale, which :math:`\tau_g` absorbs; ``centred`` is ``(d, K)``, ``weight`` ``(K, d)``)."""
    eye = torch.eye(covariance.shape[0], dtype=covariance.dtype, device=covariance.device)
    factor, info = torch.linalg.cholesky_ex(covariance + 10.0 * ridge * eye)
    if int(info) != 0:
        return float("inf")
    other = torch.cholesky_solve(centred, factor).t()

    def direction(w: Tensor) -> Tensor:
        params = torch.cat([w.flatten(), -0.5 * (centred.t() * w).sum(1)])
        return params / params.norm().clamp_min(torch.finfo(params.dtype).tiny)

    return float((direction(weight) - direction(other)).norm())


IDENTITY_WEIGHT = 0.9
r"""The script's ``lamda``: :math:`\hat\Sigma = 0.9 I + 0.1\,\mathrm{diag}(v)`."""


def released_gaussian(sums: MomentSums, prototypes: Tensor) -> GaussianHead:
    r"""The released script's Gaussian head (``covariance="released"``, :mod:`frolic_tta.released`)
    from the reduced ``sums`` and the ``prototypes`` ``(K, d)`` (the class means), centred like
    :func:`fit_gaussian_head`'s."""
    z = prototypes.to(device=sums.feature_sum.device, dtype=torch.float64)
    k, d = z.shape
    rows = float(sums.count) + k
    total = sums.feature_sum + z.sum(0)
    squares = torch.diagonal(sums.outer_sum) + (z * z).sum(0)
    variance = (squares - total * total / rows) / (rows - 1.0)
    diagonal = IDENTITY_WEIGHT + (1.0 - IDENTITY_WEIGHT) * variance
    center = sums.feature_sum / sums.count
    centred = z - center[None, :]
    weight = centred / diagonal[None, :]
    bias = -0.5 * (centred * weight).sum(1)
    uniform = torch.full((k,), 1.0 / k, dtype=torch.float64, device=z.device)
    return GaussianHead(weight, bias, center, z, torch.diag(diagonal), IDENTITY_WEIGHT, uniform)


def fit_gaussian_head(
    sums: MomentSums,
    prototypes: Tensor,
    covariance: Covariance = "soft",
    shrinkage: Shrinkage = "auto",
) -> GaussianHead:
    r"""Fit the GDA head :math:`f_g(x)_j = w_j^\top x + b_j` (Eq. 9) from reduced sums.

    With ``"soft"`` and any shrinkage, a scatter that is still not numerically positive
    definite (identical features, features on the prototypes, K >> N with hard posteriors) gets
    the smallest ridge :math:`\lambda I` that makes it so (:func:`ridge_factor`); a
    ``UserWarning`` says so only when the ridge changes the classifier (a 10x larger one moves the
    head's direction by more than :data:`RIDGE_MATTERS`); with ``shrinkage=None`` it is an
    error.

    Raises:
        ValueError: if the covariance is singular (``"paper"``) or not positive definite
            (``"soft"`` with ``shrinkage=None``).
    """
    if covariance == "released":  # the authors' script (frolic_tta.released)
        return released_gaussian(sums, prototypes)
    sigma, means, weights, rho = shared_covariance(sums, prototypes, covariance, shrinkage)
    center = sums.feature_sum / sums.count
    centred = (means - center[None, :]).t()
    if covariance == "soft":
        factor, info = torch.linalg.cholesky_ex(sigma)
        if int(info) != 0 and shrinkage is None:
            raise FrolicInputError(
                "Expected the soft within-class covariance to be positive definite, but its "
                f"Cholesky factorisation failed at column {int(info)} (fewer samples than "
                "dimensions, or identical features); use shrinkage='auto' or a float in [0, 1] "
                "(--model.options.shrinkage auto)"
            )
        ridge = 0.0
        if int(info) != 0:
            singular = sigma
            sigma, factor, ridge = ridge_factor(sigma)
        weight = torch.cholesky_solve(centred, factor).t()
        if ridge and (change := ridge_change(singular, centred, weight, ridge)) > RIDGE_MATTERS:
            warn(
                "the within-class scatter is numerically singular even after shrinkage "
                f"(identical or degenerate features?); added {ridge:.3g} I to make it positive "
                f"definite, which changes the Gaussian head (a 10x larger ridge moves its "
                f"direction by {change:.2g})"
            )
    else:
        check_invertible(sigma)  # Eq. 7 is indefinite: invertible is all that can be asked
        weight = torch.linalg.solve(sigma, centred).t()
    bias = -0.5 * (centred.t() * weight).sum(1)
    return GaussianHead(weight, bias, center, means, sigma, rho, weights)
