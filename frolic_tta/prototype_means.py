r"""The Gaussian head's class means, tested against the text prototypes (``head_means="tested"``).

The head's class means :math:`\hat\mu_j` (weighted by soft labels) are noisy: with
:math:`n_j` samples of class j each carries :math:`\Sigma/n_j` of sampling noise, K r numbers
in all (r the rank of the data's span). Where the text prototypes already point at the class
means (issue 35, item 1: worlds whose prototypes *are* the means), the head is a noisy copy of
:math:`f_c` and the fusion keeps half of that noise (f_g 1.3-2.0 pt under f_c). The images can
tell whether that is the case: under the hypothesis

.. math::
    H_0:\ \mu_j = c + a z_j\quad (a > 0;\ \text{the prototypes up to the modality gap } c
    \text{ and a scale } a),

fitted by weighted least squares in :math:`\hat\Sigma^{-1}` (weights :math:`n_j`), the residuals
:math:`r_j = \hat\mu_j - \hat c - \hat a z_j` give

.. math::
    T = \sum_j n_j\, r_j^\top \hat\Sigma^{-1} r_j \sim \chi^2_\nu,\quad
    \nu = (K' - 1) r - 1

(:math:`K'` classes with samples), all on the data's span (Proposition 2's features end in a
constant). Where neither tail rejects it at 0.1 % (Wilson-Hilferty's normal approximation of
:math:`\chi^2_\nu`, :math:`|z| \le 3.09`; on effective counts where needed, below), the head
keeps :math:`\hat\Sigma` and takes the fitted means :math:`\hat c + \hat a z_j` (every class,
those without samples included): Eq. 9 on the prototypes' directions through
:math:`\hat\Sigma^{-1}`, the Bayes classifier of a Gaussian world whose means are the prototypes
and whose covariance is not isotropic (``accuracy.py``'s ``paper_world``), where :math:`f_c`
alone is not. It is the paper's own model (Section 3.1: :math:`\mathcal N(z_j, \Sigma)`,
:math:`w_j = \hat\Sigma^{-1} z_j`), with the modality gap and a scale, taken only where the
images do not reject it. Elsewhere the sample means stay. A preliminary test, like the test
prior's (:mod:`frolic_tta.evidence`): James-Stein's partial shrinkage towards :math:`H_0` cost
0.4-0.8 pt on the CLIP-like worlds of ``benchmarks/label_shift.py --quick``, where the sample
means are far better than the prototypes (z 25 and more), because it minimises the squared error
of the means, not the classifier's. The lower tail rejects too: means closer together than their
sampling noise say that the soft labels are too blurred for the means to be independent
estimates (a random encoder's features, ``tests/data/encoder_world.pt``: z = -19.4, where the
prototypes' image took f_d from 0.296 to 0.145), not that the prototypes are right.

**Which counts.** A soft mean is a weighted mean: its noise is
:math:`\hat\Sigma\sum_i q_{ij}^2/n_j^2 = \hat\Sigma/n^{\text{eff}}_j`, Kish's effective count
:math:`n^{\text{eff}}_j = n_j^2/\sum_i q_{ij}^2 \ge n_j` (every :math:`q_{ij} \le 1`). With the
soft counts :math:`n_j`, :math:`T` is a lower bound of the effective counts' (a minimum over
:math:`c, a` of a sum with smaller weights): its lower tail rejects where :math:`H_0` holds and
the labels are soft (on ``benchmarks/no_harm_sweep.py``'s K = 100 means worlds z ran from -21
to -6, the sample means stayed, and f_d was 0.24-0.37 pt under f_c on average over 20 seeds),
and its upper tail rejects less often than the level says. So where the soft counts' z is under
-3.09 the effective counts' z decides (:func:`~frolic_tta.soft_sums.posterior_squares`, one
pass; it is the z reported); elsewhere the soft counts' z does, whose lower tail cannot reject
there and whose upper tail is conservative. The effective counts everywhere would reject the
README's world at N = 800 on two seeds of ten (z 19 against 1.9 and 2.6), where the prototypes'
image beats the sample means of 40 samples per class (f_g 2.4 and 1.8 pt): a calibrated test is
not the classifier's risk (``benchmarks/prototype_counts.py``).

**The scale.** :math:`H_0` with :math:`a = 0` says that all class means are equal: no class
structure along the prototypes, where their image :math:`\hat c + \hat a z_j` is a head of
noise. So :math:`\hat a` must also be significantly positive, :math:`t = \hat a/\mathrm{se}(\hat
a) > 3.09` on the counts that decided (:func:`prototype_statistic`). On the suite's tiny
random-weight open_clip model (``tests/test_module.py``'s bf16 run, 101 images) the effective
counts' z is 1.5 and t 1.9-2.0: without the scale's test the head took the prototypes' image, and
bf16 and float32 features then agreed on 77 % of predictions. The random encoder above has
t = 1.9; the means worlds of ``benchmarks/no_harm_sweep.py`` 78-374 (20 seeds).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import Tensor

from frolic_tta.gda import GaussianHead, MomentSums

LEVEL = 3.09
r"""One-sided 0.1 % point of the standard normal: :math:`H_0` is kept where :math:`|z| \le` it
and the scale's :math:`t >` it."""


def prototype_statistic(
    means: Tensor, covariance: Tensor, counts: Tensor, prototypes: Tensor, span: Tensor | None
) -> tuple[Tensor, float, float, float]:
    r"""Fit :math:`H_0` (module docstring) to class ``means`` ``(K, d)`` with ``covariance``
    ``(d, d)``, soft ``counts`` ``(K,)`` and ``prototypes`` ``(K, d)`` (float64), on ``span``
    ``(d, r)`` (``None``: all of :math:`\mathbb R^d`).

    Returns:
        ``(fitted means (K, d), z, a, t)``: :math:`\hat c + \hat a z_j` in the full space, the
        Wilson-Hilferty statistic of :math:`T` (``nan`` where :math:`\nu < 1` or the
        covariance is singular on the span), :math:`\hat a` and its standardised value
        :math:`t = \hat a \sqrt{\sum_j n_j \tilde z_j^\top \hat\Sigma^{-1} \tilde z_j}`
        (:math:`\tilde z_j` the prototypes centred at their weighted mean; the weighted least
        squares variance of :math:`\hat a` is the inverse of that sum).
    """
    if span is not None:
        m, z, sigma = means @ span, prototypes @ span, span.t() @ covariance @ span
    else:
        m, z, sigma = means, prototypes, covariance
    factor, info = torch.linalg.cholesky_ex(sigma)
    keep = counts > 0
    dof = (int(keep.sum()) - 1) * m.shape[1] - 1
    if int(info) != 0 or dof < 1:
        return means, math.nan, math.nan, math.nan
    w = counts / counts.sum()
    z_c, m_c = z - w @ z, m - w @ m
    solved = torch.cholesky_solve(z_c.t(), factor).t()
    spread = float((w * (solved * z_c).sum(1)).sum())
    if not spread > 0.0:  # every class's prototype alike: no direction to test
        return means, math.nan, math.nan, math.nan
    a = float((w * (solved * m_c).sum(1)).sum()) / spread
    residual = m_c - a * z_c  # (K, r)
    distance = (residual * torch.cholesky_solve(residual.t(), factor).t()).sum(1)
    statistic = float((counts * distance)[keep].sum())
    scale = 2.0 / (9.0 * dof)  # Wilson-Hilferty: (T / nu)^(1/3) ~ N(1 - scale, scale)
    z_value = ((statistic / dof) ** (1.0 / 3.0) - (1.0 - scale)) / math.sqrt(scale)
    fitted = means - (residual if span is None else residual @ span.t())
    return fitted, z_value, a, a * math.sqrt(float(counts.sum()) * spread)


def tested_means(
    head: GaussianHead,
    prototypes: Tensor,
    sums: MomentSums,
    span: Tensor | None,
    squares: Callable[[], Tensor] | None = None,
) -> tuple[GaussianHead, float]:
    r"""``head`` with its means replaced by :math:`\hat c + \hat a z_j` where :math:`H_0` is
    not rejected (:math:`|z| \le` :data:`LEVEL`) and :math:`\hat a` is significantly positive
    (:math:`t >` :data:`LEVEL`, :func:`prototype_statistic`), else ``head`` itself; and the
    statistic z (the effective counts' where computed).

    Args:
        head: the fitted :class:`~frolic_tta.gda.GaussianHead` (``covariance="soft"``).
        prototypes: ``(K, d)`` the zero-shot classifier's prototypes.
        sums: the reduced moment sums (for N).
        span: ``(d, r)`` the data's span (:func:`frolic_tta.evidence.data_span`) or ``None``.
        squares: returns the head labels' :math:`\sum_i q_{ij}^2` ``(K,)``, reduced
            (:func:`~frolic_tta.soft_sums.posterior_squares`, a pass), called only where the
            soft counts' z is under -:data:`LEVEL`: Kish's effective counts' z then decides
            (module docstring); ``None``: the soft counts' z always decides.
    """
    z = prototypes.to(device=head.class_means.device, dtype=torch.float64)
    counts = head.class_weights * float(sums.count)
    fitted, z_value, _, t = prototype_statistic(
        head.class_means, head.shared_covariance, counts, z, span
    )
    if squares is not None and z_value < -LEVEL:  # a lower bound: the effective counts decide
        total = squares().to(counts)
        counts = torch.where(total > 0.0, counts.square() / total.clamp_min(1e-300), counts)
        fitted, z_value, _, t = prototype_statistic(
            head.class_means, head.shared_covariance, counts, z, span
        )
    if not (abs(z_value) <= LEVEL and t > LEVEL):  # H0 kept, and a-hat > 0 significantly
        return head, z_value
    factor, info = torch.linalg.cholesky_ex(head.shared_covariance)
    if int(info) != 0:
        return head, z_value
    centred = (fitted - head.center[None, :]).t()
    weight = torch.cholesky_solve(centred, factor).t()
    bias = -0.5 * (centred.t() * weight).sum(1)
    return dataclasses.replace(head, weight=weight, bias=bias, class_means=fitted), z_value
