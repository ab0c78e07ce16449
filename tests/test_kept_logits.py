"""Finalize's first buffer from the moments' own products (frolic_tta.metrics.FrolicMoments
with ``keep_logits``): f_c / tau_c rounded from the float64 products the soft sums are
computed from, so no (N, K, d) product is repeated, and a fit from kept logits is the fit
from the features alone."""

from __future__ import annotations

from dataclasses import replace

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


@pytest.mark.parametrize("rows", [0, 120, 700, 5000], ids=["none", "grown", "exact", "spare"])
def test_kept_logits_in_one_buffer_of_any_capacity_and_with_stored_sums(world, rows):
    x, z = world
    exact = scaled_zero_shot(x, z, 0.01).float()
    for soft in (True, False):  # False: a feature store's sums, N and sum x only
        metric = FrolicMoments(z, 0.01, keep_logits=True, soft=soft, rows=rows)
        for start in range(0, 700, 64):
            metric.update(x[start : start + 64])
        sums = metric.compute()
        assert float(sums.count) == 700.0
        torch.testing.assert_close(sums.feature_sum, x.double().sum(0), rtol=0, atol=1e-12)
        assert bool((sums.soft_count > 0).all()) == soft  # skipped without soft sums
        assert torch.equal(metric.zero_shot_logits(), exact)


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


def test_the_moments_sum_the_zero_shot_confidence_target_without_cancellation(world):
    x, z = world
    metric = kept_moments(x, z)
    sums = metric.compute()
    scaled = scaled_zero_shot(x, z, 0.01)
    top = scaled.max(1, keepdim=True).values
    rest = torch.exp(scaled - top).sum(1) - 1.0  # float64 reference (rows are not confident)
    assert float(sums.zero_shot_deficit) == pytest.approx(float((rest / (1 + rest)).sum()))
    margin = (top.squeeze(1) - scaled.mean(1)).sum()
    assert float(sums.zero_shot_margin) == pytest.approx(float(margin), rel=1e-12)
    # confident rows (images on their prototypes at tau_c 0.001: 1 - p_max is ~1e-100, 0 in
    # float64 after the subtraction) keep their deficit
    confident = moment_sums_of(z[:6], z, tau_c=0.001)
    scaled = scaled_zero_shot(z[:6], z, 0.001)
    others = scaled - scaled.diagonal()[:, None]  # each row's top class is its own (the diagonal)
    r = torch.exp(others.fill_diagonal_(-torch.inf)).sum(1)
    assert float(r.max()) < 1e-20 and float((1.0 - torch.softmax(scaled, 1).amax(1)).max()) == 0
    assert float(confident.zero_shot_deficit) == pytest.approx(float((r / (1 + r)).sum()))


def moment_sums_of(x, z, tau_c):
    metric = FrolicMoments(z, tau_c)
    metric.update(x)
    return metric.compute()


def test_tau_g_from_the_summed_target_equals_the_streamed_one(world):
    x, z = world
    sums = kept_moments(x, z).compute()
    fit = fit_frolic(x, z, sums=sums)  # the target from the moments
    streamed = fit_frolic(x, z, sums=replace(sums, zero_shot_deficit=None, zero_shot_margin=None))
    assert fit.head.tau_g == pytest.approx(streamed.head.tau_g, rel=1e-6)
    torch.testing.assert_close(fit.logits, streamed.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fill_output_copies_every_row_as_the_masked_path_writes_the_valid_ones(dtype):
    from frolic_tta.lightning.outcome import fill_output, placeholders

    logits = torch.randn(6, 5, generator=torch.Generator().manual_seed(0), dtype=dtype)
    logits[2, 1] = logits[2, 3] = logits[2].max() + 1.0  # a tie: the first index wins
    index, every = torch.arange(6), torch.ones(6, dtype=torch.bool)
    full = fill_output(placeholders(index, every, None, 5, True), logits)
    some = every.clone()
    some[[0, 4]] = False
    part = fill_output(placeholders(index, some, None, 5, True), logits[some])
    confidence, prediction = torch.softmax(logits.float(), 1).max(1)
    assert torch.equal(full["prediction"], prediction) and full["prediction"][2] == 1
    assert torch.equal(full["confidence"], confidence)
    assert torch.equal(full["logits"], logits.float())
    for key in ("prediction", "confidence", "logits"):
        assert full[key].dtype == part[key].dtype
        assert torch.equal(part[key][some], full[key][some])
    assert (part["prediction"][~some] == -1).all() and part["confidence"][~some].isnan().all()
