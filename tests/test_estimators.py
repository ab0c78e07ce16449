"""The estimator against known ground truth and independent references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.covariance import oas as sklearn_oas
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis

import frolic_tta
from frolic_tta import accuracy
from frolic_tta.calibration import confidence, pool_weight
from frolic_tta.gda import oas_shrinkage
from frolic_tta.rows import ROWS
from frolic_tta.synthetic import clip_world, paper_world, prior_shift_world


def reference_eq7(features: torch.Tensor, prototypes: torch.Tensor) -> torch.Tensor:
    """Independent float64 Eq. 7 in numpy."""
    x = features.double().numpy()
    z = prototypes.double().numpy()
    return torch.from_numpy(x.T @ x / len(x) - z.T @ z / len(z))


def test_paper_covariance_recovers_sigma_at_root_n_rate():
    errors = []
    for n in (2000, 8000, 32000):
        world = paper_world(num_samples=n, seed=1)
        result = frolic_tta.frolic(
            world.features, world.prototypes, covariance="paper", normalize=False
        )
        sigma = result.head.gaussian.shared_covariance
        torch.testing.assert_close(sigma, reference_eq7(world.features, world.prototypes))
        errors.append(float((sigma - world.covariance).norm() / world.covariance.norm()))
    # quadrupling N halves the error (1/sqrt(N)), within sampling noise
    for small, large in zip(errors, errors[1:], strict=False):
        assert 0.3 < large / small < 0.75, errors
    assert errors[-1] < 0.05


def test_paper_gda_matches_supervised_lda():
    world = paper_world(num_samples=6000, seed=2)
    result = frolic_tta.frolic(
        world.features, world.prototypes, covariance="paper", normalize=False
    )
    lda = LinearDiscriminantAnalysis(solver="lsqr").fit(
        world.features.numpy(), world.labels.numpy()
    )
    lda_accuracy = float((lda.predict(world.features.numpy()) == world.labels.numpy()).mean())
    assert abs(accuracy(result.gda_logits, world.labels) - lda_accuracy) <= 0.01


def test_soft_covariance_is_consistent_in_paper_model():
    world = paper_world(num_samples=32000, seed=3)
    head = frolic_tta.frolic(world.features, world.prototypes, normalize=False).head.gaussian
    error = float((head.shared_covariance - world.covariance).norm() / world.covariance.norm())
    assert error < 0.06
    # soft means use the zero-shot posterior, not the Bayes one: close to z_j, not equal
    relative = (head.class_means - world.prototypes).norm(dim=1) / world.prototypes.norm(dim=1)
    assert float(relative.max()) < 0.08


def test_auto_shrinkage_only_when_rank_deficient():
    full = clip_world(num_samples=400, seed=6)  # N > d = 64: scatter is PD, left unshrunk
    head = frolic_tta.frolic(full.features, full.prototypes).head.gaussian
    assert head.shrinkage == 0.0
    few = clip_world(num_samples=40, seed=6)  # N < d: singular scatter, OAS makes it PD
    head = frolic_tta.frolic(few.features, few.prototypes).head.gaussian
    assert 0.0 < head.shrinkage <= 1.0
    assert bool(torch.linalg.eigvalsh(head.shared_covariance).min() > 0)
    with pytest.raises(ValueError, match="Cholesky factorisation failed"):
        frolic_tta.frolic(few.features.double(), few.prototypes.double(), shrinkage=None)
    with pytest.raises(ValueError, match=r"`shrinkage` in \[0, 1\], 'auto', 'oas' or None"):
        frolic_tta.frolic(few.features, few.prototypes, shrinkage=1.5)


def test_oas_matches_scikit_learn():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 12, generator=g, dtype=torch.float64) @ torch.randn(
        12, 12, generator=g, dtype=torch.float64
    )
    x = x - x.mean(0)
    shrunk, rho = sklearn_oas(x.numpy(), assume_centered=True)
    ours = oas_shrinkage(x.t() @ x / len(x), len(x))
    assert math.isclose(ours, rho, rel_tol=1e-10)
    torch.testing.assert_close(
        frolic_tta.gda.shrink(x.t() @ x / len(x), ours), torch.from_numpy(shrunk)
    )


@pytest.mark.parametrize("separation", [0.5, 0.7])
def test_default_bias_recovers_prior_and_reaches_bayes(separation):
    world = prior_shift_world(num_samples=20000, separation=separation, ratio=20.0, seed=0)
    beta = frolic_tta.estimate_label_bias(world.logits)
    assert float((beta - world.prior).abs().sum()) < 0.1
    bayes = accuracy(world.bayes_logits, world.labels)
    assert accuracy(world.logits - beta.log(), world.labels) >= bayes - 0.01
    assert accuracy(world.logits, world.labels) < bayes - 0.04  # there was a bias to remove


def test_soft_prior_is_the_fixed_point_of_soft_s():
    """The default's beta satisfies beta = S(beta) beta with S built explicitly from
    debiased-posterior weights (an independent float64 check of the Newton solve)."""
    world = prior_shift_world(num_samples=20000, separation=0.7, seed=2)
    beta = frolic_tta.estimate_label_bias(world.logits, eps=1e-6)
    s = torch.softmax(world.logits, 1)
    q = torch.softmax(world.logits - beta.log(), 1)
    matrix = (s.t() @ q) / q.sum(0)  # column j: q-weighted mean of s(x)
    assert float((matrix @ beta - beta).abs().sum()) < 1e-4
    k = len(beta)  # and the debiased class masses are uniform
    torch.testing.assert_close(
        q.mean(0), torch.full((k,), 1 / k, dtype=torch.float64), atol=1e-5, rtol=0
    )


def test_literal_algorithm_2_drifts_and_oracle_does_not():
    world = prior_shift_world(num_samples=20000, separation=0.5, seed=0)
    literal = frolic_tta.estimate_label_bias(world.logits, method="paper")
    oracle = frolic_tta.estimate_label_bias(world.logits, labels=world.labels)
    assert float((literal - world.prior).abs().sum()) > 0.5
    assert float((oracle - world.prior).abs().sum()) < 0.05


def test_oracle_with_identity_class_matrix_is_uniform():
    logits = torch.tensor([[50.0, -50.0], [-50.0, 50.0], [60.0, -60.0]], dtype=torch.float64)
    beta = frolic_tta.estimate_label_bias(logits, labels=torch.tensor([0, 1, 0]))
    torch.testing.assert_close(beta, torch.full((2,), 0.5, dtype=torch.float64))


def test_default_bias_does_not_hurt_without_bias():
    world = prior_shift_world(num_samples=20000, separation=0.5, ratio=1.0, seed=4)
    beta = frolic_tta.estimate_label_bias(world.logits)
    assert float((beta - world.prior).abs().sum()) < 0.03
    assert (
        accuracy(world.logits - beta.log(), world.labels)
        >= accuracy(world.logits, world.labels) - 0.002
    )


def test_bias_methods_and_empty_classes_stay_finite():
    world = prior_shift_world(num_samples=3000, num_classes=6, separation=1.0, seed=5)
    # class 5 gets no samples and (almost) no posterior mass anywhere
    logits = world.logits[world.labels != 5].clone()
    logits[:, 5] -= 1e4
    for method in ("soft", "paper", "implicit", "none"):
        beta = frolic_tta.estimate_label_bias(logits, method=method)
        assert bool(torch.isfinite(beta.log()).all()) and math.isclose(float(beta.sum()), 1.0)
        debiased = logits - beta.log()
        assert bool(torch.isfinite(debiased).all())
        assert float((debiased.argmax(1) == 5).double().mean()) == 0.0  # not absorbing
    assert torch.equal(
        frolic_tta.estimate_label_bias(logits, method="none"),
        torch.full((6,), 1 / 6, dtype=torch.float64),
    )


def test_match_temperature_hits_target_confidence():
    world = clip_world(num_samples=2000, seed=1)
    result = frolic_tta.frolic(world.features, world.prototypes)
    target = confidence(result.zero_shot_logits, 0.01)
    assert abs(confidence(result.gda_logits, result.tau_g) - target) <= 1e-4
    assert frolic_tta.match_temperature(
        result.gda_logits, result.zero_shot_logits
    ) == pytest.approx(result.tau_g)
    temperatures = torch.logspace(-3, 2, 12).tolist()
    confidences = [confidence(result.gda_logits, t) for t in temperatures]
    # monotone (Eq. 10)
    assert all(a >= b for a, b in zip(confidences, confidences[1:], strict=False))


def test_clip_world_literal_breaks_and_default_beats_zero_shot():
    world = clip_world(num_samples=4000, seed=0)
    default = frolic_tta.frolic(world.features, world.prototypes)
    zero_shot = accuracy(default.zero_shot_logits, world.labels)
    for name in ("logits", "zero_shot_logits", "gda_logits", "fused_logits"):
        assert bool(torch.isfinite(getattr(default, name)).all()), name
    assert accuracy(default.logits, world.labels) > zero_shot + 0.15
    sigma = default.head.gaussian.shared_covariance
    assert bool(torch.linalg.eigvalsh(sigma).min() > 0)  # positive definite
    literal = frolic_tta.frolic(world.features, world.prototypes, covariance="paper", bias="paper")
    paper_sigma = literal.head.gaussian.shared_covariance
    assert abs(float(torch.trace(paper_sigma))) < 1e-5  # trace 0 on unit-norm features
    assert accuracy(literal.gda_logits, world.labels) < 1.0 / 20  # below chance


def test_ablation_rows_and_linear_head():
    world = clip_world(num_samples=1500, seed=2)
    result = frolic_tta.frolic(world.features, world.prototypes)
    rows = result.ablations(labels=world.labels)
    assert set(rows) == set(ROWS)  # Table 3: f_c .. f_d; Table 4: tde, implicit, oracle
    torch.testing.assert_close(  # f_d = f_f - ln beta + ln pi (Eq. 13 with the test prior)
        rows["f_f"] + result.head.log_offset().float(), result.logits, rtol=1e-5, atol=1e-4
    )
    layer = result.head.to_linear()
    torch.testing.assert_close(layer(world.features), result.logits, rtol=1e-5, atol=1e-3)
    # Eq. 12 with the default pool weight 1/2 (fusion="pooled"): the experts averaged
    assert result.head.pool_weight == 0.5
    expected = 0.5 * (result.gda_logits / result.tau_g + result.zero_shot_logits / 0.01)
    torch.testing.assert_close(result.fused_logits, expected, rtol=1e-5, atol=1e-3)


def test_pooled_fusion_halves_the_sum_and_keeps_its_argmax():
    assert (pool_weight("pooled"), pool_weight("matched"), pool_weight("fixed")) == (0.5, 1, 1)
    with pytest.raises(ValueError, match="Expected `fusion` to be one of"):
        pool_weight("sum")
    world = clip_world(num_samples=1500, seed=2)
    pooled = frolic_tta.frolic(world.features, world.prototypes)
    summed = frolic_tta.frolic(world.features, world.prototypes, fusion="matched")
    assert pooled.tau_g == summed.tau_g  # the same Eq. 11; only the weight of the sum differs
    torch.testing.assert_close(2 * pooled.fused_logits, summed.fused_logits, rtol=1e-5, atol=1e-3)
    # beta is matched on the pooled f_f: f_d = f_f/2 - ln beta_pooled + ln pi
    torch.testing.assert_close(
        pooled.fused_logits + pooled.head.log_offset().float(),
        pooled.logits,
        rtol=1e-5,
        atol=1e-4,
    )
    state = pooled.head.state_dict()
    assert frolic_tta.FrolicHead.from_state_dict(state).pool_weight == 0.5
    del state["pool_weight"]  # a head saved before the option: Eq. 12's plain sum
    assert frolic_tta.FrolicHead.from_state_dict(state).pool_weight == 1.0


def test_streaming_fit_equals_buffered_fit():
    world = clip_world(num_samples=1500, seed=4)
    buffered = frolic_tta.fit_frolic(world.features, world.prototypes, chunk_size=256)
    streamed = frolic_tta.fit_frolic(
        world.features, world.prototypes, keep_logits=False, chunk_size=256
    )
    assert streamed.logits is None
    assert streamed.head.tau_g == pytest.approx(buffered.head.tau_g, rel=1e-6)
    torch.testing.assert_close(streamed.head.beta, buffered.head.beta, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        streamed.head.score(world.features), buffered.logits, rtol=1e-5, atol=1e-3
    )


def test_float32_and_float64_agree():
    world = clip_world(num_samples=2000, seed=3)
    single = frolic_tta.frolic(world.features.float(), world.prototypes.float())
    double = frolic_tta.frolic(world.features.double(), world.prototypes.double())
    assert single.tau_g == pytest.approx(double.tau_g, rel=1e-4)
    torch.testing.assert_close(single.beta, double.beta, atol=1e-4, rtol=1e-3)
    assert float((single.logits.argmax(1) != double.logits.argmax(1)).double().mean()) < 0.002
    torch.testing.assert_close(single.logits.double(), double.logits, rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize(
    ("features", "prototypes", "kwargs", "message"),
    [
        (torch.randn(5, 4), torch.randn(1, 4), {}, r"at least 2 classes \(K >= 2\), but got K=1"),
        (torch.randn(1, 4), torch.randn(3, 4), {}, r"at least 2 samples \(N >= 2\), but got N=1"),
        (
            torch.randn(5, 3),
            torch.randn(3, 4),
            {},
            r"`features` to have 4 columns \(dimension mismatch\)",
        ),
        (
            torch.tensor([[float("nan")] * 4] * 5),
            torch.randn(3, 4),
            {},
            "`features` to hold only finite",
        ),
        (
            torch.randn(5, 4),
            torch.full((3, 4), float("inf")),
            {},
            "`prototypes` to hold only finite",
        ),
        (
            torch.cat([torch.zeros(1, 4), torch.randn(4, 4)]),
            torch.randn(3, 4),
            {"normalize": True},
            "every row of `features` to have non-zero norm",
        ),
        (torch.randn(5, 4), torch.randn(3, 4), {"covariance": "lw"}, "`covariance` to be one of"),
        (torch.randn(5, 4), torch.randn(3, 4), {"bias": "em"}, "`bias` to be one of"),
        (torch.randn(5), torch.randn(3, 4), {}, r"`features` to be 2-D, but got shape \(5,\)"),
    ],
)
def test_bad_input_raises_value_error(features, prototypes, kwargs, message):
    with pytest.raises(ValueError, match=message):
        frolic_tta.frolic(features, prototypes, **kwargs)


def test_bad_labels_and_tau():
    logits = torch.randn(10, 3)
    with pytest.raises(ValueError, match=r"`labels` of shape \(10,\)"):
        frolic_tta.estimate_label_bias(logits, labels=torch.zeros(9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"`tau_c` to be a finite number > 0, but got 0.0"):
        frolic_tta.match_temperature(logits, logits, tau_c=0)
    with pytest.raises(ValueError, match="same number of classes"):
        frolic_tta.match_temperature(logits, torch.randn(10, 4))


def _numpy_head(x: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eqs. 4-8 in float64 numpy: class means and shared scatter under soft labels ``p``."""
    means = (p.T @ x) / p.sum(0)[:, None]
    scatter = sum(
        p[:, j, None, None] * np.einsum("ni,nj->nij", x - means[j], x - means[j])
        for j in range(p.shape[1])
    ).sum(0) / len(x)
    return means, scatter


def test_numpy_reference_of_the_debiased_head():
    """The default head: means and scatter under softmax(f_c / tau_c - ln beta_c + ln pi),
    with the fit's own beta_c and test prior pi, whose class masses are pi (to 1e-6)."""
    world = clip_world(num_samples=800, seed=5)
    x, z = world.features.double(), world.prototypes.double()
    result = frolic_tta.frolic(x, z, shrinkage="oas", head_means="sample")
    priors = result.priors
    logits = (x @ z.T / 0.01 - priors.zero_shot_beta.log() + priors.test_prior.log()).numpy()
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    assert np.abs(p.mean(0) - priors.test_prior.numpy()).sum() < 1e-6
    means, scatter = _numpy_head(x.numpy(), p)
    rho = oas_shrinkage(torch.from_numpy(scatter), len(x))
    shrunk = (1 - rho) * scatter + rho * np.trace(scatter) / x.shape[1] * np.eye(x.shape[1])
    head = result.head.gaussian
    torch.testing.assert_close(head.shared_covariance, torch.from_numpy(shrunk))
    centred = np.linalg.solve(shrunk, (means - x.numpy().mean(0)).T).T
    torch.testing.assert_close(head.weight, torch.from_numpy(centred), rtol=1e-7, atol=1e-7)


def test_numpy_reference_of_head():
    """The paper's soft head (raw zero-shot labels) against an independent float64 numpy
    implementation."""
    world = clip_world(num_samples=800, seed=5)
    x = world.features.double().numpy()
    z = world.prototypes.double().numpy()
    logits = x @ z.T / 0.01
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    means, scatter = _numpy_head(x, p)
    rho = oas_shrinkage(torch.from_numpy(scatter), len(x))
    shrunk = (1 - rho) * scatter + rho * np.trace(scatter) / x.shape[1] * np.eye(x.shape[1])
    center = x.mean(0)
    centred_weight = np.linalg.solve(shrunk, (means - center).T).T
    eq9_weight = np.linalg.solve(shrunk, means.T).T
    eq9_bias = -0.5 * (means * eq9_weight).sum(1)
    head = frolic_tta.frolic(
        world.features.double(), world.prototypes.double(), shrinkage="oas", head_labels="zero_shot"
    ).head.gaussian
    torch.testing.assert_close(head.shared_covariance, torch.from_numpy(shrunk))
    torch.testing.assert_close(head.weight, torch.from_numpy(centred_weight), rtol=1e-7, atol=1e-7)
    weight, bias = head.paper_parameters()
    torch.testing.assert_close(weight, torch.from_numpy(eq9_weight), rtol=1e-7, atol=1e-6)
    # centred f_g and Eq. 9 differ by a constant per sample, never across classes
    eq9 = x @ eq9_weight.T + eq9_bias
    ours = (x - center) @ centred_weight.T + head.bias.numpy()
    difference = eq9 - ours
    np.testing.assert_allclose(
        difference, difference[:, :1].repeat(len(z), 1), rtol=1e-9, atol=1e-6
    )
