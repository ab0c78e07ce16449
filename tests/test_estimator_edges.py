"""Edges of the estimator found by fuzzing its options (issue 35, item 7), each rebuilt first:
the paper's covariance on rank-deficient data, twin prototypes, a matching stopped at its cap,
and the online zero-shot of half-precision features."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import frolic_tta
from frolic_tta.errors import FrolicInputError
from frolic_tta.online import OnlineFrolic
from frolic_tta.synthetic import clip_like_world, clip_world
from tests.sharding import run_sharded

SINGULAR = "Expected the Eq. 7 covariance to be invertible, but it is singular (rank"


def unit(tensor: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(tensor, dim=1)


def rank_deficient(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    prototypes = unit(torch.randn(5, 32, generator=g))
    features = unit(torch.randn(20, 32, generator=g))
    return (features if kind == "fewer" else features[:1].repeat(50, 1)), prototypes


@pytest.mark.parametrize("kind", ["fewer", "identical"])
def test_the_papers_covariance_on_rank_deficient_data_raises_on_every_shard(kind):
    # N = 20 < d = 32 (rank 25 = N + K) or 50 identical rows: the LU solve accepted pivots of
    # 1e-19, logits reached 7.6e8, reversing the rows changed 18 of 20 predictions
    features, prototypes = rank_deficient(kind)
    with pytest.raises(FrolicInputError, match=re.escape(SINGULAR)):
        frolic_tta.frolic(features, prototypes, frolic_tta.paper_options())
    with pytest.raises(FrolicInputError, match="use covariance='soft'"):
        frolic_tta.frolic(features, prototypes, covariance="paper")
    errors = run_sharded(
        lambda shard, reduce_fn: _error(shard, prototypes, reduce_fn),
        [features[:7], features[7:]],
    )
    assert errors[0] == errors[1] and errors[0].startswith(SINGULAR)


def _error(features: torch.Tensor, prototypes: torch.Tensor, reduce_fn) -> str:
    try:
        frolic_tta.fit_frolic(features, prototypes, covariance="paper", reduce_fn=reduce_fn)
    except FrolicInputError as error:
        return str(error)
    return ""


def test_the_papers_covariance_where_it_is_invertible_is_unchanged():
    world = clip_world(num_samples=600)
    result = frolic_tta.frolic(world.features, world.prototypes, covariance="paper")
    sums = result.sums
    sigma = sums.outer_sum / sums.count
    z = world.prototypes.double()
    sigma = sigma - z.t() @ z / z.shape[0]
    mean = sums.feature_sum / sums.count
    expected = torch.linalg.solve(sigma, (z - mean).t()).t()  # Eq. 9, centred
    torch.testing.assert_close(result.head.gaussian.weight, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("options", ["paper", "default"])
def test_twin_prototypes_are_named_in_a_warning(options):
    world = clip_world(num_samples=600)
    prototypes = world.prototypes.clone()
    prototypes[5] = prototypes[2]
    chosen = frolic_tta.paper_options() if options == "paper" else frolic_tta.FrolicOptions()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        frolic_tta.frolic(world.features, prototypes, chosen)
    messages = [str(w.message) for w in caught if "identical prototypes" in str(w.message)]
    assert len(messages) == 1
    assert messages[0].startswith("classes 2 and 5 have identical prototypes (1 such pair(s))")
    assert ("depend on their order" in messages[0]) == (options == "paper")


@pytest.mark.parametrize("cap", [5, 100])
def test_a_capped_or_converged_fit_does_not_depend_on_the_chunk_size(cap):
    # a matching stopped at max_iter left tau_g dependent on chunk_size (0.006627 against
    # 0.006522 at tau_c = 1e-4): where the passes are exact the path, and so the stop, is the
    # same for any chunking (N < K included)
    for world in (clip_world(num_samples=2000), clip_like_world(300, 500, 64)):
        fits = []
        for chunk_size in (None, 97):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                fits.append(
                    frolic_tta.fit_frolic(
                        world.features,
                        world.prototypes,
                        tau_c=1e-4,
                        chunk_size=chunk_size,
                        solver={"max_iter": cap},
                    )
                )
        assert fits[1].head.tau_g == pytest.approx(fits[0].head.tau_g, rel=1e-9)
        assert torch.equal(fits[0].logits.argmax(1), fits[1].logits.argmax(1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_online_zero_shot_of_half_precision_features_is_scored_in_float32(dtype):
    # the step scored f_c / tau_c in the input's dtype: 30 of 2,000 argmaxes changed in
    # bfloat16, inf at tau_c = 1e-5
    world = clip_world(num_samples=2000)
    features = world.features.to(dtype)
    online = OnlineFrolic(world.prototypes, tau_c=1e-5)
    step = online.step(features)
    expected = features.double() @ world.prototypes.double().t() / 1e-5
    assert step.zero_shot.dtype == torch.float32
    assert bool(torch.isfinite(step.zero_shot).all())
    torch.testing.assert_close(step.zero_shot, expected.float(), rtol=1e-6, atol=0)
    assert torch.equal(step.zero_shot.argmax(1), expected.argmax(1))
