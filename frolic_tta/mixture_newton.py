r"""Newton steps for the mixture weights where EM crawls (behind :mod:`frolic_tta.mixture`).

EM on the weights :math:`\pi` of fixed components is slow exactly where the likelihood is flat
or its maximiser sits on the simplex's boundary: fewer samples than classes, classes the test
set lacks. There a weight pushed towards 0 returns at EM's geometric pace, and an EM step
that moves :math:`\pi` by less than ``tol`` proves nothing (a weight of :math:`10^{-10}` whose
gradient asks for it to grow 1,000-fold moves it by :math:`10^{-7}`). This module solves the
same concave problem by mix-SQP (Kim, Carbonetto, Stephens & Anitescu 2020): with
:math:`e_{ij} = e^{g_{ij} - \max_k g_{ik}}`, :math:`u = e x` and the relaxation

.. math::
    F(x) = -\frac1N \sum_i \ln (e x)_i + \sum_j x_j, \qquad x \ge 0,

whose minimiser sums to 1 and is the maximum-likelihood :math:`\hat\pi`, each step solves the
quadratic model :math:`\tfrac12 p^\top H p + \nabla F^\top p` with
:math:`\nabla F = 1 - \frac1N e^\top (1/u)` and :math:`H = \frac1N e^\top \mathrm{diag}(u^{-2})\,e`
over :math:`x + p \ge 0` (an active-set method on the classes in the support or whose
gradient asks to enter), then backtracks on :math:`F`. Its stop is the optimality condition
itself (Kiefer-Wolfowitz): at :math:`\pi = x/\sum x`, :math:`\max_j \partial_j \ell / N - 1
\le` ``target``, which bounds what is left, :math:`\ell(\hat\pi) - \ell(\pi) \le N
\ln(1 +` ``target``:math:`)` (:func:`headroom`). Every pass is one ``reduce_fn`` call of
``[N, sums, gradient, Hessian]``; every decision is taken on reduced values.

Shapes: N samples, K classes, C classes in the Hessian.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from frolic_tta.logits import LogitSource, ReduceFn, flushed_exp

KKT_TOL = 1e-5
r"""A weight solve is converged when :math:`\max_j \partial_j\ell(\pi)/N - 1 \le` ``KKT_TOL``:
at most :math:`10^{-5}` nats per sample from the maximum (EM's stops measured 4e-9 to 8e-7)."""
NEWTON_TOL = 1e-7
"""The Newton phase's own target (it converges quadratically: a pass or two below KKT_TOL;
float32 log-likelihoods leave it at about 2e-9)."""
MAX_COLUMNS = 4096
"""Largest Hessian the Newton phase forms (C x C float64, 128 MiB); above it the steps are
block steps on :data:`BLOCK_COLUMNS` classes."""
BLOCK_COLUMNS = 2048
r"""Where the support and the classes asking in exceed :data:`MAX_COLUMNS` (K = 21,841), each
Newton step is taken on this many classes, the others held: those farthest from the optimality
condition, :math:`|\partial_j\ell/N - 1|` largest on the support, :math:`\partial_j\ell/N - 1`
outside it (reduced values: every shard picks the same block; a 32 MiB Hessian). On the 21k
world at N = 30,000 (balanced weights, after 16 EM passes) 2,048 classes reach the 1e-5 gap in
11 Newton passes, 512 in 43: a smaller block leaves coupled classes out and the gap
zig-zags.

The classes outside the block are not left as they are: they take EM's step,
:math:`x_j \leftarrow x_j\,\partial_j\ell/N` (the direction :math:`-x_j\,\partial F/\partial x_j`,
a descent direction, from the gradient the pass already brought), in the same trial and the
same backtracking on :math:`F`. Where the support is ten blocks (issue 35 item 2's 21k world,
N = 200,000, on an H200) the test prior's two block solves took 7 and 15 passes instead of 16
and 23, its passes 91 instead of 108 and the fit 23.7 s instead of 29-30 s, to the same
1e-5 gap; a block step alone leaves the other nine tenths where they are, so the next block's
step has little to do."""
SUPPORT_FLOOR = 1e-4
"""EM weights below this fraction of the largest start the Newton phase at 0 (the active set
lets a weight enter from 0 in one step; from 1e-10 its curvature allows it to double)."""
UNIFORM_MIX = 0.1
r"""Where some weight's gradient asks it to more than double (:math:`\max_j \partial_j\ell/N
> 2`), the start is mixed with this much of the uniform weights on the support and the classes
asking in: a sample whose classes all have weight ~0 makes the quadratic model's curvature
:math:`u_i^{-2}` explode (mix-SQP starts from uniform for the same reason)."""


def _sums(source: LogitSource, x: Tensor, columns: Tensor | None) -> Tensor:
    """Packed ``[N, sum_i (m_i + ln u_i), sum_i lse(g_i), G (K,), H (C*C,)]`` of the shard,
    ``G = e^T (1/u)`` and ``H = (e_C/u)^T (e_C/u)`` (float64), summed where the chunks are:
    no synchronisation a chunk, one copy to the host a pass."""
    k = source.num_classes
    size = 0 if columns is None else int(columns.numel())
    tiny = torch.finfo(torch.float64).tiny
    weights = x.to(torch.float64)
    packed = torch.zeros(3 + k + size * size, dtype=torch.float64)
    head, gradient, hessian = packed[:3], packed[3 : 3 + k], packed[3 + k :].view(size, size)
    for _, logits in source.chunks():
        g = logits.to(torch.float64, copy=True)  # float64 logits: worked on in place below
        if packed.device != g.device:  # the first chunk: the sums and weights go to its device
            packed, weights = packed.to(g.device), weights.to(g.device)
            head, gradient = packed[:3], packed[3 : 3 + k]
            hessian = packed[3 + k :].view(size, size)
            columns = None if columns is None else columns.to(g.device)
        top = g.amax(dim=1, keepdim=True)
        e = flushed_exp(g.sub_(top))
        u = (e @ weights).clamp_(min=tiny)
        top = top.squeeze(1)
        head[0] += g.shape[0]
        head[1] += (top + u.log()).sum()
        head[2] += (top + e.sum(1).log()).sum()
        scaled = e.div_(u.unsqueeze(1))
        gradient += scaled.sum(0)
        if size:
            block = scaled[:, columns]
            hessian += block.t() @ block
    return packed.cpu()


PIVOT_PASSES = 50
"""Largest number of solves :func:`_pivoted_qp` takes before the active-set method takes over
(the 21k world's steps need 1 to 4)."""


def _solve_on(
    hessian: Tensor, linear: Tensor, passive: Tensor, ridge: float, least_squares: bool = False
) -> Tensor | None:
    """``y`` with ``y_P = (H_PP + ridge I)^{-1} b_P`` (Cholesky) on the classes ``passive``, 0
    elsewhere. Where the block is numerically singular despite the ridge: its least-squares
    solution (``least_squares``), else ``None``."""
    index = passive.nonzero().squeeze(1)
    block = hessian[index.unsqueeze(1), index] + ridge * torch.eye(len(index)).to(hessian)
    factor, info = torch.linalg.cholesky_ex(block)
    y = torch.zeros_like(linear)
    if int(info) == 0:
        y[index] = torch.cholesky_solve(linear[index].unsqueeze(1), factor).squeeze(1)
    elif least_squares:
        y[index] = torch.linalg.lstsq(block, linear[index].unsqueeze(1)).solution.squeeze(1)
    else:
        return None
    return y


def _pivoted_qp(
    hessian: Tensor, linear: Tensor, start: Tensor, tol: float, ridge: float
) -> Tensor | None:
    r"""The quadratic program of :func:`_nonnegative_qp` by block principal pivoting (Júdice &
    Pires 1994, the NNLS solver of Kim & Park 2011): solve on the classes ``P`` (first those
    where ``start > 0``), then move *every* class that breaks an optimality condition
    (:math:`y_j \le 0` in ``P``, :math:`(Hy - b)_j < -` ``tol`` outside it) across; where that
    stops shrinking the count of such classes for 3 solves, only the last of them moves (its
    rule: finite for a positive-definite ``H``). Returns ``y`` once no class breaks a condition
    (the active-set method's own stop), or ``None`` after :data:`PIVOT_PASSES` solves or a
    singular block.

    The active-set method moves one class a solve: at K = 21,841 (N = 30,000) a block step's
    program dropped 162 of its 2,048 classes in 162 Cholesky factorisations (7.3 s on 2 cores);
    this takes 4 solves (0.21 s) to the same ``y``.
    """
    passive = start > 0
    fewest, tries = linear.shape[0] + 1, 3
    for _ in range(PIVOT_PASSES):
        y = _solve_on(hessian, linear, passive, ridge)
        if y is None:
            return None
        broken = torch.where(passive, y <= 0, hessian @ y - linear < -tol)
        count = int(broken.sum())
        if count == 0:
            return y
        if count < fewest:
            fewest, tries = count, 3
        elif tries > 0:
            tries -= 1
        else:
            last = int(broken.nonzero().max())
            broken = torch.zeros_like(broken)
            broken[last] = True
        passive ^= broken
    return None


def _nonnegative_qp(hessian: Tensor, linear: Tensor, start: Tensor, tol: float) -> Tensor:
    r"""``argmin_{y >= 0} 1/2 y^T H y - b^T y``: by block principal pivoting
    (:func:`_pivoted_qp`), else by a primal active-set method from the feasible ``start``
    (Lawson-Hanson's, with ``H`` for ``A^T A``); ``H`` gets a ridge of :math:`10^{-10}` of its
    mean diagonal (it is singular where C exceeds N). Both stop at the same conditions: ``y``
    solves the program on its support, whose classes are positive, and
    :math:`(Hy - b)_j \ge -` ``tol`` off it."""
    c = linear.shape[0]
    ridge = 1e-10 * float(hessian.diagonal().mean().clamp(min=1e-300))
    pivoted = _pivoted_qp(hessian, linear, start, tol, ridge)
    if pivoted is not None:
        return pivoted
    y = start.clone()
    passive = y > 0
    if not bool(passive.any()):
        passive[int(linear.argmax())] = True
    for _ in range(3 * c + 100):
        z = _solve_on(hessian, linear, passive, ridge, True)  # (singular: least squares)
        solved = z[passive]
        if bool((solved > 0).all()):
            y = z
            free = linear - hessian @ y  # minus the gradient of the quadratic
            free[passive] = -torch.inf
            j = int(free.argmax())
            if float(free[j]) <= tol:
                return y
            passive[j] = True
            continue
        leaving = (passive & (z <= 0)).nonzero().squeeze(1)
        ratios = y[leaving] / (y[leaving] - z[leaving])
        blocking = int(ratios.argmin())
        y = y + float(ratios[blocking]) * (z - y)
        passive &= y > 1e-15 * float(y.max())  # the blocking variable leaves, exactly:
        passive[leaving[blocking]] = False  # its rounding must not keep it (it would cycle)
        y[~passive] = 0.0
        if not bool(passive.any()):
            passive[int(linear.argmax())] = True
    return y


def headroom(count: float, gap: float) -> float:
    r"""A bound on what the weights can still gain, :math:`\ell(\hat\pi) - \ell(\pi) \le
    N \ln(\max_j \partial_j\ell(\pi) / N)` (``gap`` :math:`= \max_j \partial_j\ell/N - 1`,
    ``count`` N; Cover 1984): with :math:`r_{ij}` the responsibilities at :math:`\pi`,
    :math:`\ell(\pi') - \ell(\pi) = \sum_i \ln\sum_j (\pi'_j/\pi_j) r_{ij} \le
    N \ln \frac1N \sum_j \pi'_j \partial_j\ell` (Jensen), at most the Frank-Wolfe gap
    :math:`N\,` ``gap`` and far below it where ``gap`` is large (hard posteriors at ImageNet
    size: 76,000 against 178,000 nats at the class masses :math:`m_c`)."""
    return count * math.log1p(max(gap, 0.0))


def _block(x: Tensor, ratio: Tensor, taken: Tensor | None = None) -> Tensor:
    """The :data:`BLOCK_COLUMNS` classes farthest from the optimality condition (sorted),
    those ``taken`` (the block of the step under way) left out."""
    score = torch.where(x > 0, (ratio - 1.0).abs(), ratio - 1.0)
    if taken is not None:
        score[taken] = -torch.inf
    return score.topk(BLOCK_COLUMNS).indices.sort().values


def newton_weights(
    source: LogitSource,
    pi: Tensor,
    reduce_fn: ReduceFn,
    *,
    max_passes: int,
    below: float | None = None,
    polish: bool = False,
) -> tuple[Tensor, Tensor, int, bool]:
    r"""mix-SQP on the mixture weights from ``pi`` ``(K,)`` (module docstring).

    Args:
        source: ``(N_local, K)`` component log-likelihoods of the local shard.
        pi: ``(K,)`` starting weights (EM's); those below :data:`SUPPORT_FLOOR` of the
            largest start at 0.
        reduce_fn: sums a tensor over shards.
        max_passes: cap on passes (each one reduction).
        below: stop once :math:`\Lambda \le` ``below`` is certain (as in
            :func:`~frolic_tta.mixture.mixture_weights`).
        polish: take one more Newton step once :data:`NEWTON_TOL` is reached: the steps
            converge quadratically, so the point is then the maximiser up to rounding, not
            wherever the path crossed the tolerance (the same on any number of shards).

    Returns:
        ``(pi (K,), [l(pi), l(1/K)], passes, converged)``: ``converged`` when the
        optimality gap is at most :data:`KKT_TOL` (or ``below`` is certain).
    """
    k = source.num_classes
    x = pi.double().clone()
    x[x < SUPPORT_FLOOR * float(x.max())] = 0.0
    x /= x.sum()

    def measure(weights: Tensor, columns: Tensor | None = None) -> tuple[Tensor, ...]:
        packed = reduce_fn(_sums(source, weights, columns))
        n, log_u = packed[0], packed[1]
        uniform = packed[2] - n * math.log(k)  # l(1/K)
        gradient = packed[3 : 3 + k]
        size = 0 if columns is None else int(columns.numel())
        hessian = packed[3 + k :].reshape(size, size) / n
        total = weights.sum()
        objective = -log_u / n + total  # F(x)
        likelihood = log_u - n * torch.log(total)  # l(x / sum x)
        kkt = float(total * gradient.max() / n - 1.0)
        return n, objective, likelihood, uniform, gradient, hessian, kkt

    n, objective, likelihood, uniform, gradient, _, kkt = measure(x)
    passes, converged = 1, False
    hessian, at_columns = None, None  # the Hessian at x, over the classes at_columns
    if kkt > 1.0:  # mixed with the uniform weights of the support and the classes asking in
        support = ((x > 0) | (gradient / n > 1.0)).double()
        x = (1.0 - UNIFORM_MIX) * x + UNIFORM_MIX * support / support.sum()
        n, objective, likelihood, uniform, gradient, _, kkt = measure(x)
        passes += 1
    polishing = False
    while passes < max_passes:
        gap = headroom(float(n), kkt)
        if below is not None and 2.0 * float(likelihood - uniform + gap) <= below:
            converged = True
            break
        columns = ((x > 0) | (gradient / n > 1.0)).nonzero().squeeze(1)
        blocked = columns.numel() > MAX_COLUMNS
        if kkt <= (KKT_TOL if blocked else NEWTON_TOL):
            if not polish or polishing:
                break
            polishing = True  # one step past the tolerance
        fresh = hessian is None or at_columns is None
        if blocked:  # this step on the block whose Hessian the last pass brought, the next on
            # x's worst classes outside it: its Hessian comes with the trial (one pass a step)
            columns = _block(x, gradient / n) if fresh else at_columns
            ahead = _block(x, gradient / n, columns)
        else:
            ahead = columns  # the classes of the next step's Hessian, measured with the trial
        if hessian is None or not torch.equal(columns, at_columns):  # else the trial's
            *_, hessian, _ = measure(x, columns)
            passes += 1
            if passes >= max_passes:
                break
        step_gradient = 1.0 - gradient[columns] / n
        linear = hessian @ x[columns] - step_gradient
        tol = NEWTON_TOL / 10 + 1e-13 * float(linear.abs().max())  # b - Hy's rounding
        target = _nonnegative_qp(hessian, linear, x[columns], tol)
        direction = torch.zeros_like(x)
        direction[columns] = target - x[columns]
        slope = float(step_gradient @ direction[columns])
        if blocked:  # the classes outside the block take EM's step in the same trial
            held = torch.ones_like(x, dtype=torch.bool)
            held[columns] = False
            rate = gradient[held] / n - 1.0  # -dF/dx_j: EM moves x_j to x_j (1 + rate_j)
            direction[held] = x[held] * rate
            slope -= float((x[held] * rate * rate).sum())
        if slope >= 0.0:  # no descent left at this precision
            if blocked and not fresh:  # on this block: the next one from x's gradient
                hessian = at_columns = None
                continue
            break
        step, accepted = 1.0, False
        while passes < max_passes and step >= 1e-12:  # backtracking (Armijo) on F
            trial = (x + step * direction).clamp_(min=0.0)
            measured = measure(trial, ahead)  # its Hessian serves the next step
            passes += 1
            if float(measured[1]) <= float(objective) + 1e-4 * step * slope:
                accepted = True
                break
            if polishing:  # within the tolerance F's change is rounding: the gap decides
                accepted = measured[-1] <= kkt
                break
            step /= 2.0
        if not accepted:  # no progress at this precision (flagged if above KKT_TOL)
            break
        x, at_columns = trial, ahead
        n, objective, likelihood, uniform, gradient, hessian, kkt = measured
    converged = converged or kkt <= KKT_TOL
    return x / x.sum(), torch.stack([likelihood, uniform]), passes, converged
