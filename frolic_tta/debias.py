r"""Label-free estimation of the pre-training label prior :math:`\beta` (paper Section 3.4).

With :math:`s(x) = \mathrm{softmax}(f(x))` the model's posterior and
:math:`s_j = \mathbb E[s(x)\mid Y=j]`, Proposition 2 gives :math:`\beta = S\beta` (Eq. 14) for
:math:`S = [s_1, \dots, s_K]`; debiased logits are :math:`f - \ln\beta` (Eq. 13).

Methods (``method=``):

* ``"soft"`` (default) -- :math:`s_j` is estimated with the *current debiased posterior*
  :math:`q_i = \mathrm{softmax}(f(x_i) - \ln\beta)` as weights instead of argmax,
  :math:`s_j = \sum_i q_{ij}\, s(x_i) / \sum_i q_{ij}`, and :math:`\beta = S(\beta)\beta`.
  Under Proposition 2's model with a balanced test set, :math:`q` at the true :math:`\beta^*` is
  the exact test posterior, so the weighted means are the class-conditional means and
  :math:`\beta^*` is a fixed point (consistency). With :math:`r_i = \sum_k s_{ik}/\beta_k` and
  :math:`n_j = \sum_i q_{ij}`, :math:`(S\beta)_k = \sum_i s_{ik}\,(\sum_j s_{ij}\beta_j/n_j)/r_i`;
  where every :math:`n_j = N/K` this is :math:`\beta_k\sum_i q_{ik} \cdot K/N = \beta_k`, so
  **the fixed point is where the debiased class masses are uniform**, the stationary point of
  the convex :math:`L(\gamma) = \sum_i \operatorname{lse}(f(x_i) + \gamma) - \frac NK
  \mathbf 1^\top\gamma` with :math:`\gamma = -\ln\beta` (:math:`\nabla L = n - N/K`).
  We minimise it by Newton steps preconditioned with the diagonal curvature
  :math:`h_j = \sum_i q_{ij}(1 - q_{ij})` and Armijo backtracking on :math:`L` (convex, so this
  converges): one pass and one reduction per trial point, no K x K matrix, typically 5-30
  passes (iterating :math:`S\beta` itself needs hundreds when :math:`S \approx I`).
  It stops when :math:`\|\beta^t - \beta^{t-1}\|_1 < \epsilon` and the masses are within
  :math:`\epsilon` of uniform, :math:`\|n/N - \mathbf 1/K\|_1 < \epsilon`.
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

import torch
from torch import Tensor

from frolic_tta.logits import LogitSource, ReduceFn, as_source, identity_reduce
from frolic_tta.options import BIAS_METHODS, BiasMethod, check_choice, check_positive


def _floor(beta: Tensor, prior_floor: float) -> Tensor:
    k = beta.shape[0]
    beta = torch.clamp(beta, min=prior_floor / k)
    return beta / beta.sum()


def _implicit(source: LogitSource, reduce_fn: ReduceFn) -> Tensor:
    total = torch.zeros(source.num_classes + 1, dtype=torch.float64)
    for _, logits in source.chunks():
        total[0] += logits.shape[0]
        total[1:] += torch.softmax(logits, dim=1).sum(0).double().cpu()
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
    r"""Stationary vector of a column-stochastic ``(K, K)`` matrix (Appendix A.6).

    Starts from the uniform vector and stops when
    :math:`\|\beta_t - \beta_{t-1}\|_1 < \epsilon`.
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
    r"""Exact solution of :math:`\beta = S\beta,\ \mathbf 1^\top\beta = 1` for a
    column-stochastic ``(K, K)`` ``S``: :math:`(S - I + \mathbf 1\mathbf 1^\top)\beta =
    \mathbf 1` (LU). Used for the Oracle, where power iteration from uniform stops early
    when :math:`S \approx I`."""
    k = matrix.shape[0]
    system = matrix - torch.eye(k, dtype=matrix.dtype) + 1.0
    beta, info = torch.linalg.solve_ex(system, torch.ones(k, dtype=matrix.dtype))
    beta = beta.clamp(min=0.0)
    if int(info) != 0 or not bool(torch.isfinite(beta).all()) or float(beta.sum()) <= 0:
        # eigenvalue 1 is not simple (e.g. S = I for hard posteriors): beta = S beta has many
        # solutions; power iteration picks the one reached from uniform
        return power_iteration(matrix, 1e-12)
    return beta / beta.sum()


def _newton_sums(source: LogitSource, gamma: Tensor) -> Tensor:
    """``[N, sum_i lse(f_i + gamma), n_1..n_K, h_1..h_K]`` of the local shard (float64).

    One exponential per entry; column sums in the logits' dtype, accumulated in float64.
    """
    k = gamma.shape[0]
    total = torch.zeros(2 * k + 2, dtype=torch.float64)
    for _, logits in source.chunks():
        shifted = logits + gamma.to(logits)
        top = shifted.max(dim=1, keepdim=True).values
        debiased = torch.exp_(shifted - top)
        norm = debiased.sum(dim=1, keepdim=True)
        debiased.div_(norm)
        total[0] += logits.shape[0]
        total[1] += float((top + norm.log()).sum(dtype=torch.float64))
        mass = debiased.sum(0)
        total[2 : k + 2] += mass.double().cpu()
        total[k + 2 :] += (mass - debiased.square_().sum(0)).double().cpu()
    return total


def _soft_newton(
    source: LogitSource, eps: float, max_iter: int, prior_floor: float, reduce_fn: ReduceFn
) -> tuple[Tensor, bool]:
    r"""Minimise :math:`L(\gamma)/N` (module docstring) by diagonally preconditioned Newton
    steps with Armijo backtracking; ``(beta, converged)``. Each trial point costs one pass and
    one ``reduce_fn`` call; accept/reject decisions use reduced values only."""
    k = source.num_classes
    ceiling = float(torch.log(torch.tensor(k / prior_floor)))  # keeps beta_j >= prior_floor / K
    limit = torch.tensor(ceiling, dtype=torch.float64)

    def evaluate(gamma: Tensor) -> tuple[float, Tensor, Tensor]:
        sums = reduce_fn(_newton_sums(source, gamma))
        n = float(sums[0])
        objective = float(sums[1]) / n - float(gamma.sum()) / k
        return objective, sums[2 : k + 2] / n - 1.0 / k, sums[k + 2 :] / n

    gamma = torch.zeros(k, dtype=torch.float64)
    objective, gradient, curvature = evaluate(gamma)
    beta = torch.full((k,), 1.0 / k, dtype=torch.float64)
    step_size, evaluations = 1.0, 1
    while evaluations < max_iter:
        direction = (gradient / curvature.clamp(min=1e-12)).clamp(-10.0, 10.0)
        trial = gamma - step_size * direction
        trial = torch.minimum(trial - trial.min(), limit)
        trial_objective, trial_gradient, trial_curvature = evaluate(trial)
        evaluations += 1
        decrease = 1e-4 * float((gradient * (gamma - trial)).sum())  # Armijo, <= 0
        if trial_objective > objective - abs(decrease) and step_size > 1e-6:
            step_size *= 0.5  # reject: retry a shorter step from the same point
            continue
        gamma, objective, gradient, curvature = (
            trial,
            trial_objective,
            trial_gradient,
            trial_curvature,
        )
        step_size = min(1.0, 2.0 * step_size)
        new = _floor(torch.softmax(-gamma, 0), prior_floor)
        change = float((new - beta).abs().sum())
        beta = new
        if change < eps and float(gradient.abs().sum()) < eps:
            return beta, True
        if change == 0.0:  # stalled at the floor: some class cannot reach 1/K of the mass
            warnings.warn(
                "estimate_label_bias(method='soft'): the debiased class masses cannot be made "
                f"uniform within prior_floor={prior_floor} (L1 imbalance "
                f"{float(gradient.abs().sum()):.3g}); a class has (almost) no posterior mass, "
                "or the posteriors are hard. Returning the closest prior.",
                UserWarning,
                stacklevel=3,
            )
            return beta, True
    return beta, False


def estimate_label_bias(
    logits: Tensor | LogitSource,
    *,
    eps: float = 0.01,
    method: BiasMethod = "soft",
    labels: Tensor | None = None,
    max_iter: int = 100,
    prior_floor: float = 1e-30,
    reduce_fn: ReduceFn | None = None,
) -> Tensor:
    r"""Estimate the label prior :math:`\hat\beta` of a model from unlabeled data (Algorithm 2).

    Args:
        logits: ``(N, K)`` logits :math:`f` whose softmax is the biased posterior (for Frolic,
            the fused :math:`f_f`), or a :class:`LogitSource` over the local shard.
        eps: tolerance :math:`\epsilon` on :math:`\|\beta^t - \beta^{t-1}\|_1` (Eq. 16);
            ``"soft"`` also requires the debiased class masses within :math:`\epsilon` of
            uniform in L1.
        method: ``"soft"`` (default), ``"paper"``, ``"implicit"`` or ``"none"``.
        labels: ``(N,)`` true labels of the local shard: builds :math:`S` from them (Oracle).
        max_iter: cap on iterations (Newton steps for ``"soft"``, outer loops for ``"paper"``;
            each a fixed number of ``reduce_fn`` calls).
        prior_floor: :math:`\beta_j \ge` ``prior_floor`` / K.
        reduce_fn: sums a tensor over shards (identity by default).

    Returns:
        ``(K,)`` float64, positive, sums to 1.
    """
    check_choice("method", method, BIAS_METHODS)
    check_positive("eps", eps)
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

    if method == "soft":
        beta, converged = _soft_newton(source, eps, max_iter, prior_floor, reduce_fn)
        if converged:
            return beta
        change = float("nan")  # not tracked outside the Newton loop
    else:
        beta = torch.full((k,), 1.0 / k, dtype=torch.float64)
        for _ in range(max_iter):
            matrix = _hard_class_matrix(source, torch.log(beta), None, reduce_fn)
            new = _floor(power_iteration(matrix, eps), prior_floor)
            change = float((new - beta).abs().sum())
            beta = new
            if change < eps:  # Algorithm 2, line 9
                return beta
    warnings.warn(
        f"estimate_label_bias(method={method!r}) stopped after max_iter={max_iter} iterations "
        f"before reaching eps={eps}"
        + ("" if change != change else f" (last ||beta^t - beta^(t-1)||_1 = {change:.3g})"),
        UserWarning,
        stacklevel=2,
    )
    return beta
