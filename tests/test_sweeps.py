"""Passes that are not exact sum the posterior through matrix-vector products with the
exponentials (:mod:`frolic_tta.sweeps`): they agree with a float64 reference within the
worst-case float32 rounding of those sums, however wide the shift.

The bound: each entry :math:`e_{ij} = \\exp(g_{ij} - \\max_k g_{ik})` carries a relative error
of at most :math:`(D + 2)u` (:math:`u = 2^{-24}`, :math:`D` the deepest row: the float32
subtraction rounds the exponent by :math:`D u`, the exponential by a unit or so); a float32 sum
of m positive terms at most :math:`m u` more (in any order, so under any kernel set); a row
sum runs over K terms and a column sum over a chunk's rows. Every positive sum below is then
within :math:`(K + \\text{rows} + D + 8) u` of the float64 one, relatively.
"""

from __future__ import annotations

import math

import torch

from frolic_tta.logits import TensorLogits
from frolic_tta.mixture import _mixture_sums
from frolic_tta.soft_sums import posterior_sums
from frolic_tta.sweeps import exponentials

U = 2.0**-24
ROWS = 700


def world(n: int, k: int, scale: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, k, generator=generator) * scale
    features = torch.randn(n, 16, generator=generator)
    return logits, features


def depth(logits: torch.Tensor) -> float:
    return float((logits.amax(1) - logits.amin(1)).max())


def bound(logits: torch.Tensor, spread: float = 0.0) -> float:
    """Relative worst-case rounding of a sum (module docstring)."""
    return (logits.shape[1] + ROWS + depth(logits) + spread + 8) * U


def test_the_mixture_pass_matches_float64_within_its_rounding():
    logits, _ = world(3000, 200, 4.0)
    weights = torch.softmax(torch.linspace(-6.0, 6.0, 200, dtype=torch.float64), 0)
    sums = _mixture_sums(TensorLogits(logits, ROWS), weights.log())  # not exact: products
    g = logits.double()
    joint = g + weights.log()
    posterior = torch.softmax(joint, 1)
    tolerance = bound(logits, 12.0)
    assert float(sums.count) == 3000
    # per row, ln of a sum within `tolerance` relatively: at most `tolerance` nats off
    assert abs(float(sums.log_likelihood) - float(torch.logsumexp(joint, 1).sum())) <= (
        3000 * tolerance
    )
    uniform = float(torch.logsumexp(g, 1).sum()) - 3000 * math.log(200)
    assert abs(float(sums.uniform_log_likelihood) - uniform) <= 3000 * tolerance
    # responsibilities: sums of positive terms, each a quotient of two such sums
    expected = posterior.sum(0)
    assert float(((sums.responsibility - expected).abs() / expected).max()) <= 3 * tolerance
    gradient = (posterior / weights).sum(0)
    assert float(((sums.gradient - gradient).abs() / gradient).max()) <= 3 * tolerance


def soft_reference(logits, shift, features):
    posterior = torch.softmax(logits.double() + shift, 1)
    entropy = float(torch.special.entr(posterior).sum())
    return posterior.sum(0), posterior.t() @ features.double(), entropy


def check_soft_sums(logits, shift, features, exp, spread):
    k, d = logits.shape[1], features.shape[1]
    packed = posterior_sums(TensorLogits(logits, ROWS), shift, features, exp, entropy=True)
    count, weighted, entropy = packed[:k], packed[k:-1].reshape(k, d), float(packed[-1])
    expected_count, expected_weighted, expected_entropy = soft_reference(logits, shift, features)
    tolerance = bound(logits, spread)
    assert float(((count - expected_count).abs() / expected_count).max()) <= 3 * tolerance
    # sum_i q_ij x_i: each term within 3 * tolerance of its own size, so the sum within that
    # share of sum_i q_ij |x_i|
    magnitude = torch.softmax(logits.double() + shift, 1).t() @ features.double().abs()
    assert bool(((weighted - expected_weighted).abs() <= 3 * tolerance * magnitude + 1e-30).all())
    # H(q_i) = ln n_i + sum_j q_ij (-ln e_ij s_j): every term at most D + spread + ln K nats
    deepest = depth(logits) + spread + math.log(k)
    assert abs(entropy - expected_entropy) <= logits.shape[0] * 3 * tolerance * (deepest + 1)
    return packed


def test_soft_sums_match_float64_with_and_without_the_exponentials_at_hand():
    logits, features = world(3000, 200, 4.0)
    shift = torch.linspace(-10.0, 10.0, 200, dtype=torch.float64)
    spread = 20.0
    computed = check_soft_sums(logits, shift, features, None, spread)
    served = exponentials(TensorLogits(logits, ROWS), torch.empty_like(logits))
    assert served.depth + spread < 80.0  # the exponentials serve this shift: s apart from e
    again = check_soft_sums(logits, shift, features, served, spread)
    assert float((computed - again).abs().max()) > 0.0  # two different paths, both checked


def test_unscaled_sums_stay_finite_where_the_shift_spans_65_nats():
    # e_ij / n_i would reach 1 / s_j = e^65 in a row that class 0 wins, but n_i >= e^-D
    # (the class of s = 1): every unscaled term is at most e^min(D, spread) (soft_sums)
    logits, features = world(3000, 50, 1.0)
    shift = torch.zeros(50, dtype=torch.float64)
    shift[0] = -65.0
    served = exponentials(TensorLogits(logits, ROWS), torch.empty_like(logits))
    assert served.depth + 65.0 < 80.0  # served: s = e^{shift - max shift}, down to e^-65
    packed = check_soft_sums(logits, shift, features, served, 65.0)
    assert bool(packed.isfinite().all())
