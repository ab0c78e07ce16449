r"""Class-mass matching: the convex problem behind the label bias, the Oracle and the test prior.

Given logits :math:`f` (N, K) whose softmax is a model's posterior under its pre-training prior
:math:`\beta`, and a test prior :math:`\pi` (K,), the debiased test posterior is

.. math::
    q_i = \mathrm{softmax}(f(x_i) - \ln\beta + \ln\pi)\qquad\text{(Eq. 13, with a test prior)}.

Proposition 2 (Eq. 14) characterises :math:`\beta` by :math:`\beta = S\beta`; with the class
means of :math:`S` weighted by :math:`q` this fixed point is exactly where the debiased class
masses equal the test prior, :math:`\frac1N\sum_i q_{ij} = \pi_j` (for :math:`\pi` uniform:
the paper's balanced test set). That is the stationary point of the convex

.. math::
    J(b) = \frac1N\sum_i \operatorname{lse}(f_i + \ln\pi - b) + \pi^\top b,
    \qquad b = \ln\beta + \text{const}.

With true labels, :math:`\pi` = the label frequencies and :math:`J` is the cross-entropy of the
debiased logits (GLA's supervised prior estimate): the Oracle.

**Bound.** Where posteriors are hard (:math:`S \approx I`) the masses move only when a decision
boundary crosses samples, so :math:`J` keeps decreasing as some :math:`b_j` runs off: the data
do not determine :math:`\hat\beta`. :math:`J` does not change when a constant is added to
:math:`b`, so a box :math:`b \in [-\text{bound}, \text{bound}]^K` bounds
:math:`\max\hat\beta/\min\hat\beta \le e^{2\,\text{bound}}` (without ``bound``, the
``prior_floor`` sets it). Classes at the box, and classes whose bias moves less than one
sample's worth of posterior mass (:math:`N h_j < 1`, with
:math:`h_j = \frac1N\sum_i q_{ij}(1 - q_{ij})`), are reported as undetermined. The stop test
leaves the latter out: where every class is undetermined (zero-shot right on every sample) the
masses are matched in a few passes while :math:`\hat\beta` would go on moving for ever.

:func:`match_class_masses` minimises :math:`J` on the box by projected Newton steps
preconditioned with the diagonal curvature :math:`h_j` and Armijo backtracking: one pass over the
logits and one ``reduce_fn`` call per trial point. Where hard posteriors couple the classes
(a step no longer halves the gradient), it switches to Newton steps on the full Hessian
:math:`H = \frac1N(\mathrm{diag}(m) - \sum_i q_i q_i^\top)` (a K x K sum from the same pass, one
(K, N) x (N, K) product per chunk; solved by a certified Cholesky factorisation, an
eigendecomposition only where that fails: :mod:`frolic_tta.matching_newton`). Where
:math:`J`'s change is below the float32 rounding of its sums, the projected gradient's L1 norm
decides a step instead of Armijo's test, so the tolerance can be :math:`10^{-6}` (the same
fixed point on any number of shards).
Shapes: N samples, K classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from frolic_tta.logits import LogitSource, ReduceFn, identity_reduce
from frolic_tta.matching_newton import newton_direction
from frolic_tta.sweeps import Exponentials, exponentials, unnormalised


def floored(prior: Tensor, prior_floor: float) -> Tensor:
    r"""``prior`` (K,) with every entry at least ``prior_floor`` / K, renormalised (float64, CPU):
    the one floor of every prior in the package (:math:`\hat\beta`, :math:`\tilde\pi`), so
    its log is finite and no class becomes an absorbing state."""
    prior = prior.to(torch.float64).cpu().clamp(min=prior_floor / prior.shape[0])
    return prior / prior.sum()


_ROUNDING = 8 * torch.finfo(torch.float32).eps
"""Relative change of :math:`J` below which its float32 sums cannot tell a decrease (the logits'
per-row log-partitions carry float32 rounding); there the projected gradient decides a step."""

FULL_HESSIAN_MAX_CLASSES = 4096
"""Above this K the matching keeps its diagonal steps (a K x K float64 Hessian would hold
more than 128 MiB and its factorisation take seconds per step)."""

_DIAGONAL_STEP = 3.0
r"""Largest :math:`|\Delta b_j|` of a diagonal step above :data:`FULL_HESSIAN_MAX_CLASSES` (10
below): longer ones overshoot where many classes are nearly undetermined and are halved every
other pass (issue 35 item 2's 21k world, N = 30,000, zero-shot logits at 4 sharpnesses, cold:
10, 7, 10, 14 passes with 3 against 12, 10, 13, 19 with 10; 5: up to 23, 2: up to 16)."""

_FLAT = 1e-3
"""Classes whose bias moves less than this much of one sample's mass (:math:`N h_j`) are flat:
they take diagonal steps (towards the bound), never a Newton step on the full Hessian."""


@dataclass(frozen=True)
class MassMatch:
    r"""Result of :func:`match_class_masses`.

    Attributes:
        beta: ``(K,)`` :math:`\hat\beta`, positive, sums to 1.
        log_offset: ``(K,)`` :math:`\ln\pi - \ln\hat\beta` added to the logits (the debiased
            logits are ``f + log_offset``).
        undetermined: ``(K,)`` bool, classes whose :math:`\hat\beta_j` the data do not
            determine (at the bound, or :math:`N h_j < 1`).
        mass_error: :math:`\|m - \pi\|_1` of the debiased class masses :math:`m` at the end.
        converged: stopped by the tolerance, not by ``max_iter``.
        evaluations: passes over the logits.
        exponentials: the logits' :class:`Exponentials` in the buffer lent as ``spare``
            (valid until its owner overwrites it), or ``None``.
    """

    beta: Tensor
    log_offset: Tensor
    undetermined: Tensor
    mass_error: float
    converged: bool
    evaluations: int
    exponentials: Exponentials | None = None


@dataclass(frozen=True)
class _MassSums:
    """Named sums of one pass over the logits of a shard (float64), packed for one reduction."""

    count: Tensor  # () N
    log_partition: Tensor  # () sum_i lse(f_i + shift)
    mass: Tensor  # (K,) sum_i q_i, the class masses
    curvature: Tensor  # (K,) sum_i q_i (1 - q_i)
    outer: Tensor | None = None  # (K, K) sum_i q_i q_i^T, where the full Hessian is wanted

    def pack(self) -> Tensor:
        pieces = [torch.stack([self.count, self.log_partition]), self.mass, self.curvature]
        return torch.cat(pieces + ([] if self.outer is None else [self.outer.flatten()]))

    @classmethod
    def unpack(cls, packed: Tensor, k: int) -> _MassSums:
        outer = packed[2 * k + 2 :].view(k, k) if packed.shape[0] > 2 * k + 2 else None
        return cls(packed[0], packed[1], packed[2 : k + 2], packed[k + 2 : 2 * k + 2], outer)

    def reduce(self, reduce_fn: ReduceFn) -> _MassSums:
        """The sums over all shards: one ``reduce_fn`` call."""
        return _MassSums.unpack(reduce_fn(self.pack()), self.mass.shape[0])


def _sums(
    source: LogitSource, shift: Tensor, outer: bool = False, exp: Exponentials | None = None
) -> _MassSums:
    r"""The :class:`_MassSums` of the local shard at ``shift`` (K,); with ``outer``, also
    :math:`\sum_i q_i q_i^\top` (one (K, N) x (N, K) product per chunk).

    One exponential per entry, in place, or none with ``exp`` (:class:`Exponentials`);
    column sums in the logits' dtype (pairwise, so their rounding stays far below the
    tolerances), accumulated in float64; in float64 throughout where ``source.exact``
    (:func:`~frolic_tta.logits.exact_arithmetic`).
    """
    k = shift.shape[0]
    count = torch.zeros((), dtype=torch.float64)
    # summed where the chunks are: no synchronisation a chunk, one copy to the host a pass
    sums = torch.zeros(1 + 2 * k, dtype=torch.float64)
    log_partition, mass, curvature = sums[0], sums[1 : 1 + k], sums[1 + k :]
    products = None
    for posterior, top in unnormalised(source, shift, exp):
        if sums.device != posterior.device:
            sums = sums.to(posterior.device)
            log_partition, mass, curvature = sums[0], sums[1 : 1 + k], sums[1 + k :]
        norm = posterior.sum(dim=1, keepdim=True)
        posterior.div_(norm)
        count += posterior.shape[0]
        log_partition += (top + norm.log()).sum(dtype=torch.float64)
        if outer:  # the Newton direction only: its rounding moves the path, not the fixed point
            product = (posterior.T @ posterior).double()
            products = product if products is None else products.add_(product)
        if source.exact:  # sums over samples in float64: no rounding that follows the chunks
            posterior = posterior.double()
        column = posterior.sum(0)
        mass += column.double()
        curvature += (column - posterior.square_().sum(0)).double()
    if outer:
        products = torch.zeros(k, k, dtype=torch.float64) if products is None else products.cpu()
    sums = sums.cpu()
    return _MassSums(count, sums[0], sums[1 : 1 + k], sums[1 + k :], products)


def match_class_masses(
    source: LogitSource,
    target: Tensor | None = None,
    *,
    bound: float | None = None,
    eps: float = 0.01,
    max_iter: int = 100,
    prior_floor: float = 1e-30,
    reduce_fn: ReduceFn | None = None,
    init: Tensor | None = None,
    spare: Tensor | None = None,
) -> MassMatch:
    r"""Minimise :math:`J(b)` (module docstring): :math:`\hat\beta` whose debiased class masses
    equal ``target``.

    Args:
        source: the logits :math:`f` of the local shard.
        target: ``(K,)`` test prior :math:`\pi` (positive, sums to 1); ``None``: uniform.
        bound: half the largest :math:`\ln(\max\hat\beta/\min\hat\beta)` (``None``: set by
            ``prior_floor``).
        eps: stop when the next diagonal step would move :math:`\hat\beta` by less than
            :math:`\epsilon` in L1 and the projected gradient's L1 norm (the class-mass error
            where no bound is active) is :math:`< \epsilon`; the step of the classes the data
            do not determine (:math:`N h_j < 1`) is left out of that test (with hard
            posteriors their diagonal steps never shrink: a fixed point in the masses).
        max_iter: cap on passes.
        prior_floor: :math:`\hat\beta_j \ge` ``prior_floor`` / K.
        reduce_fn: sums a tensor over shards (identity by default).
        init: ``(K,)`` a :math:`\hat\beta` to start from (a warm start, e.g. the solution for a
            nearby ``target``); default uniform.
        spare: a ``(N_local, K)`` buffer of the logits' dtype the caller lends (overwritten):
            the logits' :class:`Exponentials` are computed into it once and the passes take
            no exponential (where the logits' and the bias's ranges allow, :data:`_EXP_RANGE`).
    """
    reduce_fn = reduce_fn or identity_reduce
    k = source.num_classes
    if target is None:
        target = torch.full((k,), 1.0 / k, dtype=torch.float64)
    target = target.to(torch.float64).cpu()
    log_target = torch.log(target.clamp(min=prior_floor / k))
    box = math.log(k / prior_floor) / 2 if bound is None else float(bound)

    exp = None if spare is None or max_iter < 3 else exponentials(source, spare)
    reach = _DIAGONAL_STEP if k > FULL_HESSIAN_MAX_CLASSES else 10.0

    def evaluate(b: Tensor, outer: bool) -> tuple[float, Tensor, _MassSums]:
        sums = _sums(source, log_target - b, outer, exp).reduce(reduce_fn)
        n = float(sums.count)
        return float(sums.log_partition) / n + float(target @ b), target - sums.mass / n, sums

    def blocked(b: Tensor, gradient: Tensor) -> Tensor:
        # J is invariant to adding a constant to b, so the box [-bound, bound] fixes the gauge
        return ((b >= box) & (gradient < 0)) | ((b <= -box) & (gradient > 0))

    def projected(b: Tensor, gradient: Tensor) -> Tensor:
        return torch.where(blocked(b, gradient), torch.zeros_like(gradient), gradient)

    def search_direction(
        b: Tensor, gradient: Tensor, sums: _MassSums, hessian: _MassSums | None
    ) -> Tensor:
        diagonal = gradient * sums.count / sums.curvature.clamp(min=1e-12 * float(sums.count))
        diagonal = torch.where(blocked(b, gradient), 0.0, diagonal.clamp(-reach, reach))
        if hessian is None:
            return diagonal
        # classes moved by less than one sample's mass (N h_j < 1) are flat: their Newton
        # steps would be rounding noise, so they take diagonal steps towards the bound
        free = ~blocked(b, gradient) & (sums.curvature >= _FLAT)
        newton = (
            newton_direction(hessian.outer, float(hessian.count), gradient, free)
            if bool(free.any())
            else None
        )
        if newton is None or not bool(newton.isfinite().all()) or float(newton @ gradient) <= 0:
            return diagonal  # no factorisation or not a descent direction (rounding)
        newton = newton * min(1.0, 10.0 / float(newton.abs().max().clamp(min=1e-300)))
        return torch.where(free, newton, diagonal)

    b = torch.zeros(k, dtype=torch.float64)
    if init is not None:  # ln beta with the gauge fixed at mean 0, inside the box
        log_init = torch.log(init.to(torch.float64).cpu())
        b = (log_init - log_init.mean()).clamp(-box, box)
    # the diagonal Newton steps, until they stop halving the gradient; then the full Hessian
    # of the last point where it was summed, summed again when its steps stop halving it too
    hessian: _MassSums | None = None
    refresh, slow_steps = False, 0
    objective, gradient, sums = evaluate(b, False)
    norm = float(projected(b, gradient).abs().sum())
    beta = torch.softmax(b, 0)
    step_size, evaluations, converged = 1.0, 1, False
    direction: Tensor | None = None  # kept while a rejected step is retried shorter
    while evaluations < max_iter:
        if direction is None:
            direction = search_direction(b, gradient, sums, hessian)
        trial = b - step_size * direction
        # J ignores a constant added to b: where b's spread fits in the box, the least shift
        # that keeps it inside, so the gauge's drift never pushes a class into the bound
        high, low = float(trial.max()), float(trial.min())
        if high - low <= 2.0 * box:
            trial = trial - (max(0.0, high - box) - max(0.0, -box - low))
        trial = trial.clamp(-box, box)
        trial_objective, trial_gradient, trial_sums = evaluate(trial, refresh)
        evaluations += 1
        decrease = 1e-4 * float((gradient * (b - trial)).sum())  # Armijo, <= 0
        trial_norm = float(projected(trial, trial_gradient).abs().sum())
        if abs(trial_objective - objective) <= _ROUNDING * (abs(objective) + 1.0):
            # J's change is below the rounding of its float32 sums: the Armijo test would
            # accept or reject at random there, so the projected gradient decides
            accept = trial_norm < norm
        else:
            accept = trial_objective <= objective - abs(decrease)
        if not accept and step_size > 1e-6:
            step_size *= 0.5  # reject: retry a shorter step from the same point
            continue
        halved = trial_norm <= 0.5 * norm
        slow_steps = slow_steps + 1 if not halved and step_size == 1.0 else 0
        b, objective, gradient, sums = trial, trial_objective, trial_gradient, trial_sums
        norm = trial_norm
        step_size, direction = min(1.0, 2.0 * step_size), None
        new = torch.softmax(b, 0)
        change = float((new - beta).abs().sum())
        beta = new
        # the next diagonal step's change of beta-hat: what is left (the last step's change
        # overstates it where the steps converge fast, and would cost a pass more)
        step = search_direction(b, gradient, sums, None)
        ahead = (b - step).clamp(-box, box)
        next_change = float((torch.softmax(ahead, 0) - beta).abs().sum())
        if norm < eps and not halved and next_change >= eps:
            # the masses no longer improve (their float32 rounding floor): a fixed point where
            # the classes the data do not determine (N h_j < 1: their bias moves less than one
            # sample's mass) are left out, as their diagonal steps never shrink there
            step = torch.where(sums.curvature >= 1.0, step, 0.0)
            ahead = (b - step).clamp(-box, box)
            next_change = float((torch.softmax(ahead, 0) - beta).abs().sum())
        if next_change < eps and norm < eps or change == 0.0:
            converged = True
            break
        if sums.outer is not None:
            hessian, refresh = sums, False
        if not halved and hessian is not None:
            refresh = True  # the Hessian in use is stale: sum it again at the next point
        elif slow_steps >= 2 and k <= FULL_HESSIAN_MAX_CLASSES and evaluations < max_iter:
            # classes coupled through shared samples (hard posteriors): the diagonal steps
            # converge linearly there; Newton steps on the full K x K Hessian from here on
            objective, gradient, sums = evaluate(b, True)
            hessian = sums
            evaluations += 1
    curvature = sums.curvature / sums.count
    n = float(sums.count)
    at_bound = (b.abs() >= box * (1 - 1e-9)) & (projected(b, gradient) != gradient)
    beta = floored(beta, prior_floor)
    return MassMatch(
        beta=beta,
        log_offset=log_target - torch.log(beta),
        undetermined=at_bound | (curvature * n < 1.0),
        mass_error=float(gradient.abs().sum()),
        converged=converged,
        evaluations=evaluations,
        exponentials=exp,
    )
