r"""What mixture weights can still gain, bounded from one pass at two weight vectors.

The weights of fixed components maximise the concave
:math:`\ell(\pi) = \sum_i \ln (a_i^\top\pi)`, :math:`a_{ij} = e^{g_{ij}}`, over the simplex
(:mod:`frolic_tta.mixture`). Its Lagrange dual gives an upper bound at every :math:`u > 0`:
from :math:`\ln y \le -\ln u + u y - 1`, with :math:`u` scaled so that
:math:`\max_j (A^\top u)_j = N`,

.. math::
    \max_{\pi}\ell(\pi) \le -\sum_i \ln u_i + N \ln\frac{\max_j (A^\top u)_j}{N}.

At :math:`u_i = 1/(a_i^\top\pi)` it is Cover's bound at :math:`\pi`
(:func:`~frolic_tta.mixture_newton.headroom`: :math:`(A^\top u)_j = \partial_j\ell(\pi)`).
A pass at two weight vectors :math:`\pi^1, \pi^2` gives the segment
:math:`u_i(t) = (1-t)/(a_i^\top\pi^1) + t/(a_i^\top\pi^2)`, whose
:math:`(A^\top u)_j = (1-t)\,\partial_j\ell(\pi^1) + t\,\partial_j\ell(\pi^2)`. The bound at
:data:`GRID` points of :math:`t \in [0, 1]` (the ends are Cover's) takes the exponentials the
pass at :math:`\pi^1` already has: a matrix-vector product a chunk, no second exponential.
Where the two gradients peak at different classes (hard posteriors, weights off on opposite
sides) the segment's inside is far tighter than either end. On ``benchmarks/finalize.py``'s
ImageNet world, the uncorrected mixture of the label-bias test (:mod:`frolic_tta.evidence`),
at its class masses :math:`m_c` and at :math:`\tilde\pi_U`: Cover's bound 77,600 and 56,900
nats above :math:`\ell(m_c)`, the segment's 29,100 (what is left in truth: 1,480). That
settles the test in the uncorrected mixture's first pass instead of its second: one
``(N, K, d)`` product less.

Shapes: N samples, K classes, T grid points.
"""

from __future__ import annotations

import torch
from torch import Tensor

GRID = 33
r"""Points :math:`t = 0, 1/32, \ldots, 1` of the segment (any :math:`t` gives a bound)."""


class SecondWeights:
    r"""The local sums of the segment's bound between the weights ``first`` and ``second``
    (module docstring), gathered from the chunks of :func:`~frolic_tta.mixture.em_pass_beside`'s
    pass at ``first`` (:meth:`add` is its ``hook``): :meth:`sums`, the local shard's
    ``[sum_i ln u_i(t) (T,), d l/d pi_j at second (K,)]`` (float64), reduced with that pass
    (then :func:`segment_bound`). Both weights must be positive."""

    def __init__(self, first: Tensor, second: Tensor, exact: bool) -> None:
        logs = [w.double().log() for w in (first, second)]
        self.tops = torch.stack([w.max() for w in logs])  # (2,) max_j ln pi^c_j
        self.second = torch.exp(logs[1] - self.tops[1])
        self.exact = exact
        steps = torch.linspace(0.0, 1.0, GRID, dtype=torch.float64)
        self.log_steps = torch.stack([torch.log1p(-steps), steps.log()])  # (2, T): ln(1-t), ln t
        self.local = torch.zeros(GRID + first.shape[0], dtype=torch.float64)

    def add(self, exp: Tensor, top: Tensor, norm: Tensor) -> None:
        """One chunk: ``exp`` ``(n, K)``, ``top`` ``(n, 1)``, ``norm`` :math:`(e w^1)_i`
        ``(n,)`` (:data:`~frolic_tta.mixture.ChunkHook`)."""
        if self.local.device != exp.device:
            self.local = self.local.to(exp.device)
            self.log_steps, self.tops = self.log_steps.to(exp.device), self.tops.to(exp.device)
        second = self.second.to(exp)
        rows = (exp @ second).clamp_(min=torch.finfo(exp.dtype).tiny)  # (e w^2)_i
        # ln n_i(pi^c) = top_i + ln (e w^c)_i + max_j ln pi^c_j; ln u_i(t) a logsumexp over c
        pair = torch.stack([norm, rows], dim=1).double().log() + top.double() + self.tops
        terms = self.log_steps[None, :, :] - pair[:, :, None]  # (n, 2, T)
        self.local[:GRID] += torch.logsumexp(terms, dim=1).sum(0)
        inverse = rows.reciprocal()
        if self.exact:  # float64 sums over samples: no rounding that follows the chunks
            column = (exp * inverse.unsqueeze(1)).double().sum(0)
        else:
            column = (inverse @ exp).double()
        self.local[GRID:] += column * torch.exp(-self.tops[1])  # sum_i e^{g_ij} / n_i(pi^2)

    def sums(self) -> Tensor:
        """The local sums (on the host)."""
        return self.local.cpu()


def segment_bound(count: float, gradient: Tensor, sums: Tensor) -> float:
    r"""The segment's bound on :math:`\max_\pi \ell(\pi)` (module docstring): the smallest
    over the grid of :math:`-\sum_i \ln u_i(t) + N\ln(\max_j (A^\top u(t))_j / N)`.

    Args:
        count: N over all shards.
        gradient: ``(K,)`` :math:`\partial_j\ell(\pi^1)`, reduced.
        sums: :meth:`SecondWeights.sums`, reduced.
    """
    steps = torch.linspace(0.0, 1.0, GRID, dtype=torch.float64)
    second = sums[GRID:].double()
    mixed = (1.0 - steps)[:, None] * gradient.double()[None, :] + steps[:, None] * second
    bounds = -sums[:GRID].double() + count * (mixed.amax(dim=1) / count).log()
    return float(bounds.min())
