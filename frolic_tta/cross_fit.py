r"""The test prior's mixture weights, cross-fitted (``solver.prior_cross_fit``).

:func:`~frolic_tta.prior.estimate_test_prior` solves the weights of a mixture refitted on the
very samples it weighs. A class the test set lacks still gets soft labels there (the matching
hands it its share of the current prior), its component is fitted to the samples that carry
them and then explains those samples: in-sample, its weight stays near what it was handed. On
``benchmarks/label_shift.py``'s world with 15 of 50 classes present (N = 20,000) the 35 absent
classes keep 0.034 of the mass after 3 refits and 0.029 after 20 (the fixed point); the head
alone, matched to that prior, is right on 1.5 pt fewer samples than matched to the same prior
with those classes at 0. Refitting the means under the mixture's own posterior (EM on every
parameter) does worse: the spare components split the present classes.

Cross-fitted, each sample's component densities come from the mixture refitted on the *other*
fold (:func:`~frolic_tta.folds.folds`: the same fold on any shard, row order or chunking;
each fold's soft sums under the last matching's posterior, its own within-class covariance,
:func:`~frolic_tta.gda.fit_gaussian_head`), and the weights are the maximum-likelihood ones
on those held-out densities: a component fitted to one fold's stray samples explains little of
the other's (there, seed 0: 0.002 of the mass left on the absent classes, f_d 0.947 against
0.932). Only the direction :math:`\hat\pi` changes; the shrinkage weight :math:`w` stays the
in-sample one, so a test set taken as balanced (:math:`w = 0`) is untouched.

Like the held-out trend it runs only where each fold has more samples than the means have
parameters (N/2 > K r, r the rank of the data's span): a fold's mean of n samples is off by
r/n within-class variances, and where n << r the held-out densities are mostly that error.
Measured without the gate (``benchmarks/label_shift.py``'s worlds, seed 0): ImageNet size,
long-tailed (N = 50,000, K r = 512,000), f_d 0.832 -> 0.768; the N = 2,000 long-tailed world
(K r = 6,400) 0.814 -> 0.830, a gain the gate forgoes. Cost: one pass over the features
(the folds' moments), one over the logits (their soft sums), the weights' EM passes over the
held-out densities (one product into the buffer where there is one, and one more to put the
head's logits back), and the matching to the new prior.
Shapes: N samples, K classes, d embedding dim, r the rank of the data's span.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from frolic_tta.folds import enough_samples, folds, refits_by_fold
from frolic_tta.gda import GaussianHead, MomentSums, fit_gaussian_head
from frolic_tta.logits import LinearLogits, LogitSource, ReduceFn, compute_dtype, fill
from frolic_tta.mixture import mixture_weights
from frolic_tta.options import Shrinkage
from frolic_tta.span import data_span


class HeldOutDensities(LogitSource):
    r"""Each row's component logits :math:`w_j^\top(x - \hat\mu) + b_j` from the mixture of the
    other fold: rows of fold 0 (``fold`` False) by ``maps[1]``, rows of fold 1 by ``maps[0]``
    (a per-row constant apart from the log-densities, which the weights do not see)."""

    def __init__(self, fold: Tensor, maps: tuple[LinearLogits, LinearLogits]) -> None:
        self.fold, self.maps = fold, maps
        self.num_samples, self.num_classes = maps[0].num_samples, maps[0].num_classes
        self.chunk_size, self.exact = maps[0].chunk_size, maps[0].exact

    def chunks(self) -> Iterator[tuple[int, Tensor]]:
        features = self.maps[0].features
        for start in range(0, self.num_samples, self.chunk_size):
            where = self.fold[start : start + self.chunk_size]
            out = torch.empty(
                where.shape[0], self.num_classes, dtype=compute_dtype(features),
                device=features.device,
            )  # fmt: skip
            for scorer, rows in ((self.maps[1], ~where), (self.maps[0], where)):
                if bool(rows.any()):
                    out[rows] = scorer.rows(start, rows)
            yield start, out


def cross_fitted_weights(
    features: Tensor,
    prototypes: Tensor,
    source: LogitSource,
    offset: Tensor,
    sums: MomentSums,
    head: GaussianHead,
    init: Tensor,
    *,
    shrinkage: Shrinkage,
    tol: float,
    reduce_fn: ReduceFn,
    chunk_size: int | None,
    buffer: Tensor | None = None,
) -> tuple[Tensor, int, bool] | None:
    r"""The mixture weights on held-out component densities (module docstring).

    Args:
        features: ``(N_local, d)`` the local shard.
        prototypes: ``(K, d)``.
        source: ``(N_local, K)`` the logits whose debiased posterior
            :math:`\mathrm{softmax}(f + \text{offset})` labels each fold's mixture.
        offset: ``(K,)`` its offset (the last matching's, :math:`\ln\tilde\pi - \ln\hat\beta`).
        sums: the reduced moment sums.
        head: the mixture refitted on all samples (with ``buffer``, its logits are written
            back there at the end).
        init: ``(K,)`` the weights the solve starts from (the in-sample ones).
        shrinkage: of each fold's covariance (:func:`~frolic_tta.gda.fit_gaussian_head`).
        tol: of the weights (:func:`~frolic_tta.mixture.mixture_weights`).
        reduce_fn: sums a tensor over shards.
        chunk_size: rows per chunk.
        buffer: ``(N_local, K)`` holding ``head``'s logits: the densities are written there
            for the solve, then ``head``'s logits again (one product each); ``None``: the
            densities are recomputed at every pass.

    Returns:
        ``(weights (K,), passes, converged)``, or ``None`` where it does not run: N/2 <= K r,
        or a fold with no more samples than K r.
    """
    k, d = prototypes.shape
    span = data_span(sums)
    rank = d if span is None else span.shape[1]
    if rank == 0 or not enough_samples(float(sums.count), k, rank):
        return None
    fold = folds(features)
    dtype = torch.float64 if source.exact else torch.float32
    labels = [(source, offset)]
    refits = refits_by_fold(features, fold, labels, sums, reduce_fn, chunk_size, dtype, k * rank)
    if refits is None:
        return None
    maps = [
        fit_gaussian_head(refit, prototypes, "soft", shrinkage)
        .gda()
        .source(features, chunk_size, source.exact)
        for refit in refits[0]
    ]
    densities: LogitSource = HeldOutDensities(fold, (maps[0], maps[1]))
    if buffer is not None:  # one product; the solve's passes read the buffer
        densities = fill(buffer, densities)
    weights, _, inner, converged = mixture_weights(densities, init, tol=tol, reduce_fn=reduce_fn)
    if buffer is not None:  # the head's logits, as on entry
        fill(buffer, head.gda().source(features, chunk_size, source.exact))
    return weights, 2 + 2 * (buffer is not None) + inner, converged
