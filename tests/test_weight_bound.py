"""The segment's bound on what mixture weights can still gain (frolic_tta.weight_bound): a bound,
never looser than Cover's at either end, the same formula as an independent float64 reference
on any chunking and any number of shards, and what it saves in the label-bias test."""

from __future__ import annotations

import math

import pytest
import torch

from frolic_tta import mixture
from frolic_tta.logits import TensorLogits, identity_reduce
from frolic_tta.mixture import em_pass_beside, log_likelihood, mixture_weights
from frolic_tta.weight_bound import GRID, SecondWeights, segment_bound
from tests.sharding import run_sharded


def segment(source, first, second, reduce_fn=identity_reduce):
    """``(l(first), Cover's bound at first, the segment's bound)`` from one pass."""
    paired = SecondWeights(first, second, source.exact)
    _, at, extra = em_pass_beside(source, first, reduce_fn, paired.sums, paired.add)
    ell = float(at.log_likelihood)
    return ell, ell + at.headroom(), segment_bound(float(at.count), at.gradient, extra)


def separated_world(seed=0, n=3000):
    """Six well separated 1-D components (hard posteriors), an imbalanced sample."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.arange(6, dtype=torch.float64) * 4.0
    mix = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05])
    x = centres[torch.multinomial(mix, n, True, generator=g)]
    x = x + torch.randn(n, generator=g, dtype=torch.float64)
    return -0.5 * (x[:, None] - centres[None, :]) ** 2


def separated_problem():
    """``(source, maximiser, max l, low, high)``: weights off on opposite sides of the
    maximiser, whose gradients peak at different classes."""
    source = TensorLogits(separated_world(), 1000)
    best, *_ = mixture_weights(source, tol=1e-13)
    top = log_likelihood(source, best, identity_reduce)[0]
    low = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.1, 0.1], dtype=torch.float64)
    high = torch.tensor([0.7, 0.05, 0.05, 0.05, 0.1, 0.05], dtype=torch.float64)
    return source, best, top, low, high


def test_the_segment_bound_holds_and_beats_covers_bound_at_both_ends():
    source, best, top, low, high = separated_problem()
    for first, second in ((low, high), (high, low), (low, torch.full((6,), 1 / 6).double())):
        ell, cover, bound = segment(source, first, second)
        other = log_likelihood(source, second, identity_reduce)
        ends = min(cover, other[0] + other[1])  # Cover's bound at either end
        assert ell <= top <= bound <= ends + 1e-9 * abs(top)
    ell, cover, bound = segment(source, low, high)
    assert bound - top < 0.5 * (min(cover, sum(log_likelihood(source, high, identity_reduce)))
                                - top)  # fmt: skip
    # at the maximiser itself both vanish: nothing left
    assert segment(source, best, low)[2] == pytest.approx(top, abs=1e-6)


def reference_bound(g, first, second):
    """The module docstring's formula on the whole float64 matrix, grid point by grid point."""
    a = g.double().exp()
    n1, n2 = a @ first, a @ second
    best = math.inf
    for t in torch.linspace(0.0, 1.0, GRID, dtype=torch.float64).tolist():
        u = (1 - t) / n1 + t / n2
        best = min(best, float(-u.log().sum() + len(g) * torch.log((a.t() @ u).max() / len(g))))
    return best


@pytest.mark.parametrize("exact", [True, False])
def test_the_segment_bound_is_the_float64_formula_on_any_chunking_and_shards(exact):
    g = torch.Generator().manual_seed(3)
    logits = (4.0 * torch.randn(600, 9, generator=g)).to(torch.float64 if exact else torch.float32)
    first = torch.softmax(torch.randn(9, generator=g, dtype=torch.float64), 0)
    second = torch.softmax(2 * torch.randn(9, generator=g, dtype=torch.float64), 0)
    reference = reference_bound(logits, first, second)
    # float32 logits: each row's norm and each gradient entry a float32 sum of at most
    # max(rows, K) positive terms, so relatively within (max(rows, K) + 8) u, which moves the
    # bound by at most N times that (derived, not tuned; exact: float64 throughout)
    n, k = logits.shape
    unit = torch.finfo(logits.dtype).eps / 2
    tol = 1e-12 * abs(reference) if exact else n * (max(n, k) + 8) * unit
    whole = segment(TensorLogits(logits, 600, exact), first, second)[2]
    assert abs(whole - reference) <= tol
    chunked = segment(TensorLogits(logits, 64, exact), first, second)[2]
    assert abs(chunked - reference) <= tol
    shards = [logits[rank::3] for rank in range(3)]
    parts = run_sharded(
        lambda rows, reduce_fn: segment(TensorLogits(rows, 50, exact), first, second, reduce_fn),
        shards,
    )
    assert all(part[2] == parts[0][2] for part in parts)  # the same bits on every shard
    assert abs(parts[0][2] - reference) <= tol
    if not exact:  # measured within 3e-4 nats of each other, the bound at 2,757
        assert tol < 1e-4 * abs(reference)


def test_a_solve_stops_at_its_ceiling_sooner_and_never_below_the_maximum(monkeypatch):
    source, _, top, low, high = separated_problem()
    # l-hat <= top + 200 is certain one pass sooner on the segment to `low` (2 against 3)
    plain = mixture_weights(source, high, ceiling=top + 200.0)
    paired = mixture_weights(source, high, ceiling=top + 200.0, towards=low)
    assert plain[3] and paired[3] and paired[2] < plain[2]
    # a ceiling under the maximum is never certain: both solve to the same maximiser
    plain = mixture_weights(source, high, ceiling=top - 1.0, tol=1e-12)
    segments = []
    monkeypatch.setattr(
        mixture, "SecondWeights", lambda *a: segments.append(1) or SecondWeights(*a)
    )
    paired = mixture_weights(source, high, ceiling=top - 1.0, tol=1e-12, towards=low)
    for weights, *_ in (plain, paired):
        assert log_likelihood(source, weights, identity_reduce)[0] == pytest.approx(top, abs=1e-6)
    # and the segment is read only until l(pi) passes the ceiling: no bound can help after it
    assert 0 < len(segments) < paired[2]
