r"""Newton directions of the class-mass matching on the full Hessian (behind
:mod:`frolic_tta.matching`).

:math:`H = (\mathrm{diag}(m) - \sum_i q_i q_i^\top)/N` is a graph Laplacian over the classes (two
classes are linked by the samples they share): singular along the constant vector of every
group of classes that shares no sample with the rest, directions in which :math:`J` is flat or
moves only through the classes left out. :func:`newton_direction` steps with its
pseudo-inverse on the free classes, eigenvalues below :data:`KEEP` of the largest dropped.

**Cost.** An eigendecomposition costs about :math:`9K^3` flops (1.0 to 1.3 s at K = 2,000 on 2
cores, about 60 passes over N = 1,000 logits): where the free block is certified well
conditioned, a Cholesky factorisation and the trace of its inverse (:math:`\tfrac23 K^3`;
0.05 s and 0.12 s there) give the same direction. The certificate: with :math:`A` the block (plus
:math:`\alpha\,\mathbf 1\mathbf 1^\top/K_F` where every class is free, which moves only the
constant direction's eigenvalue 0 to :math:`\alpha`), every eigenvalue of :math:`A` is at least
:math:`1/\operatorname{tr}A^{-1}`, and the largest of the block at most :math:`2\max_j H_{jj}`
(Gershgorin: a row's off-diagonal magnitudes sum to at most its diagonal). Where
:math:`1/\operatorname{tr}A^{-1} \ge` :data:`KEEP` :math:`\cdot\, 2\max_j H_{jj}`, the
pseudo-inverse keeps every direction (but the constant one), so it is the inverse. Elsewhere
the eigendecomposition decides. Shapes: K classes, :math:`K_F` free classes.
"""

from __future__ import annotations

import torch
from torch import Tensor

KEEP = 1e-6
"""Eigenvalues of the free Hessian below this fraction of its largest are dropped (its float32
sums round at about 1e-7)."""


def newton_direction(outer: Tensor, count: float, gradient: Tensor, free: Tensor) -> Tensor | None:
    r"""The Newton direction :math:`H_{FF}^{+} g_F` on the free classes ``free`` (K,) bool.

    Args:
        outer: ``(K, K)`` float64 :math:`\sum_i q_i q_i^\top` over all shards.
        count: N over all shards.
        gradient: ``(K,)`` the gradient :math:`g` of :math:`J`.
        free: ``(K,)`` bool, the classes that take the Newton step.

    Returns:
        ``(K,)`` the direction (0 outside ``free``): in the dropped (null) directions, where
        :math:`J` is linear, the gradient's part there (beyond :math:`10^{-6}` in L1) takes a
        step of 10 towards the bound. ``None`` where :math:`H_{FF} = 0`.
    """
    # diag(m) from the row sums of sum_i q_i q_i^T (equal, as sum_j q_ij = 1): the rows of
    # this H sum to 0 to float64 rounding, so its null directions stay null in float32 sums
    hessian = (torch.diag(outer.sum(1)) - outer) / count
    index = free.nonzero().squeeze(1)
    block, local = hessian[index][:, index], gradient[index]
    every = bool(free.all())  # J ignores the constant vector: no step along it
    direction = torch.zeros_like(gradient)
    solved = _certified_solve(block, local - local.mean() if every else local, every)
    if solved is not None:
        direction[index] = solved
        return direction
    values, vectors = torch.linalg.eigh(block)
    if not float(values.max()) > 0.0:
        return None
    keep = values > KEEP * float(values.max())
    basis, null = vectors[:, keep], vectors[:, ~keep]
    direction[index] = basis @ ((basis.T @ local) / values[keep])
    if every:
        local = local - local.mean()
    flat = null @ (null.T @ local)  # J is linear there: a step of 10 towards the bound
    if float(flat.abs().sum()) > 1e-6:
        direction[index] += flat * (10.0 / float(flat.abs().max()))
    return direction


def _certified_solve(block: Tensor, rhs: Tensor, every: bool) -> Tensor | None:
    r""":math:`H_{FF}^{+}` ``rhs`` by Cholesky where the module docstring's certificate holds
    (``rhs`` orthogonal to the constant vector where ``every`` class is free), else ``None``."""
    scale = float(block.diagonal().max())
    if not scale > 0.0:
        return None
    size = block.shape[0]
    system = block + scale / size if every else block  # the constant direction's eigenvalue
    factor, info = torch.linalg.cholesky_ex(system)
    if int(info) != 0:
        return None
    eye = torch.eye(size, dtype=block.dtype, device=block.device)
    inverse = torch.linalg.solve_triangular(factor, eye, upper=False)  # L^{-1}
    # tr(A^-1) = ||L^-1||_F^2 bounds 1 / lambda_min(A) from above
    if not float(torch.linalg.matrix_norm(inverse)) ** 2 * KEEP * 2.0 * scale <= 1.0:
        return None
    return inverse.T @ (inverse @ rhs)
