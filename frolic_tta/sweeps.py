r"""Passes over a shard's exponentials: the chunks the matchings and the soft sums read.

A pass over the logits is bound by memory traffic: at ImageNet size (50,000 x 1,000 float32
logits, 191 MiB) one read of them takes about 23 ms on 2 cores of an Intel Xeon. Where the
posterior :math:`q_{ij} = e_{ij} s_j / \sum_k e_{ik} s_k` is only *summed* (its row sums, its
column sums, :math:`\sum_i q_i x_i^\top`) and the passes are not exact
(:func:`~frolic_tta.logits.exact_arithmetic`), those sums are matrix-vector (and
matrix-matrix) products with :math:`e`, each one read, instead of elementwise products
written back to a chunk-sized temporary: :func:`scaled_exponentials` hands out :math:`e` and
:math:`s` apart for that (the soft sums, :mod:`frolic_tta.soft_sums`; the mixture's EM pass
takes the same form, :mod:`frolic_tta.mixture`). The matchings' mass sums keep the
elementwise form: their curvature :math:`\sum_i q_{ij}^2` needs :math:`q` written once
anyway, and the products measured no faster there. Exact passes keep it too, with float64 sums
over samples that do not depend on the chunks.

Shapes: N samples, K classes, d embedding dim.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from frolic_tta.logits import LogitSource, flushed_exp, workspace

_EXP_RANGE = 80.0
r"""Largest logit spread within a row plus spread of the shift for which
:class:`Exponentials` serve a pass: every product :math:`e_{ij} s_j \ge e^{-80}` is a normal
float32 (the smallest is about :math:`e^{-87}`), so nothing underflows that the exponential of
the sum would keep."""


@dataclass(frozen=True)
class Exponentials:
    r""":math:`e_{ij} = \exp(f_{ij} - \max_k f_{ik})` of a shard, computed once: a matching's
    passes then need no exponential, :math:`\exp(f_{ij} + s_j - c_i) = e_{ij}\,
    e^{s_j - \max s}` with :math:`c_i = \max_k f_{ik} + \max s` (:func:`exponentials`).

    Attributes:
        values: ``(N_local, K)`` :math:`e` (a buffer the caller lent; overwritten).
        tops: ``(N_local, 1)`` :math:`\max_k f_{ik}`.
        depth: the largest :math:`\max_k f_{ik} - \min_k f_{ik}` of the shard's rows.
        rows: rows per chunk (the source's).
    """

    values: Tensor
    tops: Tensor
    depth: float
    rows: int


def exponentials(source: LogitSource, buffer: Tensor) -> Exponentials:
    """:class:`Exponentials` of ``source`` in ``buffer`` ``(N_local, K)`` (one pass, no
    reduction: each shard decides per pass whether its own serve, the sums are the same)."""
    tops = buffer.new_empty((source.num_samples, 1))
    depth, rows = 0.0, 1
    for start, logits in source.chunks():
        values = buffer[start : start + logits.shape[0]]
        top = tops[start : start + logits.shape[0]]
        torch.amax(logits, dim=1, keepdim=True, out=top)
        depth = max(depth, float((top.squeeze(1) - logits.amin(dim=1)).max()))
        flushed_exp(torch.sub(logits, top, out=values))
        rows = max(rows, logits.shape[0])
    return Exponentials(buffer, tops, depth, rows)


def scaled_exponentials(
    source: LogitSource, shift: Tensor, exp: Exponentials | None
) -> Iterator[tuple[Tensor, Tensor | None, Tensor]]:
    r"""``(e, s, c)`` per chunk: :math:`\exp(f_{ij} + \text{shift}_j - c_i) = e_{ij} s_j` with
    :math:`c_i \ge \max_j (f_{ij} + \text{shift}_j)` up to the spread of ``shift``; ``s``
    ``(K,)`` is :math:`e^{\text{shift} - \max \text{shift}}` where ``exp`` serves (its range,
    :data:`_EXP_RANGE`; ``e`` its values, read only), else ``None`` (:math:`s = 1`: one
    exponential per entry of the logits into a chunk-sized workspace, overwritten by the next
    chunk)."""
    spread = float(shift.max() - shift.min())
    if exp is not None and exp.depth + spread < _EXP_RANGE:
        high = float(shift.max())
        scale = torch.exp(shift - high).to(exp.values)
        for start in range(0, exp.values.shape[0], exp.rows):
            values = exp.values[start : start + exp.rows]
            yield values, scale, exp.tops[start : start + exp.rows] + high
        return
    work: Tensor | None = None  # one chunk-sized temporary for every chunk
    moved: Tensor | None = None  # the shift's one copy to the chunks' device
    for _, logits in source.chunks():
        work = workspace(work, logits)
        if moved is None or moved.device != logits.device or moved.dtype != logits.dtype:
            moved = shift.to(logits)
        posterior = torch.add(logits, moved, out=work[0])
        top = posterior.amax(dim=1, keepdim=True)
        yield flushed_exp(posterior.sub_(top)), None, top


def unnormalised(
    source: LogitSource, shift: Tensor, exp: Exponentials | None
) -> Iterator[tuple[Tensor, Tensor]]:
    r"""``(e s, c)`` per chunk (:func:`scaled_exponentials`): :math:`\exp(f_{ij} + s_j - c_i)`
    in a chunk-sized workspace, overwritten by the next chunk."""
    work: Tensor | None = None  # one chunk-sized temporary for every chunk
    for values, scale, top in scaled_exponentials(source, shift, exp):
        if scale is None:  # already the workspace
            yield values, top
            continue
        work = workspace(work, values)
        yield torch.mul(values, scale, out=work[0]), top
