r"""The soft class sums a Gaussian head is refitted from, the same on any number of shards.

Under a debiased posterior :math:`q_i = \mathrm{softmax}(f(x_i) + \text{offset})` the head's
class masses and means come from :math:`\sum_i q_i` and :math:`\sum_i q_i x_i^\top` (Eqs. 4-5
with soft labels). Summed as float32 products over row chunks, their rounding depends on which
rows share a chunk, and so on how the test set is split over processes. Where the within-class
scatter is small against the class means (weakly informative features: the means nearly
cancel in :math:`\Sigma`), that rounding moves :math:`f_g` and :math:`\tau_g` by 1e-5 and more
(measured on ``benchmarks/ddp.py``'s world, ``tests/data/encoder_world.pt``: logits 1.3e-4 of
their scale apart between 1 and 2 shards). In float64 the chunks' rounding is 1e-16 and the
shards agree (2e-6 there); float64 costs about 2.5x the float32 product, so it is used where
the product is small, :math:`N K d \le` :data:`EXACT_SOFT_SUMS` (N over all shards, so every
shard and every world size decides alike); above it the products stay float32 (at ImageNet
size, 50,000 x 1,000 x 512, the float64 pass would take 1.0 s against 0.4 s here). There,
forced float64 (``benchmarks/soft_sums.py``) brings the logits from 5.0e-7 to 1.7e-7 of their
scale from an all-float64 fit on 2 CPU cores (H100: 7.1e-7 to 3.6e-7); two chunkings stay
1.4e-7 apart (H100: 4.3e-7 to 1.4e-7), with no prediction changed either way. It costs 0.9 s
of a 5.6 s fit there and 0.08 s on the H100 (0.23 against 0.15 s). The rule is the same on
every device, so devices decide alike too.

Shapes: N samples, K classes, d embedding dim.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from frolic_tta.gda import MomentSums
from frolic_tta.logits import EXACT_PRODUCTS, LogitSource, ReduceFn, exact_arithmetic, workspace
from frolic_tta.sweeps import Exponentials, scaled_exponentials, unnormalised

EXACT_SOFT_SUMS = EXACT_PRODUCTS
"""Largest N K d whose soft sums are float64 (:func:`~frolic_tta.logits.exact_arithmetic`)."""


def posterior_sums(
    source: LogitSource,
    log_offset: Tensor,
    features: Tensor,
    exp: Exponentials | None = None,
    total: Tensor | float | None = None,
    entropy: bool = False,
) -> Tensor:
    r"""Packed ``[sum_i q_i (K,), sum_i q_i x_i^T (K*d,)]`` of the local shard (float64) for the
    debiased posterior :math:`q_i = \mathrm{softmax}(f(x_i) + \text{offset})` of the logits
    ``source`` (reduce it, then :func:`refitted_sums`); ``exp``: the logits'
    :class:`~frolic_tta.matching.Exponentials`, if at hand (no exponential then); ``total``:
    N over all shards, which decides float64 products (:data:`EXACT_SOFT_SUMS`; ``None``:
    float32 products of float32 logits); ``entropy``: followed by
    :math:`\sum_i H(q_i) = -\sum_{ij} q_{ij}\ln q_{ij}` (one element; take it off before
    :func:`refitted_sums`).

    Where the products are not float64, :math:`q_{ij} = e_{ij} s_j / n_i` is never written:
    with :math:`n = e s` (a matrix-vector product), :math:`\sum_i q_i = s \circ (e^\top
    n^{-1})` and :math:`\sum_i q_i x_i^\top = \mathrm{diag}(s)\, e^\top (x / n)`, and
    :math:`H(q_i) = \ln n_i + \sum_j (\mathrm{entr}(e_{ij}) s_j - e_{ij} s_j \ln s_j)/n_i`
    (:func:`~frolic_tta.sweeps.scaled_exponentials`). No unscaled term overflows: a row's
    :math:`n_i` is at least :math:`e^{-D}` (the class of :math:`s = 1`) and at least
    :math:`e^{-\text{spread}}` (its top class), so :math:`e_{ij}/n_i \le e^{40}` where the
    exponentials serve (:math:`D + \text{spread} < 80`), and 1 where they do not
    (:math:`s = 1`)."""
    k, d = source.num_classes, features.shape[1]
    exact = total is not None and exact_arithmetic(total, k, d)
    count = torch.zeros(k, dtype=torch.float64, device=features.device)
    weighted = torch.zeros(k, d, dtype=torch.float64, device=features.device)
    spread = torch.zeros(1, dtype=torch.float64, device=features.device)
    start = 0
    if not exact:  # e and s apart: no (n, K) write (module docstring)
        work: Tensor | None = None  # entr(e), where the entropy is asked for
        pair: Tensor | None = None  # (K, 2): s and s ln s, for the entropy's row sums
        for values, scale, _ in scaled_exponentials(source, log_offset, exp):
            rows, offsets = values.shape[0], None
            if scale is None:
                norm = values.sum(1)
            elif entropy:  # n_i and sum_j e_ij s_j ln s_j in one (n, K) x (K, 2) product
                if pair is None:
                    pair = torch.stack([scale, torch.special.xlogy(scale, scale)], dim=1)
                norm, offsets = (values @ pair).unbind(1)
            else:
                norm = values @ scale
            inverse = norm.reciprocal()
            block = features[start : start + rows].to(values.dtype) * inverse.unsqueeze(1)
            column, product = inverse @ values, values.t() @ block
            if entropy:  # H(q_i) = ln n_i + sum_j (entr(e_ij) s_j - e_ij s_j ln s_j) / n_i
                work = workspace(work, values)
                plogs = torch.special.entr(values, out=work[0])
                plogs = plogs.sum(1) if scale is None else plogs @ scale - offsets
                spread += (norm.log() + inverse * plogs).sum(dtype=torch.float64)
            if scale is not None:
                column, product = column * scale, product * scale.unsqueeze(1)
            count += column.double()
            weighted += product.double()
            start += rows
        return torch.cat([count, weighted.flatten()] + ([spread] if entropy else [])).cpu()
    for posterior, _ in unnormalised(source, log_offset, exp):  # exact: float64 sums
        posterior.div_(posterior.sum(dim=1, keepdim=True))
        q = posterior.to(torch.float64)
        block = features[start : start + posterior.shape[0]].to(torch.float64)
        count += q.sum(0).double()
        weighted += (q.t() @ block).double()
        if entropy:
            spread += torch.special.entr(posterior).sum(dtype=torch.float64)
        start += posterior.shape[0]
    return torch.cat([count, weighted.flatten()] + ([spread] if entropy else [])).cpu()


def refitted_sums(sums: MomentSums, packed: Tensor) -> MomentSums:
    """``sums`` with their soft sums replaced by the reduced :func:`posterior_sums` ``packed``."""
    k = sums.soft_count.shape[0]
    packed = packed.to(sums.soft_count.device)  # the sums' device (the head is solved there)
    return replace(sums, soft_count=packed[:k], soft_sum=packed[k:].reshape(k, -1))


def posterior_squares(
    source: LogitSource, log_offset: Tensor | None, reduce_fn: ReduceFn
) -> Tensor:
    r"""``(K,)`` :math:`\sum_i q_{ij}^2` over all shards (float64, one pass) for the posterior
    :math:`q_i = \mathrm{softmax}(f(x_i) + \text{offset})` of the logits ``source``
    (``log_offset`` ``None``: 0): with :math:`n_j = \sum_i q_{ij}`, Kish's effective count
    :math:`n_j^2 / \sum_i q_{ij}^2` of a soft mean (:mod:`frolic_tta.prototype_means`)."""
    shift = torch.zeros(source.num_classes, dtype=torch.float64)
    total: Tensor | None = None
    for posterior, _ in unnormalised(source, shift if log_offset is None else log_offset, None):
        posterior.div_(posterior.sum(dim=1, keepdim=True))
        rows = posterior.square_().sum(0, dtype=torch.float64)
        total = rows if total is None else total + rows
    return reduce_fn(torch.zeros_like(shift) if total is None else total.cpu())
