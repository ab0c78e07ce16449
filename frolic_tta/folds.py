r"""Two folds of the samples, the same on every shard, and each fold's moment sums.

A row's fold is a hash of its values (:func:`folds`), so 1, 2 or 3 shards, any row order and
any chunking split the samples alike, and each fold's sums are reduced like every other sum.
Read by the held-out trend of the fusion choice (:mod:`frolic_tta.held_out`) and the
cross-fitted test prior (:mod:`frolic_tta.cross_fit`), both only where each fold has more
samples than the class means have parameters (:func:`enough_samples`).
Shapes: N samples, K classes, d embedding dim, r the rank of the data's span.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from frolic_tta.gda import MomentSums
from frolic_tta.logits import LogitSource, ReduceFn, chunk_rows
from frolic_tta.sweeps import unnormalised

FOLD_MODULUS = 2_147_483_647
"""A prime: a row's fold is the parity of its hash modulo it (:func:`folds`)."""


FOLD_BITS = 12
"""The leading bits of each float32 value a row's fold reads: sign, exponent and 3 mantissa
bits (:func:`folds`)."""


def folds(features: Tensor) -> Tensor:
    r"""``(N,)`` bool, the fold of each row: the parity of :math:`\sum_k (2k + 1) b_k`
    modulo :data:`FOLD_MODULUS`, :math:`b_k` the leading :data:`FOLD_BITS` bits of the row's
    k-th float32 value as a signed integer. A function of the row alone, so every shard, row
    order and chunking agree; and of its values to 1 part in 8, so features whose last bits
    differ (another CPU kernel set's normalisation: 3 rows of ``tests/test_numerics.py``'s
    unit world changed fold on all 32 bits) almost never change fold: a value moves a leading
    bit with probability about :math:`2^{-20}` per unit roundoff."""
    shift = 32 - FOLD_BITS
    bits = features.detach().to(torch.float32).contiguous().view(torch.int32) >> shift
    bits = bits.to(torch.int64)
    odd = torch.arange(1, 2 * bits.shape[1], 2, dtype=torch.int64, device=bits.device)
    return torch.remainder((bits * odd).sum(1), FOLD_MODULUS).remainder(2) == 1


def enough_samples(count: float, num_classes: int, rank: int) -> bool:
    """Whether each half of the samples outnumbers the class means' parameters: N/2 > K r (a fold's
    mean of n samples is off by r/n within-class variances on average)."""
    return count > 2.0 * num_classes * rank


def refits_by_fold(
    features: Tensor,
    fold: Tensor,
    labels: Sequence[tuple[LogitSource, Tensor]],
    sums: MomentSums,
    reduce_fn: ReduceFn,
    chunk_size: int | None,
    dtype: torch.dtype,
    minimum: float,
) -> list[tuple[MomentSums, MomentSums]] | None:
    r"""Each candidate's moment sums on each fold, ``[(fold 0's, fold 1's)]`` (``fold`` False,
    True): the fold's count and moments, the soft sums of :math:`\mathrm{softmax}(f +
    \text{offset})` (``labels`` as :func:`held_out_trend`'s; float64 sums of ``dtype``
    products); one reduction. ``None`` where a fold has no more than ``minimum`` samples."""
    k, d = labels[0][0].num_classes, features.shape[1]
    local = [_fold_moments(features, fold, chunk_rows(k, chunk_size))]
    for source, offset in labels:
        local.append(_fold_soft_sums(source, offset, features, fold, dtype))
    packed = reduce_fn(torch.cat(local)).to(sums.outer_sum.device)
    by_fold = _split_moments(packed, sums, d)
    if min(float(by_fold[0][0]), float(by_fold[1][0])) <= minimum:
        return None
    refits, at = [], 1 + d + d * d
    for _ in labels:
        pair = []
        for moments in by_fold:
            soft_count, soft_sum = packed[at : at + k], packed[at + k : at + k + k * d]
            at += k + k * d
            pair.append(MomentSums(*moments, soft_count, soft_sum.reshape(k, d)))
        refits.append((pair[0], pair[1]))
    return refits


def _fold_moments(features: Tensor, fold: Tensor, rows: int) -> Tensor:
    """``[n, sum x (d,), sum x x^T (d*d,)]`` of the local rows of fold 1 (float64)."""
    d = features.shape[1]
    out = torch.zeros(1 + d + d * d, dtype=torch.float64, device=features.device)
    for start in range(0, features.shape[0], rows):
        x = features[start : start + rows][fold[start : start + rows]].to(torch.float64)
        out[0] += x.shape[0]
        out[1 : 1 + d] += x.sum(0)
        out[1 + d :] += (x.t() @ x).flatten()
    return out.cpu()


def _fold_soft_sums(
    source: LogitSource, offset: Tensor, features: Tensor, fold: Tensor, dtype: torch.dtype
) -> Tensor:
    r"""``[fold 0: sum q (K,), sum q x^T (K*d,); fold 1: the same]`` of the local rows for the
    soft labels :math:`q_i = \mathrm{softmax}(f_i + \text{offset})` (float64 sums of
    ``dtype`` products)."""
    k, d = source.num_classes, features.shape[1]
    out = torch.zeros(2, k + k * d, dtype=torch.float64, device=features.device)
    start = 0
    for posterior, _ in unnormalised(source, offset.to(torch.float64), None):
        rows = posterior.shape[0]
        q = posterior.to(dtype)
        q = q / q.sum(1, keepdim=True)
        x, where = features[start : start + rows].to(dtype), fold[start : start + rows]
        for f, mask in enumerate((~where, where)):
            out[f, :k] += q[mask].sum(0, dtype=torch.float64)
            out[f, k:] += (q[mask].t() @ x[mask]).double().flatten()
        start += rows
    return out.flatten().cpu()


def _split_moments(
    packed: Tensor, sums: MomentSums, d: int
) -> tuple[tuple[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]:
    """The moments ``(count, sum, outer sum)`` of fold 0 (the total less fold 1) and fold 1."""
    count, feature_sum = packed[0], packed[1 : 1 + d]
    outer = packed[1 + d : 1 + d + d * d].reshape(d, d)
    second = (count, feature_sum, outer)
    first = (sums.count - count, sums.feature_sum - feature_sum, sums.outer_sum - outer)
    return first, second
