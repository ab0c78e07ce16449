"""The head's class means tested against the prototypes (``head_means="tested"``, the default;
:mod:`frolic_tta.prototype_means`): the statistic's null distribution, its power, the head it
builds, and the worlds of issue 35, item 1 it was built for."""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch

import frolic_tta
from frolic_tta import prototype_means
from frolic_tta.gda import fit_gaussian_head, moment_sums
from frolic_tta.options import HEAD_MEANS
from frolic_tta.prototype_means import LEVEL, prototype_statistic
from frolic_tta.synthetic import means_world, paper_world

K, D = 20, 16


def draw_means(seed: int, planted: float = 0.0):
    """Class means drawn around ``c + a z_j`` with the noise :math:`\\Sigma/n_j` the test
    assumes (anisotropic Sigma, uneven counts), plus ``planted`` noise-SDs on class 0."""
    g = torch.Generator().manual_seed(seed)
    z = torch.nn.functional.normalize(torch.randn(K, D, generator=g, dtype=torch.float64), dim=1)
    root = torch.randn(D, D, generator=g, dtype=torch.float64) / math.sqrt(D)
    sigma = root @ root.t() + 0.1 * torch.eye(D, dtype=torch.float64)
    counts = torch.randint(20, 200, (K,), generator=g).double()
    factor = torch.linalg.cholesky(sigma)
    noise = torch.randn(K, D, generator=g, dtype=torch.float64) @ factor.t()
    noise = noise / counts.sqrt()[:, None]
    c, a = torch.randn(D, generator=g, dtype=torch.float64), 0.7
    means = c + a * z + noise
    means[0] += planted * factor[:, 0] / counts[0].sqrt()
    return means, sigma, counts, z, (c, a)


def test_the_statistic_is_standard_normal_where_the_means_are_the_prototypes_image():
    values = torch.tensor([prototype_statistic(*draw_means(s)[:4], None)[1] for s in range(400)])
    # nu = 19 * 16 - 1 = 303; mean and sd of 400 draws within 4 standard errors of N(0, 1)
    assert abs(float(values.mean())) < 4 / math.sqrt(400)
    assert abs(float(values.std()) - 1.0) < 4 / math.sqrt(2 * 400)
    assert int((values.abs() > LEVEL).sum()) <= 4  # 0.2 % of 400 is 0.8; P(more than 4) < 2e-3


def test_the_fit_recovers_the_scale_and_the_fitted_means_are_affine_in_the_prototypes():
    means, sigma, counts, z, (c, a) = draw_means(0)
    fitted, z_value, a_hat = prototype_statistic(means, sigma, counts, z, None)
    assert abs(a_hat - a) < 0.05
    offset = fitted - a_hat * z  # c-hat, the same for every class
    torch.testing.assert_close(offset, offset[:1].expand_as(offset), rtol=0, atol=1e-12)
    assert abs(z_value) <= LEVEL


def test_a_class_mean_off_the_prototypes_is_rejected():
    # one class 40 noise SDs off: T gains about 1,600 against nu = 303
    values = [prototype_statistic(*draw_means(s, planted=40.0)[:4], None)[1] for s in range(20)]
    assert min(values) > LEVEL


def test_means_closer_together_than_their_noise_are_rejected_too():
    # soft labels too blurred for independent means (a random encoder's): T far below nu
    means, sigma, counts, z, _ = draw_means(0)
    blurred = means.mean(0) + 0.1 * (means - means.mean(0))
    assert prototype_statistic(blurred, sigma, counts, z, None)[1] < -LEVEL


def test_the_head_takes_the_fitted_means_and_keeps_its_covariance():
    world = means_world(2000, K, D, 0.6, seed=0)
    x, z = world.features.double(), world.prototypes.double()
    sums = moment_sums(x, z, 0.01)
    head = fit_gaussian_head(sums, z)
    tested, z_value = prototype_means.tested_means(head, z, sums, None)
    assert abs(z_value) <= LEVEL and tested is not head
    fitted, same_z, _ = prototype_statistic(
        head.class_means, head.shared_covariance, head.class_weights * 2000, z, None
    )
    assert same_z == z_value
    torch.testing.assert_close(tested.class_means, fitted)
    torch.testing.assert_close(tested.shared_covariance, head.shared_covariance)
    reference = torch.linalg.solve(head.shared_covariance, (fitted - head.center).t()).t()
    torch.testing.assert_close(tested.weight, reference, rtol=1e-9, atol=1e-9)


def fit(world, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        result = frolic_tta.frolic(world.features, world.prototypes, **options)
        rows = result.ablations(world.labels)
    return result, {key: frolic_tta.accuracy(rows[key], world.labels) for key in rows}


def test_a_means_world_of_the_sweep_gets_the_prototypes_directions():
    # no_harm_sweep.py's K = 20 natural fit at zero-shot 0.41, seed 0 (the sweep's worst):
    # measured with the sample means f_g 0.3980, f_d 0.3965 (1.2 pt under f_c 0.4085)
    world = means_world(2000, 20, 32, 0.6, seed=0, sample=True)
    sample, before = fit(world, head_means="sample")
    tested, after = fit(world)
    assert sample.priors.prototype_z is None
    assert abs(tested.priors.prototype_z) <= LEVEL
    assert after["f_g"] > before["f_g"] and after["f_d"] > before["f_d"]


def test_the_papers_gaussian_world_keeps_its_covariance_where_the_means_are_the_prototypes():
    # accuracy.py's paper_world, seed 2: the means are the prototypes (z 2.1, not rejected) but
    # the covariance is anisotropic, so f_c alone (0.978) is not the Bayes classifier; the
    # head on the prototypes' directions through Sigma-hat^-1 is (f_d 0.989 -> 0.992)
    world = paper_world(seed=2)
    result, rows = fit(world, normalize=False)
    assert abs(result.priors.prototype_z) <= LEVEL
    assert rows["f_g"] >= rows["f_c"] + 0.01 and rows["f_d"] >= rows["f_c"] + 0.01


def test_the_kept_logits_equal_the_streamed_ones_where_the_head_moves():
    world = means_world(2000, 20, 32, 0.6, seed=0, sample=True)
    kept = frolic_tta.fit_frolic(world.features, world.prototypes, keep_logits=True)
    streamed = frolic_tta.fit_frolic(world.features, world.prototypes, keep_logits=False)
    # with the buffer, f_g of the sample means is in it when the test moves the head: refilled
    assert abs(kept.priors.prototype_z) <= LEVEL
    assert streamed.head.tau_g == pytest.approx(kept.head.tau_g, rel=1e-6)
    scores = streamed.head.score(world.features)
    assert torch.equal(scores.argmax(1), kept.logits.argmax(1))


def test_a_head_means_option_that_is_not_one_of_them_says_which_are():
    message = f"Expected `head_means` to be one of {HEAD_MEANS}, but got 'prototypes'"
    with pytest.raises(ValueError, match=re.escape(message)):
        frolic_tta.FrolicOptions(head_means="prototypes")
