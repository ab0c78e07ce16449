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


def unit_world(num_samples: int = 60) -> tuple[torch.Tensor, torch.Tensor]:
    """Three unit prototypes in 8 dims and unit features around them."""
    g = torch.Generator().manual_seed(0)
    prototypes = torch.nn.functional.normalize(torch.randn(3, 8, generator=g), dim=1)
    noisy = prototypes[torch.arange(num_samples) % 3] + 0.5 * torch.randn(
        num_samples, 8, generator=g
    )
    return torch.nn.functional.normalize(noisy, dim=1), prototypes


NAN_FEATURES = torch.full((4, 8), float("nan"))
BAD_MOMENT_INPUTS = [
    (
        unit_world()[1],
        NAN_FEATURES,
        "Expected `features` to hold only finite values, but found NaN",
    ),
    (
        unit_world()[1],
        torch.full((4, 8), float("inf")),
        "Expected `features` to hold only finite values, but found NaN or inf",
    ),
    (unit_world()[1][:1], unit_world()[0], r"Expected at least 2 classes \(K >= 2\), but got K=1"),
    (
        torch.eye(3, 8, dtype=torch.long),
        unit_world()[0],
        "Expected `prototypes` to be floating point, but got torch.int64",
    ),
    (
        unit_world()[1],
        torch.eye(4, 8, dtype=torch.int32),
        "Expected `features` to be floating point, but got torch.int32",
    ),
]


@pytest.mark.parametrize(("prototypes", "features", "message"), BAD_MOMENT_INPUTS)
def test_frolic_moments_refuses_what_frolic_refuses(prototypes, features, message):
    from frolic_tta.metrics import FrolicMoments

    with pytest.raises(ValueError, match=message):
        FrolicMoments(prototypes).update(features)
    with pytest.raises(ValueError, match=message):
        frolic_tta.frolic(features, prototypes)
    if "finite" in message:  # fit_frolic counts them over all shards first
        message = r"Expected finite features, but 4 sample\(s\) hold NaN or inf"
    with pytest.raises(ValueError, match=message):
        frolic_tta.fit_frolic(features, prototypes)


def _call_with_tau_c(where: str, tau_c):
    from frolic_tta.metrics import FrolicMoments

    features, prototypes = unit_world()
    logits = features @ prototypes.t()
    calls = {
        "frolic": lambda: frolic_tta.frolic(features, prototypes, tau_c=tau_c),
        "fit_frolic": lambda: frolic_tta.fit_frolic(features, prototypes, tau_c=tau_c),
        "match_temperature": lambda: frolic_tta.match_temperature(logits, logits, tau_c),
        "moment_sums": lambda: frolic_tta.moment_sums(features, prototypes, tau_c),
        "FrolicMoments": lambda: FrolicMoments(prototypes, tau_c=tau_c),
    }
    return calls[where]()


@pytest.mark.parametrize(
    "where", ["frolic", "fit_frolic", "match_temperature", "moment_sums", "FrolicMoments"]
)
@pytest.mark.parametrize(
    ("tau_c", "error", "message"),
    [
        (0, ValueError, r"Expected `tau_c` to be a finite number > 0, but got 0\.0"),
        (-0.01, ValueError, r"Expected `tau_c` to be a finite number > 0, but got -0\.01"),
        (float("nan"), ValueError, r"Expected `tau_c` to be a finite number > 0, but got nan"),
        (float("inf"), ValueError, r"Expected `tau_c` to be a finite number > 0, but got inf"),
        (True, TypeError, r"Expected `tau_c` to be a real number, but got True"),
    ],
)
def test_invalid_tau_c_is_refused_everywhere_it_enters(where, tau_c, error, message):
    with pytest.raises(error, match=message):
        _call_with_tau_c(where, tau_c)


def test_match_temperature_refuses_logits_of_different_n():
    with pytest.raises(
        ValueError,
        match=r"`gda_logits` and `zero_shot_logits` to have the same number of samples "
        r"\(rows\), but got 10 and 9",
    ):
        frolic_tta.match_temperature(torch.randn(10, 3), torch.randn(9, 3))


def test_one_sample_with_reduce_fn_checks_the_global_count():
    from tests.sharding import run_sharded

    features, prototypes = unit_world()

    def run(shard, reduce_fn):
        return frolic_tta.frolic(shard, prototypes, reduce_fn=reduce_fn)

    message = r"Expected at least 2 samples \(N >= 2\) over all shards, but got N=1"
    with pytest.raises(ValueError, match=message):
        run_sharded(run, [features[:1], features[1:1]])  # one sample, one empty shard
    with pytest.raises(ValueError, match=message):
        frolic_tta.frolic(features[:1], prototypes, reduce_fn=lambda tensor: tensor)
    # one sample on a shard is fine when the others hold more
    whole = frolic_tta.frolic(features[:40], prototypes)
    shards = run_sharded(run, [features[:1], features[1:40]])
    assert shards[0].tau_g == pytest.approx(whole.tau_g, rel=1e-5)  # matchings solved to 1e-6
    scale = float(whole.logits.abs().max())
    logits = torch.cat([s.logits for s in shards])
    torch.testing.assert_close(logits, whole.logits, rtol=0, atol=1e-5 * scale)


def test_inputs_that_require_grad_give_outputs_that_do_not():
    features, prototypes = unit_world()
    plain = frolic_tta.frolic(features, prototypes)
    result = frolic_tta.frolic(features.requires_grad_(), prototypes.requires_grad_())
    assert not result.logits.requires_grad
    assert not any(
        getattr(result, name).requires_grad
        for name in ("zero_shot_logits", "gda_logits", "fused_logits", "beta")
    )
    torch.testing.assert_close(result.logits, plain.logits, rtol=0, atol=0)
    assert result.tau_g == plain.tau_g
    fit = frolic_tta.fit_frolic(features, prototypes)
    assert not fit.logits.requires_grad and not fit.sums.outer_sum.requires_grad


def test_non_unit_rows_need_an_explicit_normalize():
    features, prototypes = unit_world()
    raw = features * torch.linspace(0.31, 12.4, features.shape[0])[:, None]
    with pytest.raises(
        ValueError,
        match=r"Expected unit-norm rows in `features` \(.*\), but got row norms from 0\.31 to "
        r"12\.4\. Pass normalize=True to normalise them, or normalize=False to use them as "
        r"they are\.",
    ):
        frolic_tta.frolic(raw, prototypes)
    with pytest.raises(ValueError, match=r"unit-norm rows in `prototypes`.*from 2 to 2\."):
        frolic_tta.frolic(features, 2 * prototypes)
    with pytest.raises(TypeError, match=r"`normalize` to be True, False or None, but got 'yes'"):
        frolic_tta.frolic(features, prototypes, normalize="yes")
    normalised = frolic_tta.frolic(raw, 2 * prototypes, normalize=True)
    unit = frolic_tta.frolic(features, prototypes)
    scale = float(unit.logits.abs().max())  # float32 rounding of the normalised rows
    torch.testing.assert_close(normalised.logits, unit.logits, rtol=1e-5, atol=1e-5 * scale)
    as_is = frolic_tta.frolic(raw, prototypes, normalize=False)
    torch.testing.assert_close(as_is.features, raw)
    # float16 rounding of unit rows is within the (dtype-aware) tolerance
    assert frolic_tta.validation.non_unit_rows(features.half()) == 0
    assert frolic_tta.validation.non_unit_rows(features * 1.002) == features.shape[0]


def test_non_unit_rows_on_one_shard_stop_every_shard():
    from tests.sharding import run_sharded

    features, prototypes = unit_world()
    shards = [features[:30], 3 * features[30:]]

    def run(shard, reduce_fn):
        try:
            frolic_tta.frolic(shard, prototypes, reduce_fn=reduce_fn)
        except ValueError as error:
            return str(error)
        return None

    unit_shard, raw_shard = run_sharded(run, shards)  # both raise: nobody waits in a collective
    assert "row norms from 1 to 1 on this shard (30 rows off unit norm over all shards)" in (
        unit_shard or ""
    )
    assert "but got row norms from 3 to 3." in (raw_shard or "")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_oracle_row_on_confident_bayes_posteriors_is_no_worse_than_f_f():
    from frolic_tta.synthetic import prior_shift_world, zero_shot_view

    world = prior_shift_world(num_samples=300, num_classes=10, separation=1.5, seed=0)
    features, prototypes = zero_shot_view(world)  # zero-shot logits = the Bayes posterior
    result = frolic_tta.frolic(features, prototypes, tau_c=1.0, normalize=False)
    rows = result.ablations(world.labels)
    oracle = frolic_tta.accuracy(rows["oracle"], world.labels)
    assert oracle >= frolic_tta.accuracy(rows["f_f"], world.labels) - 0.01


def test_features_on_the_prototypes_get_the_smallest_ridge_with_a_warning():
    """No scatter at all: Sigma is rounding noise, so the head depends on the ridge (warned)."""
    _, prototypes = unit_world()
    features = prototypes[torch.arange(30) % 3]  # no within-class scatter at all
    with pytest.warns(UserWarning, match=r"added \S+ I to make it positive definite, which"):
        result = frolic_tta.frolic(features, prototypes)
    assert bool(torch.isfinite(result.logits).all())
    assert frolic_tta.accuracy(result.logits, torch.arange(30) % 3) == 1.0


@pytest.mark.parametrize("off_range", [1e-10, 0.0])
def test_a_ridge_is_warned_about_only_when_it_changes_the_head(off_range, monkeypatch):
    """A scatter with an eigenvalue below rounding (-1e-13): Cholesky fails and a ridge is
    added. Where the class means differ along that direction by about the ridge, the head's
    direction depends on the ridge and a warning says so; where they do not differ there, any
    ridge gives the same head and nothing is said."""
    import warnings

    from frolic_tta import gda

    sigma = torch.diag(torch.tensor([1.0, -1e-13], dtype=torch.float64))
    means = torch.tensor([[1.0, off_range], [-1.0, -off_range]], dtype=torch.float64)
    weights = torch.full((2,), 0.5, dtype=torch.float64)
    zero = torch.zeros(2, dtype=torch.float64)
    sums = gda.MomentSums(torch.tensor(2.0, dtype=torch.float64), zero, sigma, weights, means)
    monkeypatch.setattr(gda, "shared_covariance", lambda *args: (sigma, means, weights, 0.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        head = gda.fit_gaussian_head(sums, means.float(), "soft", "auto")
    assert bool(torch.isfinite(head.weight).all())
    said = [w for w in caught if "positive definite, which" in str(w.message)]
    assert len(said) == (1 if off_range else 0), [str(w.message) for w in caught]
    if off_range:
        assert said[0].filename.endswith("gda.py")  # attributed to our code
