r"""The held-out trend that lets the head alone in where the in-sample margin cannot.

:mod:`frolic_tta.fusion` keeps the head alone (:math:`f_f = f_g/\tau_g`) where its labels make
the images more likely than the pooled fusion's by more than Wilks' :math:`Kr/2`. At
``benchmarks/peers.py``'s size (N = 20,000, K = 50, d = 128) the in-sample gap is 200-400 nats
against 3,200 there, so the pooled fusion stays, while the head alone is right on 0.7-1.7 pt
more of the samples in all 15 fits (``benchmarks/fusion_choice.py --clip-full``): the margin
overstates the optimism of refitting under the head's own labels (issue 35, items 4-5).

A held-out likelihood does not pay the refit's own optimism. (The candidates' labels still come
from the fit on all samples, so it is no leak-free test of the classifiers: labelled by fits
that did not see the scoring fold, it ranks them against their accuracy in some of the worlds
measured; docs/method.md, Default 6, ``benchmarks/trend_leakage.py``.) The samples are split in
two folds by a hash of their values' leading bits (:func:`~frolic_tta.folds.folds`: the same
fold on any shard, in any row order or chunking, and almost always under another CPU kernel
set's last bits); the mixture refitted under each candidate's labels on one fold (its soft
sums, :math:`\Sigma` the fold's within-class covariance on the data's span, weights
:math:`\tilde\pi`) scores every sample of the other. Three candidates are scored: the head
alone, the pooled fusion and the zero-shot classifier alone, each matched to :math:`\tilde\pi`
(Eq. 13). With the per-sample differences :math:`d_i = \ell_i(\text{head alone}) -
\ell_i(\text{pooled})` and :math:`e_i = \ell_i(\text{zero-shot}) - \ell_i(\text{pooled})`,
Vuong's statistics are :math:`Z = \sum_i d_i / (\sqrt N s_d)` (:math:`s_d` the sample standard
deviation), and the head alone is kept where the likelihood rises significantly along the
fusion's weight, and the sample means beat the prototypes' image (below, :math:`Z_\mu`):

.. math::
    Z_g > 3.09, \quad Z_c < -3.09 \quad\text{and}\quad Z_\mu > 3.09.

The likelihood is the head's own family, so labels nearer the head's posterior fit it better
whichever classifier is right; on worlds whose prototypes *are* the class means the head alone's
Z alone is up to 10.6 where it loses 1.5 pt. There the zero-shot labels are as likely as the
pooled ones or more (:math:`Z_c` up to +11.8); where the head alone gains, far less
(:math:`Z_c` -13 to -41).

**The prototypes' image.** The head alone's labels win that way also where the head's means are
its sample means and the prototypes *are* the class means: on long-tailed test sets (K = 50-100,
N = 20,000-30,000, ``benchmarks/fusion_choice.py --large``) the soft labels' contamination of
the tail classes' means makes the prototype test reject (:mod:`frolic_tta.prototype_means`, z 5
to 53), and the trend rose (Z_g 3.4-11.8, Z_c -4.3 to -12.8) in 10 of 12 fits, the head alone
0.2-0.7 pt under the pooled fusion. Held out, the same question has its answer: the zero-shot
candidate's mixture on one fold, with its sample means against the same mixture with their image
:math:`\hat c + \hat a z_j` (the prototype test's :math:`H_0`, fitted by
:func:`~frolic_tta.prototype_means.prototype_statistic` in the fold's :math:`\Sigma^{-1}`),
scored on the other: Vuong's :math:`Z_\mu` of the sample means over the image. The sample means
pay their K r parameters' noise there, which the in-sample test cannot tell from the labels'
contamination; so the head alone is kept only where also :math:`Z_\mu >` 3.09: the sample means
carry what the prototypes do not. Measured (``benchmarks/fusion_choice.py``, ``--sweep``,
``--large`` and ``--clip-full``): :math:`Z_\mu` -22 to -63 in those 24 means worlds and -0.1 to
-14 in the 114 smaller ones where the trend is read (K <= 20; it rose in 13 of them, half losing
up to 0.35 pt), +44 to +73 in the 15 CLIP-like fits at N = 20,000, where the head alone gains
0.6-1.7 pt. Its price: in ``benchmarks/finalize.py``'s ImageNet-like geometry at low signal
(zero-shot 0.25-0.38) the image wins held out too (:math:`Z_\mu` -13 to -25), and the head
alone's gain of 0.32-0.44 pt is forgone (docs/method.md, Default 6). One more mixture in the
scoring pass, no pass of its own.

The trend is read only where each fold has more samples than the means have parameters
(N/2 > K r: a fold's mean of n samples is off by r/n within-class variances on average): at
ImageNet size (N = 50,000, K r = 512,000) Z_g is 329 while the head
alone's in-sample likelihood is the lower one by 17,382 nats, and the head alone would lose
1.6 pt. Measured: docs/method.md, Default 6.

Cost, where it runs: one pass over the features (the fold's moments), one over each candidate's
logits (its soft sums by fold), one scoring pass (four mixtures), and the zero-shot matching.
Shapes: N samples, K classes, d embedding dim, r the rank of the data's span.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from frolic_tta.evidence import discriminant, within_factor
from frolic_tta.folds import enough_samples, folds, refits_by_fold
from frolic_tta.gda import MomentSums, shared_covariance
from frolic_tta.logits import LogitSource, ReduceFn, chunk_rows, exact_arithmetic
from frolic_tta.mixture import log_weights
from frolic_tta.prototype_means import LEVEL, prototype_statistic

__all__ = ["Difference", "enough_samples", "folds", "held_out_trend", "rises"]


def rises(trend: Tensor) -> bool:
    r"""Whether the held-out likelihood rises significantly from the zero-shot labels to the
    pooled ones to the head alone's, :math:`Z_g >` :data:`LEVEL` and :math:`Z_c < -`
    :data:`LEVEL`, and, where ``trend`` has a third entry, the sample means beat the
    prototypes' image, :math:`Z_\mu >` :data:`LEVEL` (``trend`` of :func:`held_out_trend`)."""
    image = len(trend) < 3 or float(trend[2]) > LEVEL
    return float(trend[0]) > LEVEL and float(trend[1]) < -LEVEL and image


class Difference(LogitSource):
    r"""The logits ``total / weight - part`` by chunks (:math:`f_c/\tau_c` from the pooled
    fusion :math:`\omega(f_g/\tau_g + f_c/\tau_c)` and the head alone's :math:`f_g/\tau_g`)."""

    def __init__(self, total: LogitSource, part: LogitSource, weight: float) -> None:
        self.total, self.part, self.weight = total, part, weight
        self.num_samples, self.num_classes = total.num_samples, total.num_classes
        self.exact = total.exact

    def chunks(self) -> Iterator[tuple[int, Tensor]]:
        parts = self.part.chunks()
        for start, values in self.total.chunks():
            at, other = next(parts)
            if at != start or other.shape != values.shape:
                raise ValueError(
                    f"Expected the two logit sources chunked alike, but got rows {start} and {at}"
                )
            yield start, values / self.weight - other


def held_out_trend(
    features: Tensor,
    prototypes: Tensor,
    labels: Sequence[tuple[LogitSource, Tensor]],
    sums: MomentSums,
    prior: Tensor,
    span: Tensor | None,
    reduce_fn: ReduceFn,
    chunk_size: int | None,
    image_of: int | None = None,
) -> tuple[Tensor | None, int]:
    r"""Vuong's Z of each candidate's held-out likelihood against the first one's (module
    docstring): ``(Z (len(labels) - 1,), passes)``, float64; 0 where the differences vanish;
    ``None`` where a fold has no more samples than the means have parameters (K r). With
    ``image_of``, one more Z last: that candidate's mixture against the same mixture with the
    prototypes' image :math:`\hat c + \hat a z_j` of its means (module docstring), in the
    same scoring pass.

    Args:
        features: ``(N_local, d)`` the local shard.
        prototypes: ``(K, d)`` (classes without mass take the fold's mean).
        labels: ``(logits, log_offset)`` of each candidate, the first the reference: the
            soft labels are :math:`\mathrm{softmax}(f + \text{offset})`.
        sums: the reduced moment sums (their total moments).
        prior: ``(K,)`` the mixture weights :math:`\tilde\pi`.
        span: ``(d, r)`` the data's span (:func:`~frolic_tta.evidence.data_span`) or ``None``.
        reduce_fn: sums a tensor over shards.
        chunk_size: rows per chunk.
        image_of: the index in ``labels`` whose sample means are tested against the
            prototypes' image, or ``None``.
    """
    k, d = prototypes.shape
    fold = folds(features)
    exact = exact_arithmetic(sums.count, k, d)
    dtype = torch.float64 if exact else torch.float32
    rank = d if span is None else span.shape[1]
    refits = refits_by_fold(features, fold, labels, sums, reduce_fn, chunk_size, dtype, k * rank)
    if refits is None:  # a fold too small
        return None, 1 + len(labels)
    # per fold: each candidate's mixture refitted on it
    models = [[_scorer(pair[f], prototypes, span) for pair in refits] for f in (0, 1)]
    pairs = [(c, 0) for c in range(1, len(labels))]
    if image_of is not None:
        for f in (0, 1):
            models[f].append(_image(models[f][image_of], prototypes))
        pairs.append((image_of, len(labels)))
    differences = _score(features, fold, models, pairs, log_weights(prior), chunk_size, dtype)
    moments = reduce_fn(differences)
    n = float(sums.count)
    statistics = []
    for first, square in moments.reshape(-1, 2):
        variance = (float(square) - float(first) ** 2 / n) / max(n - 1.0, 1.0)
        statistics.append(0.0 if variance <= 0.0 else float(first) / math.sqrt(n * variance))
    return torch.tensor(statistics, dtype=torch.float64), 2 + len(labels)


class _Mixture(NamedTuple):
    r"""A fold's mixture: :math:`\ln\mathcal N(x; \mu_j, \Sigma) = w_j^\top y + b_j -
    \frac12 y^\top\Sigma^{-1}y - \frac12\ln|\Sigma|` (+ const), :math:`y` the features less
    ``mean`` on the span."""

    mean: Tensor  # (d,)
    weight: Tensor  # W (K, r)
    bias: Tensor  # b (K,)
    factor: Tensor  # Cholesky factor of Sigma (r, r)
    half_log_det: Tensor  # ln|Sigma| / 2
    span: Tensor | None  # (d, r)
    centred: Tensor  # the class means less ``mean``, on the span (K, r)
    counts: Tensor  # soft counts (K,)


def _scorer(refit: MomentSums, prototypes: Tensor, span: Tensor | None) -> _Mixture:
    """The mixture refitted on ``refit``."""
    _, means, weights, _ = shared_covariance(refit, prototypes, "soft", None)
    centred, factor, _ = within_factor(means, weights, refit, span)
    weight, bias = discriminant(centred, factor)
    half_log_det = torch.log(factor.diagonal()).sum()
    mean = refit.feature_sum / refit.count
    return _Mixture(mean, weight, bias, factor, half_log_det, span, centred, weights * refit.count)


def _image(model: _Mixture, prototypes: Tensor) -> _Mixture:
    r"""``model`` (:func:`_scorer`'s) with its means replaced by the prototypes' image
    :math:`\hat c + \hat a z_j` (:func:`~frolic_tta.prototype_means.prototype_statistic`,
    fitted in its own :math:`\Sigma^{-1}` with its weights' counts; ``model`` itself where no
    image can be fitted: a Z of 0)."""
    z = prototypes.to(model.centred)
    z = z if model.span is None else z @ model.span.to(z)
    covariance = model.factor @ model.factor.t()
    fitted, _, _, _ = prototype_statistic(model.centred, covariance, model.counts, z, None)
    weight, bias = discriminant(fitted, model.factor)
    return model._replace(weight=weight, bias=bias, centred=fitted)


def _score(
    features: Tensor,
    fold: Tensor,
    models: list[list[_Mixture]],
    pairs: Sequence[tuple[int, int]],
    log_prior: Tensor,
    chunk_size: int | None,
    dtype: torch.dtype,
) -> Tensor:
    r"""``[sum_i d_i, sum_i d_i^2]`` per pair ``(a, b)`` of ``models``' indices (float64,
    local): each row scored by the other fold's mixtures, :math:`d_i` its log-likelihood under
    ``a`` less that under ``b``."""
    k = log_prior.shape[0]
    rows = chunk_rows(k, chunk_size)
    out = torch.zeros(len(pairs), 2, dtype=torch.float64, device=features.device)
    for start in range(0, features.shape[0], rows):
        x, where = features[start : start + rows], fold[start : start + rows]
        for f, mask in enumerate((where, ~where)):  # fold 1 by fold 0's mixtures, and back
            if not bool(mask.any()):
                continue
            scores = [_log_density(x[mask], model, log_prior, dtype) for model in models[f]]
            for c, (a, b) in enumerate(pairs):
                diff = (scores[a] - scores[b]).double()
                out[c, 0] += diff.sum()
                out[c, 1] += diff.square().sum()
    return out.flatten().cpu()


def _log_density(x: Tensor, model: _Mixture, log_prior: Tensor, dtype: torch.dtype) -> Tensor:
    r""":math:`\ln\sum_j \pi_j\mathcal N(x_i; \mu_j, \Sigma)` up to a constant, ``(n,)``."""
    y = x.to(torch.float64) - model.mean.to(x.device)
    y = (y if model.span is None else y @ model.span.to(y)).to(dtype)
    g = y @ model.weight.to(y).t() + (model.bias + log_prior.to(model.bias)).to(y)
    solved = torch.linalg.solve_triangular(model.factor.to(y), y.t(), upper=False)
    quad = 0.5 * solved.square().sum(0)
    return torch.logsumexp(g, 1) - quad - model.half_log_det.to(y)
