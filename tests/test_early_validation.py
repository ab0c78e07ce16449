"""Inputs refused early and exactly: ``fit_frolic(sums=...)`` checked against the features and
prototypes, the integer rule of ``max_skipped_fraction``, and an unshrunk covariance of
rank-deficient data named as an option to change (issue 16, found 9)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import frolic_tta
from frolic_tta.errors import FrolicInputError
from frolic_tta.lightning.samples import SkippedSamples
from frolic_tta.pipeline import shard_moment_sums
from tests.sharding import outcomes_sharded


def data(n: int = 40, k: int = 3, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    z = torch.nn.functional.normalize(torch.randn(k, d, generator=g), dim=1)
    x = z[torch.arange(n) % k] + 0.3 * torch.randn(n, d, generator=g)
    return torch.nn.functional.normalize(x, dim=1), z


def test_sums_are_checked_against_features_and_prototypes():
    x, z = data()
    sums = shard_moment_sums(x, z, 0.01, None)
    fit = frolic_tta.fit_frolic(x, z, sums=sums)  # its own sums: accepted
    assert fit.head.tau_g > 0
    empty = shard_moment_sums(x[:0], z, 0.01, None)
    with pytest.raises(ValueError, match="Expected `sums` of at least one sample, but their count"):
        frolic_tta.fit_frolic(x, z, sums=empty)
    four = torch.cat([z, z[:1]])
    with pytest.raises(ValueError, match=r"Expected `sums` for K=4 classes and d=8 dimensions"):
        frolic_tta.fit_frolic(x, four, sums=sums)
    other, _ = data(seed=1)
    foreign = shard_moment_sums(other, z, 0.01, None)  # same N, other data
    with pytest.raises(ValueError, match="Expected `sums` to be the moment sums of `features`"):
        frolic_tta.fit_frolic(x, z, sums=foreign)
    doubled = dataclasses.replace(sums, count=sums.count * 2)
    with pytest.raises(ValueError, match=r"\(N=40\), but their count is 80"):
        frolic_tta.fit_frolic(x, z, sums=doubled)


def test_foreign_sums_raise_on_every_shard():
    x, z = data()
    other, _ = data(seed=1)
    foreign = shard_moment_sums(other, z, 0.01, None)
    parts = [x[:15], x[15:]]
    outcomes = outcomes_sharded(
        lambda part, reduce_fn: frolic_tta.fit_frolic(part, z, sums=foreign, reduce_fn=reduce_fn),
        parts,
    )
    assert all(isinstance(o, ValueError) for o in outcomes), outcomes
    assert all("moment sums of `features`" in str(o) for o in outcomes)


@pytest.mark.parametrize(
    ("fraction", "total", "allowed"), [(0.29, 100, 29), (0.07, 100, 7), (0.1, 30, 3), (0.05, 10, 1)]
)
def test_max_skipped_fraction_is_an_exact_integer_rule(fraction, total, allowed):
    skipped = SkippedSamples(fraction, total)
    assert skipped.allowed(total) == allowed
    skipped.records.append({"index": 0, "reason": "unreadable"})
    skipped.check_total(allowed, total)  # exactly the share: accepted
    with pytest.raises(ValueError, match=f"max_skipped_fraction={fraction:g}"):
        skipped.check_total(allowed + 1, total)


def test_no_shrinkage_on_rank_deficient_data_names_the_option():
    x, z = data(n=6, d=16)  # N < d: the scatter has rank at most N - 1
    with pytest.raises(FrolicInputError, match=r"--model.options.shrinkage auto\)$"):
        frolic_tta.fit_frolic(x, z, shrinkage=None)
