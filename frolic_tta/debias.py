r"""Label-free estimation of the pre-training label prior :math:`\beta` (paper Section 3.4).

With :math:`s(x) = \mathrm{softmax}(f(x))` the model's posterior and
:math:`s_j = \mathbb E[s(x)\mid Y=j]`, Proposition 2 gives :math:`\beta = S\beta` (Eq. 14) for
:math:`S = [s_1, \dots, s_K]`; debiased logits are :math:`f - \ln\beta` (Eq. 13).

Methods (``method=``):

* ``"soft"`` (default) -- :math:`s_j` is estimated with the *current debiased posterior*
  :math:`q_i = \mathrm{softmax}(f(x_i) - \ln\beta + \ln\pi)` as weights instead of argmax,
  :math:`s_j = \sum_i q_{ij}\, s(x_i) / \sum_i q_{ij}`, and :math:`\beta = S(\beta)\beta`.
  Under Proposition 2's model, :math:`q` at the true :math:`\beta^*` is the exact test
  posterior, so the weighted means are the class-conditional means and :math:`\beta^*` is a
  fixed point (consistency). With :math:`r_i = \sum_k s_{ik}/\beta_k` and
  :math:`n_j = \sum_i q_{ij}`, :math:`(S\beta)_k = \sum_i s_{ik}\,(\sum_j s_{ij}\beta_j/n_j)/r_i`,
  which equals :math:`\beta_k` where :math:`n_j = N\pi_j`: **the fixed point is where the
  debiased class masses equal the test prior** :math:`\pi` (``target``; uniform by default,
  the paper's balanced test set). That is a convex problem, solved by Newton passes in
  :func:`frolic_tta.matching.match_class_masses` (no K x K matrix; iterating :math:`S\beta`
  itself needs hundreds of passes when :math:`S \approx I`), with :math:`\ln\hat\beta` kept
  in a box (``bound``) where the data do not determine it.
* ``"paper"`` -- Algorithm 2 as written: hard pseudo-labels from :math:`f - \ln\beta^t`,
  :math:`S` from the class-wise mean of :math:`s(x)` over each pseudo-class, :math:`\beta` by
  power iteration (Appendix A.6) to :math:`\|\Delta\|_1 < \epsilon`, outer loop until
  :math:`\|\beta^t - \beta^{t-1}\|_1 < \epsilon`. Forms the ``(K, K)`` matrix :math:`S`.
  Where the paper divides 0 by 0 (a class nobody is assigned to) its column is uniform.
* ``"implicit"`` -- :math:`\beta = \frac1N\sum_i s(x_i)` (Eq. 15 on test data; Table 4).
* ``"none"`` -- uniform :math:`\beta` (no debiasing).
* ``"released"`` -- the authors' script: ``max_iter`` rounds of power iteration on
  margin-filtered hard labels (:func:`frolic_tta.released.released_label_bias`).

With ``labels`` (the paper's *Oracle*) the class masses are matched to the true label
frequencies: the cross-entropy-optimal prior of the debiased logits (GLA's supervised
estimate), consistent under Proposition 2 like :math:`\beta = S\beta` with :math:`S` from
labels, but well posed when :math:`S \approx I` (confident posteriors), where solving
:math:`\beta = S\beta` exactly is ill-conditioned.
Every returned :math:`\beta` is floored at ``prior_floor / K`` and renormalised, so
:math:`-\ln\beta` is finite and a class with no posterior mass anywhere cannot
become an absorbing state.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from frolic_tta.errors import warn
from frolic_tta.logits import LogitSource, ReduceFn, as_source, identity_reduce
from frolic_tta.matching import MassMatch, floored, match_class_masses
from frolic_tta.options import BIAS_METHODS, BiasMethod, check_choice, check_positive
from frolic_tta.released import released_label_bias
from frolic_tta.validation import check_shards_together


def _implicit(source: LogitSource, reduce_fn: ReduceFn) -> Tensor:
    total = torch.zeros(source.num_classes + 1, dtype=torch.float64)
    for _, logits in source.chunks():
        total[0] += logits.shape[0]
        total[1:] += torch.softmax(logits, dim=1).sum(0).double().cpu()
    total = reduce_fn(total)
    return total[1:] / total[0]


def _hard_class_matrix(source: LogitSource, log_beta: Tensor, reduce_fn: ReduceFn) -> Tensor:
    """``S`` (K, K): column j = mean of s(x) over the samples assigned j by
    ``argmax(f - log_beta)`` (Algorithm 2's hard pseudo-labels)."""
    k = source.num_classes
    sums = torch.zeros(k + 1, k, dtype=torch.float64)  # last row: counts
    for _, logits in source.chunks():
        probs = torch.softmax(logits, dim=1).to(torch.float64).cpu()
        assigned = (logits - log_beta.to(logits)).argmax(1).cpu()
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


def check_labels(labels: Tensor, num_samples: int, num_classes: int) -> Tensor:
    """``labels`` as a long tensor after checking shape, integer dtype and range.

    Raises:
        ValueError: wrong shape, non-integer dtype, or a value outside ``[0, K)``.
    """
    labels = torch.as_tensor(labels)
    if labels.shape != (num_samples,):
        raise ValueError(
            f"Expected `labels` of shape ({num_samples},), but got {tuple(labels.shape)}"
        )
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"Expected integer `labels`, but got dtype {labels.dtype}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(
            f"Expected `labels` in [0, {num_classes - 1}], but got values in "
            f"[{int(labels.min())}, {int(labels.max())}]"
        )
    return labels.long()


def label_frequencies(labels: Tensor, num_classes: int, reduce_fn: ReduceFn) -> Tensor:
    """``(K,)`` frequencies of ``labels`` over all shards (float64, sums to 1)."""
    counts = torch.bincount(labels.cpu(), minlength=num_classes).to(torch.float64)
    counts = reduce_fn(counts)
    return counts / counts.sum().clamp(min=1.0)


def _uniform_result(beta: Tensor, target: Tensor, converged: bool, passes: int) -> MassMatch:
    k = beta.shape[0]
    floor = torch.finfo(torch.float64).tiny
    return MassMatch(
        beta=beta,
        log_offset=torch.log(target.clamp(min=floor)) - torch.log(beta),
        undetermined=torch.zeros(k, dtype=torch.bool),
        mass_error=float("nan"),
        converged=converged,
        evaluations=passes,
    )


def fit_label_bias(
    logits: Tensor | LogitSource,
    *,
    method: BiasMethod = "soft",
    target: Tensor | None = None,
    bound: float | None = None,
    labels: Tensor | None = None,
    eps: float = 0.01,
    max_iter: int = 100,
    prior_floor: float = 1e-30,
    reduce_fn: ReduceFn | None = None,
    name: str = "the label bias beta-hat",
    init: Tensor | None = None,
    spare: Tensor | None = None,
) -> MassMatch:
    r""":func:`estimate_label_bias` with its diagnostics (:class:`~frolic_tta.matching.MassMatch`:
    :math:`\hat\beta`, the logit offset, undetermined classes, convergence).

    ``target`` (the test prior :math:`\pi`, default uniform) and ``bound`` (half the largest
    :math:`\ln(\max\hat\beta/\min\hat\beta)`) apply to ``"soft"`` and the Oracle;
    the other methods ignore them but still return ``log_offset``
    :math:`= \ln\pi - \ln\hat\beta`. Warns when the loop does not converge or when the data
    leave some :math:`\hat\beta_j` undetermined; ``name`` says which :math:`\hat\beta` in the
    warning (:data:`FUSED_BETA`, :data:`ZERO_SHOT_BETA`). ``init``: a :math:`\hat\beta` the
    soft matching starts from (a warm start; the other methods ignore it). ``spare``: an
    ``(N_local, K)`` buffer the soft matching may overwrite
    (:func:`~frolic_tta.matching.match_class_masses`).
    """
    check_choice("method", method, BIAS_METHODS)
    check_positive("eps", eps)
    floor = check_positive("prior_floor", prior_floor)
    if floor >= 1.0:
        raise ValueError(f"Expected `prior_floor` < 1, but got {prior_floor!r}")
    if bound is not None:
        check_positive("bound", bound)
    if reduce_fn is not None:  # values decided over all shards: every shard raises or none
        check_shards_together(reduce_fn, [("logits", logits)], labels=labels)
    reduce_fn = reduce_fn or identity_reduce
    source = as_source(logits)
    k = source.num_classes
    if k < 2:
        raise ValueError(f"Expected at least 2 classes, but got K={k}")
    uniform = torch.full((k,), 1.0 / k, dtype=torch.float64)
    if target is None:
        target = uniform
    elif target.shape != (k,) or not bool(torch.isfinite(target).all()) or bool((target < 0).any()):
        raise ValueError(f"Expected `target` of shape ({k},) with finite values >= 0")
    target = (target / target.sum()).to(torch.float64).cpu()
    if labels is not None:  # the Oracle: masses equal to the true label frequencies
        labels = check_labels(labels, source.num_samples, k)
        target = label_frequencies(labels, k, reduce_fn)
    solve = _SOLVERS["soft" if labels is not None else method]
    limits = {"eps": eps, "max_iter": max_iter, "prior_floor": prior_floor}
    kwargs = {"bound": bound, "reduce_fn": reduce_fn, "name": name, "init": init, "spare": spare}
    return solve(source, target, **kwargs, **limits)


def _solve_none(source: LogitSource, target: Tensor, **_: object) -> MassMatch:
    r"""``"none"``: a uniform :math:`\hat\beta` (no debiasing)."""
    k = source.num_classes
    return _uniform_result(torch.full((k,), 1.0 / k, dtype=torch.float64), target, True, 0)


def _solve_implicit(
    source: LogitSource, target: Tensor, *, prior_floor: float, reduce_fn: ReduceFn, **_: object
) -> MassMatch:
    """``"implicit"``: the mean posterior (Eq. 15 on test data)."""
    beta = floored(_implicit(source, reduce_fn), prior_floor)
    return _uniform_result(beta, target, True, 1)


def _solve_released(
    source: LogitSource,
    target: Tensor,
    *,
    eps: float,
    max_iter: int,
    reduce_fn: ReduceFn,
    **_: object,
) -> MassMatch:
    """``"released"``: the authors' script (its own floor, no stopping test)."""
    beta = released_label_bias(source, rounds=max_iter, eps=eps, reduce_fn=reduce_fn)
    return _uniform_result(beta, target, True, max_iter)


def _solve_soft(
    source: LogitSource, target: Tensor, *, name: str, **solver: Any
) -> MassMatch:
    """``"soft"`` and the Oracle: the debiased class masses matched to ``target``
    (``solver``: :func:`~frolic_tta.matching.match_class_masses`' keywords)."""
    result = match_class_masses(source, target, **solver)
    warn_about_match(result, source.num_classes, solver["max_iter"], solver["eps"], name)
    return result


def _solve_paper(
    source: LogitSource,
    target: Tensor,
    *,
    eps: float,
    max_iter: int,
    prior_floor: float,
    reduce_fn: ReduceFn,
    **_: object,
) -> MassMatch:
    """``"paper"``: Algorithm 2 as written (hard labels, power iteration, outer loop)."""
    k = source.num_classes
    beta = torch.full((k,), 1.0 / k, dtype=torch.float64)
    for passes in range(1, max_iter + 1):
        matrix = _hard_class_matrix(source, torch.log(beta), reduce_fn)
        new = floored(power_iteration(matrix, eps), prior_floor)
        change = float((new - beta).abs().sum())
        beta = new
        if change < eps:  # Algorithm 2, line 9
            return _uniform_result(beta, target, True, passes)
    warn(
        f"estimate_label_bias(method='paper') stopped after max_iter={max_iter} iterations "
        f"before reaching eps={eps} (last ||beta^t - beta^(t-1)||_1 = {change:.3g})",
    )
    return _uniform_result(beta, target, False, max_iter)


_SOLVERS = {
    "none": _solve_none,
    "implicit": _solve_implicit,
    "released": _solve_released,
    "soft": _solve_soft,
    "paper": _solve_paper,
}
"""One private solver per ``method`` behind :func:`fit_label_bias`, the one entry point (as
scikit-learn's ``LinearDiscriminantAnalysis`` hands each solver to ``_solve_*``)."""


FUSED_BETA = "beta-hat of f_f (the label bias that f_d removes)"
"""``name`` of the fused classifier's beta-hat in the warnings."""
ZERO_SHOT_BETA = "beta-hat of f_c (the zero-shot model's pre-training prior)"
"""``name`` of the zero-shot classifier's beta-hat in the warnings."""


def warn_about_match(
    result: MassMatch, k: int, max_iter: int, eps: float, name: str = "the label bias beta-hat"
) -> None:
    """Warn when the matching of ``name`` stopped at ``max_iter`` or left classes undetermined."""
    if not result.converged:
        warn(
            f"estimate_label_bias(method='soft') of {name} stopped after max_iter={max_iter} "
            f"passes before reaching eps={eps} (class-mass error {result.mass_error:.3g})",
        )
    undetermined = int(result.undetermined.sum())
    if undetermined:
        warn(
            f"the data do not determine {name} in {undetermined} of {k} classes (hard "
            "posteriors or no samples: moving their logits hardly changes any class mass); "
            "there it is at the bound or arbitrary",
        )


def estimate_label_bias(
    logits: Tensor | LogitSource,
    *,
    eps: float = 0.01,
    method: BiasMethod = "soft",
    labels: Tensor | None = None,
    target: Tensor | None = None,
    bound: float | None = None,
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
            the target in L1.
        method: ``"soft"`` (default), ``"paper"``, ``"implicit"`` or ``"none"``.
        labels: ``(N,)`` true labels of the local shard (integers): the Oracle, whose debiased
            class masses equal the true label frequencies (the cross-entropy-optimal prior;
            well posed even when :math:`S \approx I`).
        target: ``(K,)`` test prior :math:`\pi` the debiased class masses should match
            (``"soft"``; default uniform, Proposition 2's balanced test set).
        bound: half the largest :math:`\ln(\max\hat\beta/\min\hat\beta)` (``"soft"``;
            ``None``: set by ``prior_floor``), see :mod:`frolic_tta.matching`.
        max_iter: cap on iterations (Newton passes for ``"soft"``, outer loops for ``"paper"``;
            each a fixed number of ``reduce_fn`` calls).
        prior_floor: :math:`\beta_j \ge` ``prior_floor`` / K.
        reduce_fn: sums a tensor over shards (identity by default).

    Returns:
        ``(K,)`` float64, positive, sums to 1.
    """
    limits = {"eps": eps, "max_iter": max_iter, "prior_floor": prior_floor}
    return fit_label_bias(
        logits, method=method, target=target, bound=bound, labels=labels, reduce_fn=reduce_fn,
        **limits,
    ).beta  # fmt: skip
