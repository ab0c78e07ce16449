r"""Prediction fusion via confidence matching (paper Section 3.3, Eqs. 10-12).

.. math::
    \operatorname{conf}(f, \tau) = \frac1N \sum_i \max_j \mathrm{softmax}(f(x_i)/\tau)_j
    \quad\text{(Eq. 10)},\qquad
    \tau_g = \arg\min_\tau |\operatorname{conf}(f_g, \tau) - \operatorname{conf}(f_c, \tau_c)|
    \quad\text{(Eq. 11)}.

``conf`` decreases monotonically in :math:`\tau` (from 1 at :math:`\tau\to0` to :math:`1/K`),
so Eq. 11 is a root search. We search :math:`u = \ln\tau` with Newton steps safeguarded by a
bracket (bisection when a step leaves it); the derivative is itself a sum over samples,

.. math::
    \frac{\partial p_{\max}}{\partial \ln\tau} = -\frac{p_{\max}\,(f_{a} - \sum_j p_j f_j)}{\tau},

so each step costs one pass over the logits and one call of ``reduce_fn``. The stop test is on
reduced values, so every shard stops at the same step.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from frolic_tta.logits import LogitSource, ReduceFn, as_source, identity_reduce


def _confidence_sums(source: LogitSource, temperature: float) -> Tensor:
    """``[N, sum_i pmax_i, sum_i d pmax_i / d ln tau, sum_i (max_j f_ij - mean_j f_ij)]`` of
    the local shard, float64 (the last entry, the logit spread, gives a first guess)."""
    total = torch.zeros(4, dtype=torch.float64)
    for _, logits in source.chunks():
        probs = torch.softmax(logits / temperature, dim=1)
        top, arg = probs.max(dim=1)
        top_logit = logits.gather(1, arg[:, None]).squeeze(1)
        expected = (probs * logits).sum(1)
        slope = -top * (top_logit - expected) / temperature
        margin = logits.max(1).values - logits.mean(1)
        total += torch.stack(
            [
                torch.tensor(float(logits.shape[0]), dtype=torch.float64),
                top.sum(dtype=torch.float64).cpu(),
                slope.sum(dtype=torch.float64).cpu(),
                margin.sum(dtype=torch.float64).cpu(),
            ]
        )
    return total


def _margin_sum(source: LogitSource) -> Tensor:
    """``[sum_i (max_j f_ij - mean_j f_ij)]`` of the local shard, float64."""
    total = torch.zeros(1, dtype=torch.float64)
    for _, logits in source.chunks():
        total += float((logits.max(1).values - logits.mean(1)).sum(dtype=torch.float64))
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
    reduce_fn = reduce_fn or identity_reduce
    sums = reduce_fn(_confidence_sums(as_source(logits), temperature))
    return float(sums[1] / sums[0])


def match_temperature(
    gda_logits: Tensor | LogitSource,
    zero_shot_logits: Tensor | LogitSource,
    tau_c: float = 0.01,
    *,
    tol: float = 1e-5,
    max_iter: int = 100,
    reduce_fn: ReduceFn | None = None,
) -> float:
    r"""Temperature :math:`\tau_g` whose confidence matches the zero-shot one (Eq. 11).

    Args:
        gda_logits: ``(N, K)`` :math:`f_g` (tensor or :class:`LogitSource`).
        zero_shot_logits: ``(N, K)`` unscaled :math:`f_c = x^\top z`.
        tau_c: zero-shot temperature.
        tol: stop when :math:`|\operatorname{conf}(f_g,\tau_g) - \operatorname{conf}(f_c,\tau_c)|
            \le` ``tol``.
        max_iter: cap on search steps (each one pass and one ``reduce_fn`` call).
        reduce_fn: sums a tensor over shards (identity by default).

    Returns:
        :math:`\tau_g > 0`: once within ``tol`` one more Newton step is taken (so the result is
        the root to float precision, not just any point within ``tol``). If the target
        cannot be reached within ``max_iter`` (for example when all :math:`f_g` rows are
        constant) a ``UserWarning`` is emitted and the best
        temperature found is returned.
    """
    if not tau_c > 0:
        raise ValueError(f"Expected `tau_c` > 0, but got {tau_c}")
    reduce_fn = reduce_fn or identity_reduce
    gda = as_source(gda_logits, "gda_logits")
    zero_shot = as_source(zero_shot_logits, "zero_shot_logits")
    if gda.num_classes != zero_shot.num_classes:
        raise ValueError(
            "Expected `gda_logits` and `zero_shot_logits` to have the same number of classes, "
            f"but got {gda.num_classes} and {zero_shot.num_classes}"
        )
    # One reduction for the target and the first guess (spread of f_g relative to f_c / tau_c);
    # each source is streamed once.
    first = reduce_fn(torch.cat([_confidence_sums(zero_shot, tau_c), _margin_sum(gda)]))
    target = float(first[1] / first[0])
    margin_c, margin_g = float(first[3]), float(first[4])
    u = math.log(tau_c * margin_g / margin_c) if margin_g > 0 and margin_c > 0 else math.log(tau_c)
    lo, hi = -math.inf, math.inf  # bracket on u: conf(lo) >= target >= conf(hi)
    best_u, best_err = u, math.inf
    polished = False
    for _ in range(max_iter):
        sums = reduce_fn(_confidence_sums(gda, math.exp(u)))
        conf, slope = float(sums[1] / sums[0]), float(sums[2] / sums[0])
        err = conf - target
        if abs(err) < best_err:
            best_u, best_err = u, abs(err)
        if polished:
            return math.exp(u)
        if err > 0:
            lo = max(lo, u)  # too confident: temperature must grow
        else:
            hi = min(hi, u)
        if abs(err) <= tol:
            # one more Newton step: quadratic convergence puts tau_g at the root to float
            # precision, so shards whose float32 logits differ in the last bit agree on tau_g
            polished = True
        step = -err / slope if slope < 0 else math.copysign(2.0, err)
        step = max(-3.0, min(3.0, step))
        candidate = u + step
        if not lo < candidate < hi:
            candidate = (
                0.5 * (lo + hi)
                if math.isfinite(lo) and math.isfinite(hi)
                else (u + math.copysign(3.0, err))
            )
        if candidate == u:
            if polished:
                return math.exp(u)
            break
        u = candidate
    warnings.warn(
        f"match_temperature did not reach |conf(f_g) - conf(f_c)| <= {tol}; "
        f"best error {best_err:.3g} at tau_g={math.exp(best_u):.4g}",
        UserWarning,
        stacklevel=2,
    )
    return math.exp(best_u)
