r"""Label-free estimation of the pre-training label prior :math:`\beta` (paper Section 3.4).

With :math:`s(x) = \mathrm{softmax}(f(x))` the model's posterior and
:math:`s_j = \mathbb E[s(x)\mid Y=j]`, Proposition 2 gives :math:`\beta = S\beta` (Eq. 14) for
:math:`S = [s_1, \dots, s_K]`; debiased logits are :math:`f - \ln\beta` (Eq. 13).

Methods (``method=``):

* ``"soft"`` (default) -- :math:`s_j` is estimated with the *current debiased posterior*
  :math:`q_i = \mathrm{softmax}(f(x_i) - \ln\beta^t)` as weights,
  :math:`s_j = \sum_i q_{ij}\, s(x_i) / \sum_i q_{ij}`, and :math:`\beta^{t+1}` is a damped
  Jacobi step towards :math:`\beta = S\beta` (see :func:`_soft_step`). Under Proposition 2's
  model with a balanced test set, :math:`q` at the true
  :math:`\beta^*` is the exact test posterior, so :math:`\mathbb E_q`-weighted means are the
  class-conditional means and :math:`\beta^*` is a fixed point (consistency). :math:`S` is never
  formed: :math:`S\beta = \sum_i s(x_i)\,\big(q_i^\top(\beta \oslash n)\big)` with
  :math:`n_j = \sum_i q_{ij}`, two passes and two reductions per step; no K x K matrix.
* ``"paper"`` -- Algorithm 2 as written: hard pseudo-labels from :math:`f - \ln\beta^t`,
  :math:`S` from the class-wise mean of :math:`s(x)` over each pseudo-class, :math:`\beta` by
  power iteration (Appendix A.6) to :math:`\|\Delta\|_1 < \epsilon`, outer loop until
  :math:`\|\beta^t - \beta^{t-1}\|_1 < \epsilon`. Forms the ``(K, K)`` matrix :math:`S`.
  Where the paper divides 0 by 0 (a class nobody is assigned to) its column is uniform.
* ``"implicit"`` -- :math:`\beta = \frac1N\sum_i s(x_i)` (Eq. 15 on test data; Table 4).
* ``"none"`` -- uniform :math:`\beta` (no debiasing).

With ``labels`` (the paper's *Oracle*), :math:`S` is built once from the true labels and
:math:`\beta = S\beta` is solved exactly (:func:`solve_stationary`).
Every returned :math:`\beta` is floored at ``prior_floor / K`` and renormalised, so
:math:`-\ln\beta` is finite and a class with no posterior mass anywhere cannot
become an absorbing state.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from torch import Tensor

from frolic_tta.streams import LogitSource, ReduceFn, as_source, identity_reduce

BiasMethod = Literal["soft", "paper", "implicit", "none"]
BIAS_METHODS = ("soft", "paper", "implicit", "none")


def _floor(beta: Tensor, prior_floor: float) -> Tensor:
    k = beta.shape[0]
    beta = torch.clamp(beta, min=prior_floor / k)
    return beta / beta.sum()


def _implicit(source: LogitSource, reduce_fn: ReduceFn) -> Tensor:
    total = torch.zeros(source.num_classes + 1, dtype=torch.float64)
    for _, logits in source.chunks():
        total[0] += logits.shape[0]
        total[1:] += torch.softmax(logits, dim=1).sum(0, dtype=torch.float64).cpu()
    total = reduce_fn(total)
    return total[1:] / total[0]


def _hard_class_matrix(
    source: LogitSource, log_beta: Tensor | None, labels: Tensor | None, reduce_fn: ReduceFn
) -> Tensor:
    """``S`` (K, K): column j = mean of s(x) over the samples assigned (or labelled) j."""
    k = source.num_classes
    sums = torch.zeros(k + 1, k, dtype=torch.float64)  # last row: counts
    for start, logits in source.chunks():
        probs = torch.softmax(logits, dim=1).to(torch.float64).cpu()
        if labels is not None:
            assigned = labels[start : start + logits.shape[0]].cpu()
        else:
            shifted = logits if log_beta is None else logits - log_beta.to(logits)
            assigned = shifted.argmax(1).cpu()
        sums[:k].index_add_(1, assigned, probs.t())
        sums[k].index_add_(0, assigned, torch.ones_like(assigned, dtype=torch.float64))
    sums = reduce_fn(sums)
    counts = sums[k]
    columns = torch.where(
        counts > 0, sums[:k] / counts.clamp(min=1.0), torch.full_like(sums[:k], 1.0 / k)
    )
    return columns


def power_iteration(matrix: Tensor, eps: float, max_iter: int = 10_000) -> Tensor:
    """Stationary vector of a column-stochastic ``(K, K)`` matrix (Appendix A.6).

    Starts from the uniform vector and stops when
    :math:`\\|\\beta_t - \\beta_{t-1}\\|_1 < \\epsilon`.
    """
    k = matrix.shape[0]
    beta = torch.full((k,), 1.0 / k, dtype=torch.float64, device=matrix.device)
    for _ in range(max_iter):
        new = matrix @ beta
        new = new / new.sum()
        done = float((new - beta).abs().sum()) < eps
        beta = new
        if done:
            break
    return beta


def solve_stationary(matrix: Tensor) -> Tensor:
    """Exact solution of :math:`\\beta = S\\beta,\\ \\mathbf 1^\\top\\beta = 1` for a
    column-stochastic ``(K, K)`` ``S``: :math:`(S - I + \\mathbf 1\\mathbf 1^\\top)\\beta =
    \\mathbf 1` (LU). Used for the Oracle, where power iteration from uniform stops early
    when :math:`S \\approx I`."""
    k = matrix.shape[0]
    system = matrix - torch.eye(k, dtype=matrix.dtype) + 1.0
    beta = torch.linalg.solve(system, torch.ones(k, dtype=matrix.dtype))
    return beta.clamp(min=0.0) / beta.clamp(min=0.0).sum()


def _soft_step(source: LogitSource, beta: Tensor, reduce_fn: ReduceFn) -> Tensor:
    """One damped Jacobi step towards :math:`\\beta = S(\\beta)\\beta` (soft method).

    With :math:`d_k = S_{kk}`, the Jacobi update :math:`\\beta_k \\leftarrow ((S\\beta)_k -
    d_k\\beta_k)/(1 - d_k)` removes the self-loop that makes power iteration crawl when
    :math:`S \\approx I` (well separated classes); averaging with the current iterate removes
    the period-2 oscillation of the Jacobi map. Its fixed point is :math:`\\beta = S\\beta`.
    Two passes, two reductions.
    """
    log_beta = torch.log(beta)
    mass = torch.zeros_like(beta)
    for _, logits in source.chunks():
        debiased = torch.softmax(logits - log_beta.to(logits), dim=1)
        mass += debiased.sum(0, dtype=torch.float64).cpu()
    mass = reduce_fn(mass)
    k = beta.shape[0]
    occupied = mass > 0
    safe_mass = torch.where(occupied, mass, torch.ones_like(mass))
    ratio = torch.where(occupied, beta / safe_mass, 0.0)
    sums = torch.zeros(2, k, dtype=torch.float64)  # rows: S beta, diag(S) * n
    for _, logits in source.chunks():
        probs = torch.softmax(logits, dim=1)
        debiased = torch.softmax(logits - log_beta.to(logits), dim=1)
        weight = debiased @ ratio.to(debiased)
        sums[0] += (probs * weight[:, None]).sum(0, dtype=torch.float64).cpu()
        sums[1] += (probs * debiased).sum(0, dtype=torch.float64).cpu()
    sums = reduce_fn(sums)
    # Columns of empty pseudo-classes are uniform: they send beta_j / K to every class.
    uniform_share = float(beta[~occupied].sum()) / k
    product = sums[0] + uniform_share
    diagonal = torch.where(occupied, sums[1] / safe_mass, 1.0 / k)
    off_diagonal = 1.0 - diagonal
    movable = off_diagonal > 1e-12
    jacobi = torch.where(
        movable, (product - diagonal * beta) / torch.where(movable, off_diagonal, 1.0), beta
    ).clamp(min=0.0)
    jacobi = jacobi / jacobi.sum()
    return 0.5 * (beta + jacobi)


def estimate_label_bias(
    logits: Tensor | LogitSource,
    *,
    eps: float = 0.01,
    method: BiasMethod = "soft",
    labels: Tensor | None = None,
    max_iter: int = 200,
    prior_floor: float = 1e-6,
    reduce_fn: ReduceFn | None = None,
) -> Tensor:
    r"""Estimate the label prior :math:`\hat\beta` of a model from unlabeled data (Algorithm 2).

    Args:
        logits: ``(N, K)`` logits :math:`f` whose softmax is the biased posterior (for Frolic,
            the fused :math:`f_f`), or a :class:`LogitSource` over the local shard.
        eps: tolerance :math:`\epsilon`: ``"paper"`` stops at :math:`\|\beta^t -
            \beta^{t-1}\|_1 < \epsilon` (Eq. 16); ``"soft"`` stops when the estimated L1
            distance to the fixed point, :math:`\|\Delta^t\|_1\, r/(1-r)` with :math:`r` the
            observed contraction rate, is below :math:`\epsilon`.
        method: ``"soft"`` (default), ``"paper"``, ``"implicit"`` or ``"none"``.
        labels: ``(N,)`` true labels of the local shard: builds :math:`S` from them (Oracle).
        max_iter: cap on outer iterations (each a fixed number of ``reduce_fn`` calls).
        prior_floor: :math:`\beta_j \ge` ``prior_floor`` / K.
        reduce_fn: sums a tensor over shards (identity by default).

    Returns:
        ``(K,)`` float64, positive, sums to 1.
    """
    if method not in BIAS_METHODS:
        raise ValueError(f"Expected `method` to be one of {BIAS_METHODS}, but got {method!r}")
    if not eps > 0:
        raise ValueError(f"Expected `eps` > 0, but got {eps}")
    reduce_fn = reduce_fn or identity_reduce
    source = as_source(logits)
    k = source.num_classes
    if k < 2:
        raise ValueError(f"Expected at least 2 classes, but got K={k}")
    if labels is not None:
        labels = torch.as_tensor(labels).long()
        if labels.shape != (source.num_samples,):
            raise ValueError(
                f"Expected `labels` of shape ({source.num_samples},), but got {tuple(labels.shape)}"
            )
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= k):
            raise ValueError(f"Expected `labels` in [0, {k - 1}], but got values outside")
        matrix = _hard_class_matrix(source, None, labels, reduce_fn)
        return _floor(solve_stationary(matrix), prior_floor)
    if method == "none":
        return torch.full((k,), 1.0 / k, dtype=torch.float64)
    if method == "implicit":
        return _floor(_implicit(source, reduce_fn), prior_floor)

    beta = torch.full((k,), 1.0 / k, dtype=torch.float64)
    previous_change = None
    for _ in range(max_iter):
        if method == "paper":
            matrix = _hard_class_matrix(source, torch.log(beta), None, reduce_fn)
            new = _floor(power_iteration(matrix, eps), prior_floor)
        else:
            new = _floor(_soft_step(source, beta, reduce_fn), prior_floor)
        change = float((new - beta).abs().sum())
        beta = new
        if method == "paper":
            if change < eps:  # Algorithm 2, line 9
                return beta
            continue
        # soft: stop on the estimated distance to the fixed point, change * r / (1 - r), with
        # r the observed contraction rate; ||delta||_1 < eps alone stops far too early when
        # the iteration contracts slowly (well separated classes).
        rate = change / previous_change if previous_change else 1.0
        previous_change = change
        if change == 0.0 or (rate < 1.0 and change * rate / (1.0 - rate) < eps):
            return beta
    warnings.warn(
        f"estimate_label_bias(method={method!r}) stopped after max_iter={max_iter} iterations "
        f"before reaching eps={eps} (last ||beta^t - beta^(t-1)||_1 = {change:.3g})",
        UserWarning,
        stacklevel=2,
    )
    return beta
