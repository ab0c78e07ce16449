"""The head's class means tested against the prototypes (``head_means="tested"``, the default;
:mod:`frolic_tta.prototype_means`): the statistic's null distribution, its power, the head it
builds, and the worlds of issue 35, item 1 it was built for."""

from __future__ import annotations

import dataclasses
import math
import re
import warnings

import pytest
import torch

import frolic_tta
from frolic_tta import prototype_means
from frolic_tta.evidence import data_span
from frolic_tta.gda import fit_gaussian_head, moment_sums
from frolic_tta.logits import TensorLogits, identity_reduce
from frolic_tta.options import HEAD_MEANS
from frolic_tta.prototype_means import LEVEL, prototype_statistic
from frolic_tta.soft_sums import posterior_squares
from frolic_tta.synthetic import means_world, paper_world
from tests.sharding import run_sharded

K, D = 20, 16


def draw_means(seed: int, planted: float = 0.0, scale: float = 0.7):
    """Class means drawn around ``c + a z_j`` (``a = scale``) with the noise :math:`\\Sigma/n_j`
    the test assumes (anisotropic Sigma, uneven counts), plus ``planted`` noise-SDs on class 0."""
    g = torch.Generator().manual_seed(seed)
    z = torch.nn.functional.normalize(torch.randn(K, D, generator=g, dtype=torch.float64), dim=1)
    root = torch.randn(D, D, generator=g, dtype=torch.float64) / math.sqrt(D)
    sigma = root @ root.t() + 0.1 * torch.eye(D, dtype=torch.float64)
    counts = torch.randint(20, 200, (K,), generator=g).double()
    factor = torch.linalg.cholesky(sigma)
    noise = torch.randn(K, D, generator=g, dtype=torch.float64) @ factor.t()
    noise = noise / counts.sqrt()[:, None]
    c, a = torch.randn(D, generator=g, dtype=torch.float64), scale
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
    fitted, z_value, a_hat, _ = prototype_statistic(means, sigma, counts, z, None)
    assert abs(a_hat - a) < 0.05
    offset = fitted - a_hat * z  # c-hat, the same for every class
    torch.testing.assert_close(offset, offset[:1].expand_as(offset), rtol=0, atol=1e-12)
    assert abs(z_value) <= LEVEL


def test_the_scale_is_standardised_by_its_least_squares_error():
    # t = a-hat / se(a-hat): (a-hat - a) / se is N(0, 1) over draws, and t itself where a = 0
    shifted = []
    for seed in range(400):
        _, _, a_hat, t = prototype_statistic(*draw_means(seed)[:4], None)
        shifted.append((a_hat - 0.7) * t / a_hat)
    null = [prototype_statistic(*draw_means(s, scale=0.0)[:4], None)[3] for s in range(400)]
    for values in (torch.tensor(shifted), torch.tensor(null)):
        assert abs(float(values.mean())) < 4 / math.sqrt(400)
        assert abs(float(values.std()) - 1.0) < 4 / math.sqrt(2 * 400)


def test_means_with_no_structure_along_the_prototypes_keep_the_sample_means():
    # a = 0: all class means equal up to their noise. H_0's z does not reject (a = 0 is in
    # H_0's closure), but its image c-hat + a-hat z_j would be a head of noise: t decides
    world = means_world(2000, K, D, 0.6, seed=0)
    x, z = world.features.double(), world.prototypes.double()
    sums = moment_sums(x, z, 0.01)
    head = fit_gaussian_head(sums, z)
    counts = head.class_weights * 2000
    g = torch.Generator().manual_seed(12345)  # not the world's seed: its prototypes' draws
    factor = torch.linalg.cholesky(head.shared_covariance)
    noise = torch.randn(K, D, generator=g, dtype=torch.float64) @ factor.t()
    flat = dataclasses.replace(head, class_means=head.center + noise / counts.sqrt()[:, None])
    _, z_value, _, t = prototype_statistic(
        flat.class_means, flat.shared_covariance, counts, z, None
    )
    assert abs(z_value) <= LEVEL and abs(t) <= LEVEL
    assert prototype_means.tested_means(flat, z, sums, None) == (flat, z_value)


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
    fitted, same_z, _, _ = prototype_statistic(
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


def test_larger_counts_only_raise_the_statistic():
    # Kish's effective counts n_j^2 / sum_i q_ij^2 are at least the soft counts n_j, and T is
    # the minimum over (c, a) of a sum weighted by them: so the effective counts' z is at least
    # the soft counts' z, and an upper-tail rejection on the soft counts stands
    for seed in range(20):
        means, sigma, counts, z, _ = draw_means(seed)
        g = torch.Generator().manual_seed(seed)
        larger = counts * (1.0 + 3.0 * torch.rand(K, generator=g, dtype=torch.float64))
        raised = prototype_statistic(means, sigma, larger, z, None)[1]
        assert raised >= prototype_statistic(means, sigma, counts, z, None)[1]


def test_the_squared_posterior_sums_agree_with_float64_and_add_over_shards():
    g = torch.Generator().manual_seed(0)
    logits = 3.0 * torch.randn(301, 7, generator=g)
    offset = torch.randn(7, generator=g, dtype=torch.float64)
    for shift in (offset, None):
        reference = torch.softmax(logits.double() + (0.0 if shift is None else shift), dim=1)
        whole = posterior_squares(TensorLogits(logits, 50), shift, identity_reduce)
        torch.testing.assert_close(whole, reference.square().sum(0), rtol=1e-6, atol=0.0)
        parts = [TensorLogits(part, 50) for part in (logits[:100], logits[100:])]
        joined = sum(posterior_squares(part, shift, identity_reduce) for part in parts)
        torch.testing.assert_close(joined, whole, rtol=1e-12, atol=0.0)


def test_the_squares_are_summed_only_for_the_lower_tail():
    world = means_world(2000, K, D, 0.6, seed=0)
    x, z = world.features.double(), world.prototypes.double()
    sums = moment_sums(x, z, 0.01)
    head = fit_gaussian_head(sums, z)

    def unused() -> torch.Tensor:
        raise AssertionError("a pass the soft counts' z did not ask for")

    tested, z_value = prototype_means.tested_means(head, z, sums, None, unused)
    assert abs(z_value) <= LEVEL and tested is not head


def test_a_many_class_means_world_is_read_on_its_effective_counts():
    # no_harm_sweep.py --seeds 20, K = 100, d = 128, N = 10,000, balanced, noise 0.3, seed 17:
    # f_d 0.7600, 0.73 pt under f_c 0.7673 (paired z -4.1; K = 100 balanced was 0.34 pt under
    # f_c averaged over 20 seeds): the soft counts' z rejected H_0 by the lower tail and the
    # sample means' head stayed (f_g 0.7505). On the effective counts z is 2.0: not rejected
    world = means_world(10000, 100, 128, 0.3, seed=17)
    x, z, labels = world.features, world.prototypes, world.labels
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        sample = frolic_tta.frolic(x, z, head_means="sample")
        tested = frolic_tta.frolic(x, z)
    head, span = sample.head.gaussian, data_span(sample.sums)
    counts = head.class_weights * float(sample.sums.count)
    means, sigma = head.class_means, head.shared_covariance
    assert prototype_statistic(means, sigma, counts, z.double(), span)[1] < -LEVEL
    assert abs(tested.priors.prototype_z) <= LEVEL
    f_c = frolic_tta.accuracy(x @ z.t(), labels)
    before, after = (frolic_tta.accuracy(f.logits, labels) for f in (sample, tested))
    assert before < f_c - 0.005 <= after


def test_the_effective_counts_pass_agrees_on_any_number_of_shards():
    # no_harm_sweep.py's K = 50 balanced world, noise 0.45, seed 0: the soft counts' z -3.2, so
    # the squares' pass runs; every shard sums its rows and takes the same decision
    world = means_world(2000, 50, 64, 0.45, seed=0)
    whole = frolic_tta.fit_frolic(world.features, world.prototypes)
    index = [torch.arange(r, 2000, 2) for r in range(2)]
    fits = run_sharded(
        lambda i, reduce: frolic_tta.fit_frolic(
            world.features[i], world.prototypes, reduce_fn=reduce
        ),
        index,
    )
    assert abs(whole.priors.prototype_z) <= LEVEL
    joined = torch.empty_like(whole.logits)
    for i, shard in zip(index, fits, strict=True):
        assert shard.priors.prototype_z == pytest.approx(whole.priors.prototype_z, rel=1e-9)
        joined[i] = shard.logits
    assert torch.equal(joined.argmax(1), whole.logits.argmax(1))


def test_a_head_means_option_that_is_not_one_of_them_says_which_are():
    message = f"Expected `head_means` to be one of {HEAD_MEANS}, but got 'prototypes'"
    with pytest.raises(ValueError, match=re.escape(message)):
        frolic_tta.FrolicOptions(head_means="prototypes")
