"""Numerical inputs of the estimators (issue 10): confident data, bad values, gradients."""

from __future__ import annotations

import pytest
import torch

import frolic_tta
from frolic_tta.calibration import confidence


def confident_world(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Five unit prototypes in 16 dims and 200 unit features close to them (confident)."""
    g = torch.Generator().manual_seed(0)
    prototypes = torch.nn.functional.normalize(torch.randn(5, 16, generator=g), dim=1)
    noisy = prototypes[torch.arange(200) % 5] + 0.125 * torch.randn(200, 16, generator=g)
    features = torch.nn.functional.normalize(noisy, dim=1)
    return features.to(dtype), prototypes.to(dtype)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_match_temperature_on_confident_data_matches_and_agrees_across_dtypes():
    temperatures = {}
    for dtype in (torch.float32, torch.float64):
        result = frolic_tta.frolic(*confident_world(dtype))
        target = confidence(result.zero_shot_logits, 0.01)
        assert abs(confidence(result.gda_logits, result.tau_g) - target) <= 1e-5
        temperatures[dtype] = result.tau_g
    assert temperatures[torch.float32] == pytest.approx(temperatures[torch.float64], rel=1e-3)
