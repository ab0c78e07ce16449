"""Online Frolic (frolic_tta.online): exact at the end of the stream, zero-shot while thin, no
harm on adversarial orders, the same on sharded streams."""

from __future__ import annotations

import warnings

import pytest
import torch

from frolic_tta import fit_frolic
from frolic_tta.online import OnlineFrolic, coverage
from frolic_tta.synthetic import clip_like_world, shifted_prior
from tests.sharding import run_sharded

TAU_C = 0.01


def stream(order: str, num_classes: int = 20, n: int = 2000, seed: int = 0):
    """``(features, prototypes, labels)`` of a clip-like world in the given arrival order."""
    prior = shifted_prior("long-tailed:10", num_classes, seed) if order == "long-tailed" else None
    world = clip_like_world(n, num_classes, 64, seed=seed, test_prior=prior)
    x, y = world.features, world.labels
    if order == "class-ordered":  # classes arrive one after another
        perm = torch.argsort(y, stable=True)
        x, y = x[perm], y[perm]
    return x, world.prototypes, y


def run_online(x, z, batch: int = 50, **kwargs):
    online = OnlineFrolic(z, tau_c=TAU_C, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        answers = [online.step(b) for b in x.split(batch)]
        fit = online.finalize()
    return online, answers, fit


def assert_same_fit(fit, ref, atol: float = 1e-6) -> None:
    assert fit.head.tau_g == pytest.approx(ref.head.tau_g, abs=atol)
    torch.testing.assert_close(fit.head.beta, ref.head.beta, rtol=0, atol=atol)
    torch.testing.assert_close(fit.head.test_prior, ref.head.test_prior, rtol=0, atol=atol)
    torch.testing.assert_close(
        fit.head.gaussian.weight, ref.head.gaussian.weight, rtol=1e-6, atol=0
    )
    torch.testing.assert_close(
        fit.logits, ref.logits, rtol=0, atol=atol * float(ref.logits.abs().max())
    )


@pytest.mark.parametrize("order", ["shuffled", "class-ordered"])
def test_end_of_stream_state_equals_fit_frolic_on_all_features(order):
    x, z, _ = stream(order)
    online, answers, fit = run_online(x, z, batch=37)  # batch does not divide N
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ref = fit_frolic(x, z, tau_c=TAU_C)
    assert_same_fit(fit, ref)
    assert answers[-1].seen == online.seen == x.shape[0]
    # the geometric schedule: refits at 2K, 4K, ... samples (count doubles), so log2 many
    seen = [r.seen for r in online.history]
    assert seen[0] >= 2 * z.shape[0]
    assert all(b >= 2 * a for a, b in zip(seen, seen[1:], strict=False))
    assert online.refits == len(seen) <= 6


def test_first_batches_answer_zero_shot_until_warmup():
    x, z, _ = stream("shuffled")
    # first refit at 40 samples; min_coverage=0: the thin-class rule alone (coverage: below)
    online = OnlineFrolic(z, tau_c=TAU_C, warmup=2.0, min_coverage=0.0)
    first = online.step(x[:25])
    assert (first.refit, first.seen, first.fitted_on) == (0, 25, 0)
    torch.testing.assert_close(first.logits, x[:25] @ z.t() / TAU_C)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        second = online.step(x[25:50])  # 50 >= 40: refit on both batches, answer with it
    assert (second.refit, second.seen, second.fitted_on) == (1, 50, 50)
    # f_d of the refit, but zero-shot where the zero-shot class held < 2 samples' mass
    thin = online.fit.sums.soft_count[second.zero_shot.argmax(1)] < 2.0
    assert torch.equal(second.fallback, thin) and 0 < int(thin.sum()) < 25
    expected = torch.where(thin[:, None], second.zero_shot, online.head.score(x[25:50]))
    torch.testing.assert_close(second.logits, expected)
    assert not torch.equal(second.logits.argmax(1), second.zero_shot.argmax(1))


def test_a_first_batch_large_enough_is_answered_by_its_own_fit():
    x, z, _ = stream("shuffled")
    online = OnlineFrolic(z, tau_c=TAU_C)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        first = online.step(x[:400])
        ref = fit_frolic(x[:400], z, tau_c=TAU_C)
    assert first.refit == 1 and int(first.fallback.sum()) < 40  # a few in classes < 2 mass
    expected = torch.where(first.fallback[:, None], first.zero_shot, ref.head.score(x[:400]))
    torch.testing.assert_close(first.logits, expected)


@pytest.mark.parametrize("order", ["shuffled", "class-ordered", "long-tailed"])
def test_online_is_never_worse_than_zero_shot_on_the_whole_stream(order):
    x, z, y = stream(order, num_classes=20, n=2000, seed=1)
    _, answers, _ = run_online(x, z, batch=40)
    online = float((torch.cat([a.logits.argmax(1) for a in answers]) == y).float().mean())
    zero_shot = float(((x @ z.t()).argmax(1) == y).float().mean())
    assert online >= zero_shot - 0.005, (online, zero_shot)


@pytest.mark.filterwarnings("ignore::UserWarning")  # catch_warnings is not thread-safe
def test_sharded_uneven_stream_ends_in_the_single_process_state():
    x, z, _ = stream("shuffled", n=1003)
    shards = [x[0::2], x[1::2]]  # 502 and 501 samples: 11 and 10 batches of 50 (..., 2, 1)
    batches = [s.split(50) for s in shards]
    batches[1] = batches[1][:-1]  # uneven: rank 1 has one batch fewer

    def run(shard_batches, reduce_fn):
        online = OnlineFrolic(z, tau_c=TAU_C, reduce_fn=reduce_fn)
        answers = [online.step(b) for b in shard_batches]
        online.pad_to(11)  # the shard whose stream ended early takes empty steps
        return answers, online.history, online.finalize()

    (a0, h0, f0), (a1, h1, f1) = run_sharded(run, batches)
    used = torch.cat([torch.cat(batches[0]), torch.cat(batches[1])])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ref = fit_frolic(used, z, tau_c=TAU_C)
    assert h0 == h1 and [a.seen for a in a0[:10]] == [a.seen for a in a1]
    for fit in (f0, f1):
        assert fit.head.tau_g == pytest.approx(ref.head.tau_g, abs=1e-6)
        # sharded sums are added in another order: beta (after the test prior's refits and
        # matchings, each stopped once the next step would move it by < 1e-6 in L1) agrees to
        # 2e-5 relative (measured 1.3e-5: ln beta, so the logits, within 1.3e-5 absolute); one
        # process equals fit_frolic exactly (above)
        torch.testing.assert_close(fit.head.beta, ref.head.beta, rtol=2e-5, atol=0)
    torch.testing.assert_close(torch.cat([f0.logits, f1.logits]), ref.logits, rtol=0, atol=1e-4)


def test_a_prefix_of_few_classes_is_answered_zero_shot():
    x, z, _ = stream("class-ordered")  # 100 per class: 400 samples hold 4 of 20 classes
    online = OnlineFrolic(z, tau_c=TAU_C)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        answer = online.step(x[:400])
    assert answer.refit == 1 and online.history[-1].coverage < 0.5
    assert answer.fallback.all() and torch.equal(answer.logits, answer.zero_shot)
    assert coverage(torch.ones(20)) == pytest.approx(1.0)
    assert coverage(torch.tensor([1.0, 1.0, 0.0, 0.0])) == pytest.approx(0.5)


def test_bad_arguments_say_what_was_expected():
    z = torch.eye(3)
    with pytest.raises(ValueError, match="Expected `growth` > 1, but got 1.0"):
        OnlineFrolic(z, growth=1.0)
    with pytest.raises(ValueError, match=r"Expected `min_coverage` in \[0, 1\], but got 2"):
        OnlineFrolic(z, min_coverage=2)
    with pytest.raises(ValueError, match="warmup"):
        OnlineFrolic(z, warmup=0.0)
    with pytest.raises(ValueError, match="to have 3 columns"):
        OnlineFrolic(z).step(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="only finite values"):
        OnlineFrolic(z).step(torch.full((2, 3), float("nan")))
