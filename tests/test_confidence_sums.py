"""The confidence pass of the tau_g search (frolic_tta.calibration): its deficit, slope and
curvature agree with a float64 reference on rows with ties, on rows whose deficit is far below
float32's resolution of 1, and on ordinary rows."""

from __future__ import annotations

import math

import torch

from frolic_tta.calibration import _confidence_sums
from frolic_tta.logits import TensorLogits


def reference_deficit(logits: torch.Tensor, log_tau: float) -> torch.Tensor:
    """Per-row 1 - max softmax(f / tau) in float64, without cancellation."""
    scaled = logits.double() / math.exp(log_tau)
    top = scaled.max(1, keepdim=True).values
    rest = torch.exp(scaled - top)
    at_top = scaled == top
    r = rest.masked_fill(at_top, 0.0).sum(1) + (at_top.sum(1) - 1)
    return r / (1.0 + r)


def test_deficit_slope_and_curvature_match_a_float64_reference():
    generator = torch.Generator().manual_seed(0)
    ordinary = torch.randn(300, 40, generator=generator) * 3
    tied = ordinary[:20].clone()
    tied[:, 5] = tied.max(1).values  # two classes at the top
    confident = torch.randn(30, 40, generator=generator)
    confident[:, 0] += 40.0  # r about e^-40: 1 - p_max rounds to 0 in float32
    logits = torch.cat([ordinary, tied, confident]).float()
    u, h = math.log(1.3), 1e-4
    sums = _confidence_sums(TensorLogits(logits, 64), math.exp(u))
    exact = reference_deficit(logits, u)
    assert float(sums.count) == logits.shape[0]
    assert abs(float(sums.deficit) - float(exact.sum())) <= 1e-6 * float(exact.sum())
    # rows whose deficit is ~1e-17 keep it to 1e-6 relative (the float64 sum minus 1 would not)
    small = _confidence_sums(TensorLogits(logits[-30:], 64), math.exp(u))
    assert abs(float(small.deficit) / float(exact[-30:].sum()) - 1.0) < 1e-5
    # slope and curvature in ln tau against central differences of the float64 deficit
    plus, minus = reference_deficit(logits, u + h).sum(), reference_deficit(logits, u - h).sum()
    slope = float(plus - minus) / (2 * h)
    curve = float(plus - 2 * exact.sum() + minus) / h**2
    assert abs(float(sums.growth) - slope) <= 1e-4 * abs(slope)
    assert abs(float(sums.bend) - curve) <= 1e-3 * abs(curve) + 1e-3
