"""Finalize's first buffer from the moments' own products (frolic_tta.metrics.FrolicMoments
with ``keep_logits``): f_c / tau_c rounded from the float64 products the soft sums are
computed from, so no (N, K, d) product is repeated, and a fit from kept logits is the fit
from the features alone."""

from __future__ import annotations

import pytest
import torch

from frolic_tta.gda import scaled_zero_shot
from frolic_tta.metrics import FrolicMoments
from frolic_tta.pipeline import fit_frolic
from frolic_tta.synthetic import clip_world


@pytest.fixture(scope="module")
def world():
    w = clip_world(num_samples=700, num_classes=12, dim=32, seed=3)
    return w.features, w.prototypes


def kept_moments(features, prototypes, batch=64):
    metric = FrolicMoments(prototypes, 0.01, keep_logits=True)
    for start in range(0, features.shape[0], batch):
        metric.update(features[start : start + batch])
    return metric


def test_kept_logits_are_the_float64_products_rounded_in_update_order(world):
    x, z = world
    metric = kept_moments(x, z, batch=50)
    kept = metric.zero_shot_logits()
    exact = scaled_zero_shot(x, z, 0.01)
    assert kept.dtype == torch.float32 and kept.shape == (700, 12)
    assert torch.equal(kept, exact.float())  # rounded once: no float32 product in between
    assert metric.zero_shot_logits().shape == (0, 12)  # handed over once
    assert FrolicMoments(z, 0.01).zero_shot_logits() is None  # not kept by default


def test_fit_from_kept_logits_equals_the_fit_from_features_alone(world):
    x, z = world
    metric = kept_moments(x, z)
    kept = fit_frolic(x, z, sums=metric.compute(), zero_shot_logits=metric.zero_shot_logits())
    alone = fit_frolic(x, z)  # its own moments, chunk by chunk, fill the same buffer
    given_sums = fit_frolic(x, z, sums=metric.compute())  # float64 products, no sums pass
    for other in (alone, given_sums):
        torch.testing.assert_close(kept.logits, other.logits, rtol=1e-6, atol=1e-6)
        assert kept.head.tau_g == pytest.approx(other.head.tau_g, rel=1e-6)


def test_kept_logits_of_the_wrong_shape_are_rejected(world):
    x, z = world
    with pytest.raises(ValueError, match=r"Expected `zero_shot_logits` of shape \(700, 12\) "
                       r"\(N_local, K\), but got \(699, 12\)"):  # fmt: skip
        fit_frolic(x, z, zero_shot_logits=torch.zeros(699, 12))
