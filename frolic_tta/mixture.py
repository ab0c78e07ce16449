r"""Maximum-likelihood mixture weights for fixed components (behind :mod:`frolic_tta.prior`).

The GDA head is a Gaussian mixture with a shared covariance (Section 3.2),
:math:`p(x) = \sum_j \pi_j\,\mathcal N(x; \mu_j, \Sigma)`. With the components fixed, the
weights maximise the concave :math:`\ell(\pi) = \sum_i \ln\sum_j \pi_j e^{g_{ij}}`
(maximum-likelihood label shift, Saerens et al. 2002): EM steps on :math:`\pi` with SQUAREM,
each one pass over stored component log-likelihoods and one ``reduce_fn`` call, every stop test
on reduced values.

Shapes: N samples, K classes, d embedding dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from frolic_tta.logits import (
    EXACT_PRODUCTS,
    LogitSource,
    ReduceFn,
    flushed_exp,
    identity_reduce,
    workspace,
)
from frolic_tta.mixture_newton import KKT_TOL, MAX_COLUMNS, headroom, newton_weights
from frolic_tta.squarem import squarem_jump
from frolic_tta.weight_bound import SecondWeights, segment_bound


@dataclass(frozen=True)
class _MixtureSums:
    """Named pieces of one pass of the mixture's likelihood over a shard (packed for one
    reduction)."""

    count: Tensor  # ()
    log_likelihood: Tensor  # () sum_i lse(g_i + ln pi)
    uniform_log_likelihood: Tensor  # () sum_i lse(g_i) - N ln K
    responsibility: Tensor  # (K,) sum_i q_i
    gradient: Tensor  # (K,) d l / d pi_j = sum_i e^{g_ij} / sum_k pi_k e^{g_ik}
    ceiling: float = math.inf  # a bound on max_pi l of the same pass (segment_pass), not packed

    def pack(self) -> Tensor:
        head = torch.stack([self.count, self.log_likelihood, self.uniform_log_likelihood])
        return torch.cat([head, self.responsibility, self.gradient])

    @classmethod
    def unpack(cls, packed: Tensor) -> _MixtureSums:
        k = (packed.shape[0] - 3) // 2
        return cls(packed[0], packed[1], packed[2], packed[3 : 3 + k], packed[3 + k :])

    def optimality_gap(self) -> float:
        r""":math:`\max_j \partial_j\ell / N - 1`, 0 at the maximiser (times N: the
        Frank-Wolfe gap)."""
        return float(self.gradient.max() / self.count) - 1.0

    def headroom(self) -> float:
        """:func:`headroom` of this pass, or the segment's (:func:`segment_pass`) where lower:
        what the weights can still gain."""
        cover = headroom(float(self.count), self.optimality_gap())
        return min(cover, self.ceiling - float(self.log_likelihood))


ChunkHook = Callable[[Tensor, Tensor, Tensor], None]
r"""Called with each chunk's ``(e, top, norm)``: :math:`e_{ij} = \exp(g_{ij} - \max_k g_{ik})`
``(n, K)``, :math:`\max_k g_{ik}` ``(n, 1)`` and :math:`(e w)_i` ``(n,)`` (:func:`_mixture_sums`);
``e`` is overwritten after the call."""


def _mixture_sums(
    source: LogitSource, log_prior: Tensor, hook: ChunkHook | None = None
) -> _MixtureSums:
    r"""One pass over the component log-likelihoods ``g`` of the local shard (float64 sums).

    One exponential per entry: with :math:`e_{ij} = \exp(g_{ij} - \max_k g_{ik})` and the
    weights scaled to :math:`w = \pi/\max_k\pi_k`, both log-partitions are
    :math:`\max_k g_{ik} + \ln\sum_j e_{ij}` and :math:`\ldots + \ln (e w)_i + \ln\max_k\pi_k`,
    and the responsibilities' column sums :math:`w_j \sum_i e_{ij}/(e w)_i` (a row's
    :math:`(e w)_i` is floored at float32's smallest normal, reached only where its classes'
    weights are below :math:`10^{-38}` of the largest).

    Where the passes are not exact (:func:`~frolic_tta.logits.exact_arithmetic`: large
    :math:`NKd`), both row sums come from one ``(n, K) x (K, 2)`` product and the column sums
    from the vector-matrix product :math:`(1/(e w))^\top e`: two reads of :math:`e` and no
    second chunk-sized temporary (ImageNet size on 2 cores of an Intel Xeon: 113-120 ms a
    pass before, 77-78 ms; ``benchmarks/sweeps.py``); exact passes keep the elementwise form,
    with float64 column sums, so their result does not depend on the chunks.
    """
    k = source.num_classes
    top_prior = float(log_prior.max())
    weights = torch.exp(log_prior - top_prior)
    work: Tensor | None = None  # chunk-sized temporaries (two where exact) for every chunk
    # packed as _MixtureSums.pack() and summed where the chunks are (float64, added in the same
    # order as on the host): no synchronisation a chunk, one copy to the host a pass
    packed = torch.zeros(3 + 2 * k, dtype=torch.float64)
    total, responsibility, gradient = packed[:3], packed[3 : 3 + k], packed[3 + k :]
    scaled = both = None
    for _, logits in source.chunks():
        if scaled is None or scaled.device != logits.device or scaled.dtype != logits.dtype:
            scaled = weights.to(logits)  # the weights' one copy to the device
            both = torch.stack([scaled, torch.ones_like(scaled)], dim=1)  # (K, 2): w and 1
            packed = packed.to(logits.device)
            total, responsibility, gradient = packed[:3], packed[3 : 3 + k], packed[3 + k :]
        tiny, n = torch.finfo(logits.dtype).tiny, logits.shape[0]
        top = logits.amax(dim=1, keepdim=True)
        work = workspace(work, logits, 2 if source.exact else 1)
        exp = flushed_exp(torch.sub(logits, top, out=work[0]))
        if source.exact:
            norm = torch.mul(exp, scaled, out=work[1]).sum(1).clamp_(min=tiny)  # (n,), pairwise
            plain = exp.sum(1)
        else:  # (e w)_i and sum_j e_ij in one (n, K) x (K, 2) product: one read of e
            rows = exp @ both
            norm, plain = rows[:, 0].clamp_(min=tiny), rows[:, 1]
        if hook is not None:
            hook(exp, top, norm)
        total[0] += n
        top = top.squeeze(1).double()
        total[1] += (top + norm.log().double()).sum() + n * top_prior
        total[2] += (top + plain.log().double()).sum() - n * math.log(k)
        if source.exact:  # sums over samples in float64: no rounding that follows the chunks
            column = exp.div_(norm.unsqueeze(1)).double().sum(0)
            weighted = scaled.double()
        else:  # sum_i e_ij / (e w)_i as a vector-matrix product: no (n, K) write
            column, weighted = norm.reciprocal() @ exp, scaled
        responsibility += (column * weighted).double()
        gradient += column.double()
    sums = _MixtureSums.unpack(packed.cpu())
    sums.gradient.div_(math.exp(top_prior))  # d l / d pi_j = sum_i e_ij / (pi_max (e w)_i)
    return sums


NEWTON_AFTER = 100
"""EM passes after which a solve that has not converged goes on by Newton steps
(:mod:`frolic_tta.mixture_newton`); EM's stops in the benchmark worlds take 1 to 19."""
BLOCK_AFTER = 16
"""EM passes after which a solve with more than :data:`~frolic_tta.mixture_newton.MAX_COLUMNS`
classes goes on by block Newton steps: EM's first passes clear most of the gap, then it crawls
(ImageNet-21k, N = 30,000: gap 3.4 to 4e-3 in 20 passes, 1.5e-3 after 71)."""
WARM_BLOCK_AFTER = 4
"""The same where ``init`` is given (a warm start, the rounds of :mod:`frolic_tta.prior`): its
gap comes from classes whose weight the last solve set to 0, which EM cannot revive (21k world,
a perturbed round: gap 6.35e-2 at pass 4 and at pass 17; 16 passes in all against 33)."""
SETTLE_SHARE = 1e-3
r"""An intermediate solve (``settle``) stops once a cycle of EM passes gains at most this share
of :math:`(K-1)/2` nats, the mean of :math:`\ell(\hat\pi) - \ell(\pi)` at the true weights
(:math:`\chi^2_{K-1}/2`): where EM converges at a rate of 0.9 a cycle or faster, what is left is
then below 1 % of it, which puts the weights within a tenth of the estimate's own sampling
spread of the maximiser (:math:`\sqrt{0.01}`, in the Fisher metric)."""


def mixture_weights(
    source: LogitSource,
    init: Tensor | None = None,
    *,
    tol: float = 1e-9,
    max_passes: int = 500,
    reduce_fn: ReduceFn | None = None,
    below: float | None = None,
    ceiling: float | None = None,
    lift: Callable[[], float] | None = None,
    settle: bool = False,
    towards: Tensor | None = None,
) -> tuple[Tensor, float, int, bool]:
    r"""Maximum-likelihood mixture weights for fixed component log-likelihoods.

    Maximises :math:`\ell(\pi) = \sum_i \ln\sum_j \pi_j e^{g_{ij}}` over the simplex by EM
    (:math:`\pi \leftarrow \frac1N\sum_i \mathrm{softmax}(g_i + \ln\pi)`), two steps at a time
    extrapolated by SQUAREM's S3 step and kept only if the likelihood does not drop.
    :math:`\ell` is concave, so the maximiser is unique where the components are distinct.
    Converged means optimal: the EM step moved :math:`\pi` by less than ``tol`` *and* the
    optimality gap :math:`\max_j \partial_j\ell/N - 1` is at most
    :data:`~frolic_tta.mixture_newton.KKT_TOL`. A solve not converged after
    :data:`NEWTON_AFTER` passes, or whose step test stopped with the gap open, goes on by
    Newton steps (:func:`~frolic_tta.mixture_newton.newton_weights`) within ``max_passes``.
    Where ``source.exact`` and :math:`N K^2 \le` :data:`~frolic_tta.logits.EXACT_PRODUCTS`,
    EM's step test always hands over to those steps, which end one step past their
    tolerance: the fixed point, not wherever EM's path crossed ``tol``.

    Args:
        source: ``(N_local, K)`` component log-likelihoods :math:`g` of the local shard.
        init: ``(K,)`` starting weights (default uniform).
        tol: stop when an EM step moves :math:`\pi` by less than ``tol`` in L1 (with float32
            ``g`` a step's rounding is ~1e-9: keep ``tol`` >= 1e-8).
        max_passes: cap on passes (each one reduction).
        reduce_fn: sums a tensor over shards.
        below: stop as soon as :math:`\Lambda \le` ``below`` is certain: at any :math:`\pi`,
            :func:`headroom` bounds what is left, :math:`\ell(\hat\pi) - \ell(\pi) \le
            N \ln(\max_j \partial_j\ell / N)`, :math:`\partial_j\ell = \sum_i r_{ij}/\pi_j`
            (:math:`r` the responsibilities); the weights and :math:`\Lambda` returned are
            then those of that :math:`\pi` (a lower bound), and ``converged`` is true: the
            decision they feed is exact.
        ceiling: stop as soon as :math:`\ell(\hat\pi) \le` ``ceiling`` is certain
            (:math:`\ell(\pi)` plus :func:`headroom`; as ``below``, on :math:`\ell` itself:
            :func:`~frolic_tta.evidence.compare_mixtures` stops there once the other model
            wins whatever the weights).
        lift: called once, with no argument, where :math:`\ell(\pi)` passes ``ceiling`` in
            EM's passes (the ceiling can no longer stop the solve): a higher ceiling, which
            replaces it (:func:`~frolic_tta.evidence.compare_mixtures`: the other model at
            its own weights, whose passes it would otherwise spend after this solve). The
            path is unchanged: only where the solve stops.
        settle: the weights only seed the next refit of :mod:`frolic_tta.prior` (an
            intermediate round): where EM would hand over to block Newton steps (K >
            :data:`~frolic_tta.mixture_newton.MAX_COLUMNS`), stop once a cycle of EM passes
            gains at most :data:`SETTLE_SHARE` :math:`(K-1)/2` nats and :math:`\Lambda >`
            ``below`` is certain (``converged`` true), instead of chasing the last nats through
            the block steps' tail (issue 35, item 2's 21k world at N = 30,000: the three
            seeding solves 9, 3 and 3 passes instead of 27, 18 and 14). Elsewhere it changes
            nothing.
        towards: ``(K,)`` positive weights: every pass also bounds what is left on the segment
            from its weights to these (:func:`segment_pass`), for ``below`` and ``ceiling``.

    Returns:
        ``(pi (K,), Lambda, passes, converged)`` with :math:`\Lambda = 2(\ell(\hat\pi) -
        \ell(\mathbf 1/K))` clamped at 0; ``converged`` false where ``max_passes`` ran out.
    """
    reduce_fn = reduce_fn or identity_reduce
    k = source.num_classes
    tiny = torch.finfo(torch.float64).tiny
    pi = torch.full((k,), 1.0 / k, dtype=torch.float64) if init is None else init.double()

    last: list[_MixtureSums] = []  # the latest pass's sums

    def step(prior: Tensor) -> tuple[Tensor, _MixtureSums]:
        # the segment only while it can still stop the solve: once l(pi) has passed the mark
        # (below, the ceiling's), no bound on max l can put it under (M's solve where M wins)
        spent = bool(last) and below is not None and lam(last[0]) > below
        new, at = segment_pass(source, prior, None if spent else towards, reduce_fn)
        last[:] = [at]
        return new, at

    def lam(at: _MixtureSums, gap: float = 0.0) -> float:  # Lambda at pi (+ gap: a bound)
        return 2.0 * (float(at.log_likelihood - at.uniform_log_likelihood) + gap)

    def certain(at: _MixtureSums, prior: Tensor) -> bool:
        if below is None:
            return False
        return lam(at, at.headroom()) <= below

    def undecided(at: _MixtureSums) -> bool:  # Lambda <= below is still possible
        return below is not None and lam(at) <= below

    block_after = BLOCK_AFTER if init is None else WARM_BLOCK_AFTER
    passes, converged = 0, False
    first, at_pi = step(pi)
    passes += 1
    given = below

    def capped(top: float) -> float | None:  # l(1/K) is the same at every pass: a bound on
        limit = 2.0 * (top - float(at_pi.uniform_log_likelihood))  # Lambda
        return limit if given is None else min(given, limit)

    if ceiling is not None:
        below = capped(ceiling)

    def lifted() -> bool:  # l(pi) is past the ceiling: the higher one, once
        nonlocal below, lift
        if lift is None or ceiling is None or not float(at_pi.log_likelihood) > ceiling:
            return False
        below, lift = capped(lift()), None
        return True

    # where the passes are exact and the Newton phase's Hessian is cheap (N K^2 <=
    # EXACT_PRODUCTS), EM's step test hands over to Newton, which ends at the fixed point (one
    # step past its tolerance): EM converges linearly, so on a flat likelihood a step below
    # tol can leave pi-hat far from the maximiser, at a point that follows the path (on
    # tests/data/encoder_world.pt 1 and 2 shards stopped 1.7e-4 apart; now 1e-14)
    polish = source.exact and k <= MAX_COLUMNS and float(at_pi.count) * k * k <= EXACT_PRODUCTS
    settle = settle and k > MAX_COLUMNS
    gain, enough = math.inf, SETTLE_SHARE * (k - 1) / 2.0  # gain: of the last cycle of EM
    while passes < max_passes:
        lifted()
        if certain(at_pi, pi) or (settle and gain <= enough and not undecided(at_pi)):
            converged = True
            break
        if float((first - pi).abs().sum()) < tol:
            pi, converged = first, at_pi.optimality_gap() <= KKT_TOL and not polish
            break
        if passes >= (NEWTON_AFTER if k <= MAX_COLUMNS else block_after):
            break
        second, at_first = step(first)
        passes += 1
        if certain(at_first, first):  # settled one EM step on: not the jump's pass
            pi, at_pi, converged = first, at_first, True
            break
        candidate = squarem_jump(pi, first, second, tiny)
        after, at_candidate = step(candidate)
        passes += 1
        if candidate is not second and float(at_candidate.log_likelihood) < float(
            at_first.log_likelihood
        ):  # the jump lost likelihood: continue from the plain EM steps
            candidate = second
            after, at_candidate = step(candidate)
            passes += 1
        if settle:
            gain = float(at_candidate.log_likelihood - at_pi.log_likelihood)
        pi, first, at_pi = candidate, after, at_candidate
    likelihood, uniform = at_pi.log_likelihood, at_pi.uniform_log_likelihood
    if not converged and passes < max_passes and lifted() and certain(at_pi, pi):
        converged = True  # the higher ceiling stops it where EM handed over
    if not converged and passes < max_passes:  # EM crawls: Newton steps on the same problem
        pi, (likelihood, uniform), more, converged = newton_weights(
            source, pi, reduce_fn, max_passes=max_passes - passes, below=below, polish=polish
        )
        passes += more
    ratio = max(0.0, 2.0 * float(likelihood - uniform))
    return pi, ratio, passes, converged


def log_likelihood(source: LogitSource, prior: Tensor, reduce_fn: ReduceFn) -> tuple[float, float]:
    r"""One pass: :math:`\ell(\pi) = \sum_i \ln\sum_j \pi_j e^{g_{ij}}` over all shards, and
    its :func:`headroom` :math:`\ge \max_{\pi'}\ell(\pi') - \ell(\pi)` (0 at the maximiser),
    both reduced.

    Args:
        source: ``(N_local, K)`` component log-likelihoods :math:`g` of the local shard.
        prior: ``(K,)`` the weights :math:`\pi` (positive).
        reduce_fn: sums a tensor over shards.
    """
    _, sums = _em_pass(source, prior, reduce_fn)
    return float(sums.log_likelihood), sums.headroom()


def log_likelihood_beside(
    source: LogitSource, prior: Tensor, reduce_fn: ReduceFn, beside: Callable[[], Tensor]
) -> tuple[float, Tensor]:
    r""":func:`log_likelihood`'s :math:`\ell(\pi)` (one pass), with more sums of the same pass
    reduced in its one ``reduce_fn`` call: ``beside()``, a 1-D float64 tensor of the local
    shard, called once the pass is over (``source``'s chunks may gather it as they are read).
    Returns :math:`\ell(\pi)` and ``beside``'s sums over all shards."""
    _, sums, extra = em_pass_beside(source, prior, reduce_fn, beside)
    return float(sums.log_likelihood), extra


def _em_pass(
    source: LogitSource, prior: Tensor, reduce_fn: ReduceFn
) -> tuple[Tensor, _MixtureSums]:
    """One reduced pass at ``prior`` ``(K,)``: the EM step from it and the pass's sums."""
    step, sums, _ = em_pass_beside(source, prior, reduce_fn, _nothing)
    return step, sums


def _nothing() -> Tensor:
    return torch.zeros(0, dtype=torch.float64)


def segment_pass(
    source: LogitSource, prior: Tensor, towards: Tensor | None, reduce_fn: ReduceFn
) -> tuple[Tensor, _MixtureSums]:
    r""":func:`_em_pass` whose sums also bound :math:`\max_\pi \ell` on the segment from
    ``prior`` to ``towards`` (positive; :mod:`frolic_tta.weight_bound`), in the same pass and
    reduction: their ``headroom()`` is the lower of that and Cover's (``None``: Cover's)."""
    if towards is None:
        return _em_pass(source, prior, reduce_fn)
    paired = SecondWeights(prior, towards, source.exact)
    step, sums, extra = em_pass_beside(source, prior, reduce_fn, paired.sums, paired.add)
    return step, replace(sums, ceiling=segment_bound(float(sums.count), sums.gradient, extra))


def em_pass_beside(
    source: LogitSource,
    prior: Tensor,
    reduce_fn: ReduceFn,
    beside: Callable[[], Tensor],
    hook: ChunkHook | None = None,
) -> tuple[Tensor, _MixtureSums, Tensor]:
    """:func:`_em_pass` with ``beside()``'s sums reduced in the same call (as
    :func:`log_likelihood_beside`), ``hook`` called on every chunk's exponentials:
    ``(step, sums, beside's sums)``."""
    local = _mixture_sums(source, log_weights(prior), hook).pack()
    extra = beside().to(local)
    packed = reduce_fn(torch.cat([local, extra]))
    sums = _MixtureSums.unpack(packed[: local.shape[0]])
    new = sums.responsibility / sums.count
    return new / new.sum(), sums, packed[local.shape[0] :]


def log_weights(prior: Tensor) -> Tensor:
    """``ln prior`` ``(K,)`` in float64, zeros floored at float64's smallest normal."""
    return prior.double().clamp(min=torch.finfo(torch.float64).tiny).log()
