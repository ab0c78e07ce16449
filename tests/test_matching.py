"""Class-mass matching (frolic_tta.matching): converges to 1e-6 where the diagonal steps crawl,
lands on the same fixed point on any number of shards, and steps towards the bound in flat
directions."""

from __future__ import annotations

import pytest
import torch

import frolic_tta.matching
from frolic_tta.logits import TensorLogits
from frolic_tta.matching import match_class_masses
from frolic_tta.pipeline import fit_frolic
from frolic_tta.synthetic import clip_like_world
from tests.sharding import run_sharded


def confident_logits() -> torch.Tensor:
    """label_shift.py's over-confident world: clip_like_world scored at tau_c = 0.002."""
    world = clip_like_world(20_000, 50, 128, seed=7)
    return (world.features @ world.prototypes.T / 0.002).float()


def test_hard_posteriors_converge_to_1e_6_in_few_passes():
    logits = confident_logits()
    match = match_class_masses(TensorLogits(logits, None), eps=1e-6, max_iter=100)
    assert match.converged and match.evaluations <= 30  # measured: 13
    assert match.mass_error < 1e-6
    debiased = torch.softmax(logits.double() + match.log_offset, 1).mean(0)
    assert float((debiased - 0.02).abs().sum()) < 1e-6  # the class masses are uniform


def test_two_and_three_shards_land_on_the_single_process_fixed_point():
    # exact passes (float64 sums over samples), as fit_frolic takes them at this size (N K d
    # of 1.3e8, frolic_tta.logits.exact_arithmetic): the offsets added to logits of scale ~300
    # agree to 6e-9 (measured; an Intel Xeon, AVX-512): the same fixed point, not the same
    # stopping point. Float32 column sums left them 1e-4 apart on an AMD EPYC and 2e-4 on the
    # Xeon, the rounding of the chunks' sums
    logits = confident_logits()
    whole = match_class_masses(TensorLogits(logits, None, exact=True), eps=1e-6)
    for cuts in ([7_000], [3_001, 12_345]):
        parts = list(torch.tensor_split(logits, cuts))

        def run(part, reduce_fn):
            source = TensorLogits(part, 4096, exact=True)
            return match_class_masses(source, eps=1e-6, reduce_fn=reduce_fn)

        for sharded in run_sharded(run, parts):
            assert sharded.converged
            torch.testing.assert_close(sharded.log_offset, whole.log_offset, rtol=0, atol=1e-6)


def shared_and_alone(alone: int) -> torch.Tensor:
    """60 samples shared by classes 0 and 1 (random margins) and ``alone`` samples that only
    class 2 can take: class 2's posteriors are exactly 0 or 1, so it shares no sample with
    classes 0 and 1, and their Hessian block is singular along (1, 1)."""
    g = torch.Generator().manual_seed(0)
    margin = torch.randn(60, generator=g, dtype=torch.float64)
    shared = torch.stack([margin, -margin, torch.full_like(margin, -200.0)], 1)
    rest = torch.tensor([[-200.0, -200.0, 0.0]], dtype=torch.float64).repeat(alone, 1)
    return torch.cat([shared, rest]).float()


def test_a_group_that_shares_no_sample_is_matched_within_itself():
    logits = shared_and_alone(30)  # class 2 holds exactly its third: 0 and 1 split the rest
    match = match_class_masses(TensorLogits(logits, None), eps=1e-6, bound=5.0)
    assert match.converged and match.evaluations < 40
    debiased = torch.softmax(logits.double() + match.log_offset, 1).mean(0)
    assert float((debiased - 1 / 3).abs().sum()) < 1e-6


def test_a_flat_direction_steps_to_the_bound_and_shards_agree():
    logits = shared_and_alone(20)  # class 2 can never reach its third: J is linear along it
    whole = match_class_masses(TensorLogits(logits, None), eps=1e-6, bound=5.0)
    assert whole.converged and whole.evaluations < 40
    assert bool(whole.undetermined.all())  # the KKT point: every class at the bound
    assert float(whole.log_offset.max() - whole.log_offset.min()) == pytest.approx(10.0)

    def run(part, reduce_fn):
        return match_class_masses(
            TensorLogits(part, None), eps=1e-6, bound=5.0, reduce_fn=reduce_fn
        )

    for sharded in run_sharded(run, [logits[::2], logits[1::2]]):
        torch.testing.assert_close(sharded.log_offset, whole.log_offset, rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 2])
def test_a_bound_just_wider_than_the_solution_costs_few_passes(seed):
    """The gauge (J ignores a constant added to b) is kept inside the box by the least shift:
    before, the steps' drift pushed classes into a bound their spread does not reach, and the
    matching crawled (measured at K = 40: 16 and 22 passes against 12 and 11 unbounded; at
    ImageNet size 16 passes with three full-Hessian sums against 9)."""
    world = clip_like_world(4_000, 40, 64, seed=seed)
    source = TensorLogits((world.features @ world.prototypes.T / 0.01).float(), None)
    free = match_class_masses(source, eps=1e-6, max_iter=200)
    log_beta = torch.log(free.beta)
    bound = float(log_beta.max() - log_beta.min()) / 2 * 1.02
    bounded = match_class_masses(source, eps=1e-6, max_iter=200, bound=bound)
    assert bounded.converged and bounded.evaluations <= free.evaluations + 3  # measured: +1, +3
    assert float((bounded.beta - free.beta).abs().sum()) < 1e-5


@pytest.mark.parametrize("scale", [1.0, 5.0])
def test_the_exponentials_of_a_spare_buffer_land_on_the_same_fixed_point(scale):
    # tau_c = 0.01 (rows spread ~20 nats: the exponentials serve every pass) and the same
    # logits x5 (the over-confident rows spread past 80 nats: every pass falls back to one
    # exponential per entry); either way the fixed point of the plain passes
    world = clip_like_world(6_000, 40, 64, seed=3)
    logits = (world.features @ world.prototypes.T / 0.01).float() * scale
    plain = match_class_masses(TensorLogits(logits, 1000), eps=1e-6)
    spare = torch.full_like(logits, float("nan"))
    lent = match_class_masses(TensorLogits(logits, 1000), eps=1e-6, spare=spare)
    assert lent.converged and plain.converged
    assert lent.exponentials is not None and lent.exponentials.values is spare
    assert (lent.exponentials.depth < 80.0) == (scale == 1.0)
    torch.testing.assert_close(lent.beta, plain.beta, rtol=1e-5, atol=0.0)
    assert abs(lent.evaluations - plain.evaluations) <= 1
    def error(beta):  # float64 L1 distance of the debiased masses to uniform
        masses = torch.softmax(logits.double() - torch.log(beta), 1).mean(0)
        return float((masses - 1.0 / 40).abs().sum())

    assert error(lent.beta) == pytest.approx(error(plain.beta), abs=2e-6)
    assert (error(lent.beta) < 2e-6) == (scale == 1.0)  # x5: classes at the bound stay off


def zero_shot_right_almost_everywhere() -> torch.Tensor:
    """A small analogue of finalize.py's confident ImageNet world (issue 35, item 6): zero-shot
    right on 0.976 of the samples at tau_c = 0.01, every class's posteriors so hard that its
    bias moves less than one sample's mass (N h_j < 1: undetermined)."""
    world = clip_like_world(3000, 100, 256, noise=0.2, tilt=0.05, seed=0)
    return (world.features.double() @ world.prototypes.double().T / 0.01).float()


def test_undetermined_classes_stop_once_their_masses_match():
    # before: 100 passes (the cap), not converged, the masses matched to 1e-8 after a dozen
    logits = zero_shot_right_almost_everywhere()
    match = match_class_masses(TensorLogits(logits, None, True), eps=1e-6, max_iter=100)
    assert bool(match.undetermined.all())
    assert match.converged and match.evaluations <= 15  # measured: 11
    debiased = torch.softmax(logits.double() + match.log_offset, 1).mean(0)
    assert float((debiased - 0.01).abs().sum()) < 1e-6  # the class masses are uniform
    parts = list(torch.tensor_split(logits, [1_001]))

    def run(part, reduce_fn):
        source = TensorLogits(part, 512, True)  # exact sums, as fit_frolic's at this size
        return match_class_masses(source, eps=1e-6, reduce_fn=reduce_fn)

    for sharded in run_sharded(run, parts):  # the stop is decided on reduced values
        assert sharded.converged and sharded.evaluations == match.evaluations
        torch.testing.assert_close(sharded.log_offset, match.log_offset, rtol=0, atol=1e-9)


def test_a_fit_where_zero_shot_is_right_almost_everywhere_takes_few_passes():
    world = clip_like_world(3000, 100, 256, noise=0.2, tilt=0.05, seed=0)
    calls = []

    def reduce_fn(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(tensor.shape)
        return tensor

    with pytest.warns(UserWarning, match="do not determine"):
        fit_frolic(world.features, world.prototypes, tau_c=0.01, reduce_fn=reduce_fn)
    assert len(calls) <= 60  # measured: 36 (before: 334, every matching at its cap)


def test_many_classes_without_the_full_hessian_reach_1e_6(monkeypatch):
    # K = 5,000 > 4,096: diagonal steps only. Zero-shot 0.017, 3,932 classes undetermined:
    # steps of up to 10 in b overshoot and are halved every other pass (100 passes, the cap,
    # not converged); up to 3 (_DIAGONAL_STEP): 21 passes, on 1 and 2 shards alike
    world = clip_like_world(6_000, 5_000, 64, seed=0, sample=True)
    logits = world.features @ world.prototypes.T / 0.01
    whole = match_class_masses(TensorLogits(logits, None), eps=1e-6, max_iter=100)
    assert whole.converged and whole.evaluations <= 30 and whole.mass_error < 1e-6
    debiased = torch.softmax(logits.double() + whole.log_offset, 1).mean(0)
    assert float((debiased - 1 / 5_000).abs().sum()) < 1e-6  # the class masses are uniform
    index = [torch.arange(6_000)[i::2] for i in range(2)]
    parts = run_sharded(
        lambda rows, reduce: match_class_masses(
            TensorLogits(logits[rows], None), eps=1e-6, max_iter=100, reduce_fn=reduce
        ),
        index,
    )
    for part in parts:  # the fixed point's beta-hat, to the tolerance (1e-6 in L1)
        assert part.evaluations == whole.evaluations
        assert float((part.beta - whole.beta).abs().sum()) < 1e-5
    monkeypatch.setattr(frolic_tta.matching, "_DIAGONAL_STEP", 10.0)
    longer = match_class_masses(TensorLogits(logits, None), eps=1e-6, max_iter=100)
    assert not longer.converged
