r"""Prediction fusion via confidence matching (paper Section 3.3, Eqs. 10-12).

.. math::
    \operatorname{conf}(f, \tau) = \frac1N \sum_i \max_j \mathrm{softmax}(f(x_i)/\tau)_j
    \quad\text{(Eq. 10)},\qquad
    \tau_g = \arg\min_\tau |\operatorname{conf}(f_g, \tau) - \operatorname{conf}(f_c, \tau_c)|
    \quad\text{(Eq. 11)}.

``conf`` decreases monotonically in :math:`\tau` (from 1 at :math:`\tau\to0` to :math:`1/K`),
so Eq. 11 is a root search. It is solved on the confidence *deficit* :math:`D = 1 -
\operatorname{conf}`, summed without cancellation (:func:`_confidence_sums`): on confident data
(CLIP at :math:`\tau_c = 0.01`) :math:`\operatorname{conf}(f_c)` can be :math:`1 - 10^{-13}`,
which rounds to 1 in float32, and every small :math:`\tau` would then "match". We take Newton
steps on :math:`\ln D(u) - \ln D_c` in :math:`u = \ln\tau` (smooth even where :math:`D` is
tiny), safeguarded by a bracket (bisection when a step leaves it); the derivative is itself a
sum over samples,

.. math::
    \frac{\partial (1 - p_{\max})}{\partial \ln\tau}
    = \frac{p_{\max}\sum_{j \ne a} p_j (f_{a} - f_j)}{\tau},

so each step costs one pass over the logits and one call of ``reduce_fn``. The stop test is on
reduced values, so every shard stops at the same step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from frolic_tta.errors import warn
from frolic_tta.logits import (
    LogitSource,
    ReduceFn,
    as_source,
    flushed_exp,
    identity_reduce,
    workspace,
)
from frolic_tta.options import FUSIONS, Fusion, check_choice, check_positive
from frolic_tta.validation import check_shards_together


@dataclass(frozen=True)
class _ConfidenceSums:
    """Named sums of one pass over the logits of a shard (float64), packed for one reduction."""

    count: Tensor  # () N
    deficit: Tensor  # () sum_i (1 - pmax_i)
    growth: Tensor  # () sum_i d(1 - pmax_i)/d ln tau
    bend: Tensor  # () sum_i d^2(1 - pmax_i)/d (ln tau)^2
    margin: Tensor  # () sum_i (max_j f_ij - mean_j f_ij)

    def pack(self) -> Tensor:
        return torch.stack([self.count, self.deficit, self.growth, self.bend, self.margin])

    @classmethod
    def unpack(cls, packed: Tensor) -> _ConfidenceSums:
        return cls(*packed.unbind())

    def reduce(self, reduce_fn: ReduceFn) -> _ConfidenceSums:
        """The sums over all shards: one ``reduce_fn`` call."""
        return _ConfidenceSums.unpack(reduce_fn(self.pack()))


@dataclass(frozen=True)
class _StartSums:
    """What the search starts from, reduced together: the zero-shot sums and the margin sum
    of :math:`f_g` (its spread relative to :math:`f_c` gives the first guess)."""

    zero_shot: _ConfidenceSums
    gda_margin: Tensor  # () sum_i (max_j g_ij - mean_j g_ij)

    def reduce(self, reduce_fn: ReduceFn) -> _StartSums:
        """The sums over all shards: one ``reduce_fn`` call."""
        packed = reduce_fn(torch.cat([self.zero_shot.pack(), self.gda_margin.reshape(1)]))
        return _StartSums(_ConfidenceSums.unpack(packed[:5]), packed[5])


def _confidence_sums(
    source: LogitSource,
    temperature: float,
    margin: bool = False,
    tops: dict[int, tuple[Tensor, Tensor]] | None = None,
) -> _ConfidenceSums:
    r"""The :class:`_ConfidenceSums` of the local shard at ``temperature``.

    The confidence *deficit* :math:`1 - p_{\max}` is summed instead of :math:`p_{\max}`, and
    computed without cancellation: with :math:`e_j = \exp((f_j - f_a)/\tau)` for the top class
    :math:`a` and :math:`r = \sum_{j \ne a} e_j`, :math:`1 - p_{\max} = r/(1 + r)` and
    :math:`d(1 - p_{\max})/d\ln\tau = \sum_{j \ne a} e_j (f_a - f_j)/\tau\,/\,(1 + r)^2`. The
    top class's :math:`e_a = 1` is set to 0 before the row sums (a class tied with the top one
    keeps its :math:`e_j = 1` in :math:`r`), so :math:`r` is a float32 sum of the other terms,
    exact to float32's relative rounding however small it is: confident data keep their
    deficit (down to about 1e-38) where :math:`p_{\max}` itself rounds to 1. The top class and
    its logit do not depend on :math:`\tau`: ``tops`` (a dict, filled on the first call) keeps
    them per chunk for the search's next passes. With ``margin``, the last entry is the logit
    spread :math:`\sum_i (\max_j f_{ij} - \operatorname{mean}_j f_{ij})`, the first guess
    (else 0).
    """
    total = torch.zeros(5, dtype=torch.float64)
    work: Tensor | None = None  # two chunk-sized temporaries, reused by every chunk
    for start, logits in source.chunks():
        cached = None if tops is None else tops.get(start)
        if cached is None or cached[0].shape[0] != logits.shape[0]:
            top, where = logits.max(dim=1, keepdim=True)
            if tops is not None:
                tops[start] = (top, where)
        else:
            top, where = cached
        work = workspace(work, logits, 2)
        scaled, exp = work[0], work[1]
        torch.sub(logits, top, out=scaled).div_(temperature)  # <= 0, exactly 0 at the top
        flushed_exp(scaled, out=exp).scatter_(1, where, 0.0)  # e_j, the top class left out
        rest_sum = exp.sum(1).double()  # r, pairwise in float32: relative rounding only
        growth = exp.mul_(scaled).sum(1).neg().double()  # sum_j e_j g_j
        square = exp.mul_(scaled).sum(1).double()  # sum_j e_j g_j^2
        norm = 1.0 + rest_sum
        deficit = rest_sum / norm
        bend = (square - growth) / (norm * norm) - 2.0 * growth * growth / norm**3
        growth = growth / (norm * norm)
        spread = (top.squeeze(1) - logits.mean(1)).sum(dtype=torch.float64) if margin else 0.0
        total += torch.stack(
            [
                torch.tensor(float(logits.shape[0]), dtype=torch.float64),
                deficit.sum(dtype=torch.float64).cpu(),
                growth.sum(dtype=torch.float64).cpu(),
                bend.sum(dtype=torch.float64).cpu(),
                torch.as_tensor(spread, dtype=torch.float64).cpu(),
            ]
        )
    return _ConfidenceSums.unpack(total)


def _margin_sum(source: LogitSource) -> Tensor:
    r"""``()`` :math:`\sum_i (\max_j f_{ij} - \operatorname{mean}_j f_{ij})` of the local shard,
    float64."""
    total = torch.zeros((), dtype=torch.float64)
    for _, logits in source.chunks():
        total += float((logits.amax(1) - logits.mean(1)).sum(dtype=torch.float64))
    return total


def confidence(
    logits: Tensor | LogitSource, temperature: float, *, reduce_fn: ReduceFn | None = None
) -> float:
    r"""Mean max-softmax confidence (Eq. 10) over all shards.

    Args:
        logits: ``(N, K)`` tensor or a :class:`LogitSource`.
        temperature: :math:`\tau > 0`.
        reduce_fn: sums a tensor over shards (identity by default).
    """
    if reduce_fn is not None:  # values decided over all shards: every shard raises or none
        check_shards_together(reduce_fn, [("logits", logits)])
    reduce_fn = reduce_fn or identity_reduce
    temperature = check_positive("temperature", temperature)
    sums = _confidence_sums(as_source(logits), temperature).reduce(reduce_fn)
    return 1.0 - float(sums.deficit / sums.count)


def match_temperature(
    gda_logits: Tensor | LogitSource,
    zero_shot_logits: Tensor | LogitSource,
    tau_c: float = 0.01,
    *,
    tol: float = 1e-5,
    max_iter: int = 100,
    reduce_fn: ReduceFn | None = None,
    zero_shot_sums: tuple[float, float, float] | None = None,
) -> float:
    r"""Temperature :math:`\tau_g` whose confidence matches the zero-shot one (Eq. 11).

    Args:
        gda_logits: ``(N, K)`` :math:`f_g` (tensor or :class:`LogitSource`).
        zero_shot_logits: ``(N, K)`` unscaled :math:`f_c = x^\top z`.
        tau_c: zero-shot temperature.
        tol: stop when :math:`|\operatorname{conf}(f_g,\tau_g) - \operatorname{conf}(f_c,\tau_c)|
            \le` ``tol`` and the deficits :math:`1 - \operatorname{conf}` agree within
            ``DEFICIT_TOL`` (relative), so that confident data (conf :math:`= 1 - 10^{-13}`)
            get the root, not any temperature whose confidence rounds to 1.
        max_iter: cap on search steps (each one pass and one ``reduce_fn`` call).
        reduce_fn: sums a tensor over shards (identity by default).
        zero_shot_sums: ``(N, deficit, margin)`` of ``zero_shot_logits`` at ``tau_c`` over all
            shards, if already summed (:class:`~frolic_tta.gda.MomentSums`'
            ``zero_shot_deficit`` and ``zero_shot_margin``): the search then does not stream
            the zero-shot logits at all.

    Returns:
        :math:`\tau_g > 0`: once within tolerance one more Newton step is taken and kept only
        if it does not increase the (reduced) confidence gap, so the result is the root to
        float precision and never worse than the converged point. If the target cannot be
        reached within ``max_iter`` (for example when all :math:`f_g` rows are constant) a
        ``UserWarning`` is emitted and the best temperature found is returned.

    Raises:
        TypeError: ``tau_c`` is not a real number.
        ValueError: ``tau_c`` is not finite and > 0, or the two logits differ in N or K.
    """
    tau_c = check_positive("tau_c", tau_c)
    if reduce_fn is not None:  # values decided over all shards: every shard raises or none
        pairs = [("gda_logits", gda_logits), ("zero_shot_logits", zero_shot_logits)]
        check_shards_together(reduce_fn, pairs)
    reduce_fn = reduce_fn or identity_reduce
    gda = as_source(gda_logits, "gda_logits")
    zero_shot = as_source(zero_shot_logits, "zero_shot_logits")
    if gda.num_classes != zero_shot.num_classes:
        raise ValueError(
            "Expected `gda_logits` and `zero_shot_logits` to have the same number of classes, "
            f"but got {gda.num_classes} and {zero_shot.num_classes}"
        )
    if gda.num_samples != zero_shot.num_samples:
        raise ValueError(
            "Expected `gda_logits` and `zero_shot_logits` to have the same number of samples "
            f"(rows), but got {gda.num_samples} and {zero_shot.num_samples}"
        )
    # the target and the first guess (the spread of f_g relative to that of f_c / tau_c)
    if zero_shot_sums is None:  # one reduction for the target and f_g's margin
        first = _StartSums(_confidence_sums(zero_shot, tau_c, True), _margin_sum(gda))
        first = first.reduce(reduce_fn)
        target = float(first.zero_shot.deficit / first.zero_shot.count)  # 1 - conf(f_c, tau_c)
        margin_c, margin_g = float(first.zero_shot.margin), float(first.gda_margin)
    else:  # the target summed already: only f_g's margin is streamed
        count, deficit, margin_c = zero_shot_sums
        target, margin_g = deficit / count, float(reduce_fn(_margin_sum(gda)))
    u = math.log(tau_c * margin_g / margin_c) if margin_g > 0 and margin_c > 0 else math.log(tau_c)
    lo, hi = -math.inf, math.inf  # bracket on u: deficit(lo) <= target <= deficit(hi)
    best_u, best_err = u, math.inf
    before_polish: tuple[float, float] | None = None  # (u, |gap|) where the polish started
    tops: dict[int, tuple[Tensor, Tensor]] = {}  # f_g's top class per chunk, for every pass
    for _ in range(max_iter):
        sums = _confidence_sums(gda, math.exp(u), tops=tops).reduce(reduce_fn)
        deficit, growth = float(sums.deficit / sums.count), float(sums.growth / sums.count)
        bend = float(sums.bend / sums.count)
        err = deficit - target  # conf(f_c) - conf(f_g): > 0 means f_g is not confident enough
        if abs(err) < best_err:
            best_u, best_err = u, abs(err)
        if before_polish is not None:  # keep the polishing step only if it did not hurt
            return math.exp(u if abs(err) <= before_polish[1] else before_polish[0])
        if err > 0:
            hi = min(hi, u)  # not confident enough: temperature must shrink
        else:
            lo = max(lo, u)
        step = _halley_step(deficit, growth, bend, target)
        if abs(err) <= tol and abs(_log_ratio(deficit, target)) <= DEFICIT_TOL:
            if err == 0.0 or step is None or abs(step) <= POLISHED:
                return math.exp(u)  # the root already, to well below the tolerance
            # one more Newton step: quadratic convergence puts tau_g at the root to float
            # precision, so shards whose float32 logits differ in the last bit agree on tau_g
            before_polish = (u, abs(err))
        if step is None:
            step = -math.copysign(2.0, err)
        step = max(-3.0, min(3.0, step))
        candidate = u + step
        if not lo < candidate < hi:
            candidate = (
                0.5 * (lo + hi)
                if math.isfinite(lo) and math.isfinite(hi)
                else (u - math.copysign(3.0, err))
            )
        if candidate == u:
            if before_polish is not None:
                return math.exp(u)
            break
        u = candidate
    warn(
        f"match_temperature did not reach |conf(f_g) - conf(f_c)| <= {tol}; "
        f"best error {best_err:.3g} at tau_g={math.exp(best_u):.4g}",
    )
    return math.exp(best_u)


POLISHED = 1e-6
r"""A step in :math:`\ln\tau` this small means the iterate is the root: :math:`\tau_g` would
move by less than 1e-6 (relative), below the 1e-5 at which two runs' logits are compared, so no
polishing pass is taken (shards take the same steps, decided on reduced sums)."""

DEFICIT_TOL = 1e-3
r"""Largest :math:`|\ln((1 - \operatorname{conf}_g)/(1 - \operatorname{conf}_c))|` accepted as a
match (with ``tol``): 0.1 % of the deficit, far above float32 noise."""


def _log_ratio(deficit: float, target: float) -> float:
    """``ln(deficit / target)``: 0 when both are 0, -inf when only ``deficit`` is."""
    if target <= 0.0:
        return 0.0 if deficit <= 0.0 else math.inf
    return math.log(deficit / target) if deficit > 0.0 else -math.inf


def _halley_step(deficit: float, growth: float, bend: float, target: float) -> float | None:
    r"""Halley step in ``u = ln tau`` on :math:`\varphi = \ln D - \ln D_c` (cubic
    convergence: one pass fewer than Newton from the margins' first guess at ImageNet size),
    :math:`-2\varphi\varphi' / (2\varphi'^2 - \varphi\varphi'')` with
    :math:`\varphi' = D'/D`, :math:`\varphi'' = D''/D - \varphi'^2`; the Newton step where
    Halley's denominator is not positive or its step is longer than twice Newton's."""
    newton = _newton_step(deficit, growth, target)
    if newton is None:
        return None
    phi = math.log(deficit / target)
    slope = growth / deficit
    curve = bend / deficit - slope * slope
    denominator = 2.0 * slope * slope - phi * curve
    if not denominator > 0.0:
        return newton
    halley = -2.0 * phi * slope / denominator
    return halley if math.isfinite(halley) and abs(halley) <= 2.0 * abs(newton) else newton


def _newton_step(deficit: float, growth: float, target: float) -> float | None:
    """Newton step in ``u = ln tau`` on ``ln deficit - ln target`` (smooth where the deficit
    is tiny), or ``None`` where it is undefined (a deficit of 0, no slope)."""
    if deficit <= 0.0 or growth <= 0.0 or target <= 0.0:
        return None
    return -math.log(deficit / target) * deficit / growth


def pool_weight(fusion: Fusion) -> float:
    r"""The weight :math:`\omega` of each expert in the fused logits (Eq. 12 as a pool).

    .. math::
        f_f = \omega\left(\frac{f_g}{\tau_g} + \frac{f_c}{\tau_c}\right),\qquad
        \omega = \begin{cases} \tfrac12 & \text{``pooled''}\\
        1 & \text{``matched'', ``fixed'' (Eq. 12)} \end{cases},\qquad
        f_d = f_f - \ln\hat\beta_\omega + \ln\hat\pi,

    with :math:`\hat\beta_\omega` the label bias matched on *this* :math:`f_f` (Eq. 13).
    Eq. 12's plain sum multiplies the two posteriors, which is right for conditionally
    independent evidence; :math:`f_g` and :math:`f_c` are two linear functions of the same
    :math:`x`, each at the zero-shot confidence after Eq. 11, so their sum is about twice as
    sharp as either (on Proposition 2's model, where both estimate one Bayes log-likelihood
    ratio, exactly twice; the temperature that gives :math:`f_f` the zero-shot confidence
    back measures 0.45-0.51 on every world of ``benchmarks/label_shift.py``). Matched on the
    class masses of a posterior that sharp, :math:`\hat\beta` makes the rare classes
    predicted about as often as :math:`\hat\pi` says instead of as often as Bayes' rule
    does (less, where the classes overlap), which cost :math:`f_d` 1.3 points under a long
    tail. The logarithmic opinion pool with equal weights :math:`\tfrac12` keeps the
    experts' common confidence. :math:`\arg\max f_f` is unchanged; only the debiasing
    (:math:`f_d`, the implicit and Oracle rows) sees :math:`\omega`. A constant: no pass over
    the data, the same on every shard.

    Args:
        fusion: the ``fusion`` option (:data:`~frolic_tta.options.Fusion`).

    Returns:
        :math:`\omega`: 0.5 for ``"pooled"`` and ``"selected"``, else 1.0 (``"selected"``
        may then drop :math:`f_c`, :mod:`frolic_tta.fusion`).

    Raises:
        ValueError: ``fusion`` is not one of :data:`~frolic_tta.options.FUSIONS`.
    """
    check_choice("fusion", fusion, FUSIONS)
    return 0.5 if fusion in ("pooled", "selected") else 1.0
