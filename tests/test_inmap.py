"""InMaP's proxies: the reference algorithm, better than the text prototypes, 2 shards == 1."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import frolic_tta
from frolic_tta import FrolicOptions
from frolic_tta.inmap import RELATIVE_TOLERANCE, convergence, fit_proxies, inmap_proxies
from frolic_tta.logits import identity_reduce
from frolic_tta.pipeline import text_test_prior
from frolic_tta.synthetic import clip_like_world, clip_world, shifted_prior
from tests.sharding import run_sharded

SPLIT = 1337  # uneven shards: 1337 vs 663 rows


@pytest.fixture(scope="module")
def world():
    return clip_world(num_samples=2000, seed=7)


def reference_inmap(feat, text, tau_t=0.01, tau_i=0.04, alpha=0.6, lr=10.0, iters=2000):
    """InMaP's ``sinkhorn`` + ``image_opt`` (github.com/idstcv/InMaP, main.py, Apache-2.0),
    re-typed: full (N, K) matrices, classifier as (d, K) columns, gamma = 0."""
    n, k = feat.shape[0], text.shape[0]
    plabel = F.softmax(feat @ text.T / tau_t, dim=1) / n
    for _ in range(20):
        plabel /= plabel.sum(0, keepdim=True)
        plabel /= k
        plabel /= plabel.sum(1, keepdim=True)
        plabel /= n
    plabel *= n
    val, idx = plabel.max(1)
    mask = val > alpha
    plabel[mask, :] = 0
    plabel[mask, idx[mask]] = 1
    base = feat.T @ plabel
    classifier = text.T.clone()
    pre_norm = float("inf")
    for _ in range(iters):
        grad = feat.T @ F.softmax(feat @ classifier / tau_i, dim=1) - base
        norm = torch.norm(grad)
        if norm > pre_norm:
            lr /= 2.0
        pre_norm = norm
        classifier -= (lr / (n * tau_i)) * grad
        classifier = F.normalize(classifier, dim=0)
    return classifier.T


def accuracy(features, prototypes, labels):
    return frolic_tta.accuracy(features.double() @ prototypes.double().T, labels)


def test_proxies_match_the_reference_code_at_its_defaults():
    world = clip_world(num_samples=600, seed=3)
    features, text = world.features.double(), F.normalize(world.prototypes.double(), dim=1)
    expected = reference_inmap(features, text)
    proxies, temperature = inmap_proxies(features, text, chunk_size=128)
    assert temperature == 0.04
    torch.testing.assert_close(proxies, expected, rtol=0, atol=1e-9)
    torch.testing.assert_close(proxies.norm(dim=1), torch.ones(20, dtype=torch.float64))


def test_proxies_beat_the_text_prototypes_and_frolic_adds_to_them(world):
    proxies, _ = inmap_proxies(world.features, world.prototypes)
    text = accuracy(world.features, world.prototypes, world.labels)
    inmap = accuracy(world.features, proxies, world.labels)
    assert inmap > text + 0.1  # measured: 0.30 -> 0.47
    # InMaP's own proxies: equal class masses (a balanced test prior), all 2,000 steps
    options = FrolicOptions(
        zero_shot="inmap", test_prior="uniform", solver={"inmap_tolerance": None}
    )
    result = frolic_tta.frolic(world.features, world.prototypes, options)
    torch.testing.assert_close(result.head.prototypes, proxies, rtol=0, atol=1e-6)
    assert result.head.tau_c == 0.04
    rows = {k: frolic_tta.accuracy(v, world.labels) for k, v in result.ablations().items()}
    assert rows["f_c"] == pytest.approx(inmap, abs=1e-3)  # f_c is InMaP's classifier
    assert rows["f_d"] > rows["f_c"] + 0.05  # measured: 0.47 -> 0.58


def test_fit_recomputes_the_sums_with_the_proxies(world):
    sums = frolic_tta.moment_sums(world.features, world.prototypes, 0.01)  # text soft sums
    kwargs = {"zero_shot": "inmap", "keep_logits": True}
    given, fresh = (
        frolic_tta.fit_frolic(world.features, world.prototypes, sums=s, **kwargs)
        for s in (sums, None)
    )
    torch.testing.assert_close(given.sums.soft_sum, fresh.sums.soft_sum)
    assert not torch.allclose(given.sums.soft_sum, sums.soft_sum)
    torch.testing.assert_close(given.logits, fresh.logits)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_two_uneven_shards_equal_one(world, dtype):
    features = world.features.to(dtype)
    whole = inmap_proxies(features, world.prototypes, iterations=500, chunk_size=300)
    parts = run_sharded(
        lambda shard, reduce_fn: inmap_proxies(
            shard, world.prototypes, iterations=500, chunk_size=300, reduce_fn=reduce_fn
        ),
        [features[:SPLIT], features[SPLIT:]],
    )
    # exact passes (N K d = 1.3e6): float64 sums, float32 logits rounded once from float64
    # products, so no row's value follows its chunk: 2e-15 measured (7e-15 with MKL's AVX2
    # kernels on an Intel Xeon, where float32 products put them 2.0e-5 apart). float32: a
    # logit that rounds to its other neighbour in one step moves a proxy by at most
    # eta u max|x| / (N tau_i) = 10 * 6e-8 / (2,000 * 0.04) = 7.5e-9
    tolerance = 1e-10 if dtype == torch.float64 else 1e-8
    for part in parts:
        torch.testing.assert_close(part.prototypes, whole.prototypes, rtol=0, atol=tolerance)


def test_sharded_frolic_on_inmap_equals_whole(world):
    whole = frolic_tta.fit_frolic(world.features, world.prototypes, zero_shot="inmap")
    parts = run_sharded(
        lambda shard, reduce_fn: frolic_tta.fit_frolic(
            shard, world.prototypes, zero_shot="inmap", reduce_fn=reduce_fn
        ),
        [world.features[:SPLIT], world.features[SPLIT:]],
    )
    for part in parts:
        assert part.head.tau_g == pytest.approx(whole.head.tau_g, rel=1e-5)
        torch.testing.assert_close(part.head.beta, whole.head.beta, rtol=0, atol=1e-5)
    logits = torch.cat([part.logits for part in parts])
    torch.testing.assert_close(logits, whole.logits, rtol=1e-4, atol=1e-3)


def test_an_empty_shard_takes_part_in_every_reduction(world):
    whole = inmap_proxies(world.features, world.prototypes, iterations=50)
    parts = run_sharded(
        lambda shard, reduce_fn: inmap_proxies(
            shard, world.prototypes, iterations=50, reduce_fn=reduce_fn
        ),
        [world.features, world.features[:0]],
    )
    torch.testing.assert_close(parts[1].prototypes, whole.prototypes, rtol=0, atol=1e-6)


def test_bad_options_and_arguments_say_what_was_expected(world):
    message = r"Expected `zero_shot` to be one of \('text', 'inmap', 'inmap_both'\)"
    with pytest.raises(ValueError, match=message):
        FrolicOptions(zero_shot="clip")
    x, z = world.features, world.prototypes
    with pytest.raises(ValueError, match="Expected `iterations` to be an int >= 0, but got -1"):
        inmap_proxies(x, z, iterations=-1)
    with pytest.raises(ValueError, match="Expected `temperature` to be a finite number > 0"):
        inmap_proxies(x, z, temperature=0.0)
    with pytest.raises(ValueError, match=r"Expected `features` to have 64 columns"):
        inmap_proxies(x[:, :10], z)
    with pytest.raises(ValueError, match="Expected `prototypes` to have at least 2 rows"):
        inmap_proxies(x, z[:1])


def test_command_line_runs_frolic_on_inmap(tiny_clip, image_folder, tmp_path, capsys):
    from frolic_tta.lightning.cli import main
    from tests.test_cli import tiny_args

    args = ["--model.options.zero_shot", "inmap", "--trainer.enable_progress_bar", "false"]
    main(tiny_args(tiny_clip, image_folder, tmp_path, *args, "--report.plots", "false"))
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["options"]["zero_shot"] == "inmap" and metrics["tau_c"] == 0.04
    assert any("InMaP" in note for note in metrics["notes"]) and "InMaP" in capsys.readouterr().out
    assert set(metrics["ece"]) == set(frolic_tta.ROWS)
    head = torch.load(tmp_path / "head.pt", weights_only=True)["frolic_head"]
    assert head["tau_c"] == 0.04  # the stored head scores with the proxies' temperature
    with pytest.raises(SystemExit) as exit_info:
        main(tiny_args(tiny_clip, image_folder, tmp_path, "--model.options.zero_shot", "clip"))
    assert exit_info.value.code == 2


def test_with_the_em_prior_the_labels_are_balanced_to_it():
    prior = shifted_prior("long-tailed:10", 6, seed=2)
    world = clip_like_world(600, 6, 16, seed=2, test_prior=prior)
    x, z = world.features, world.prototypes
    fit = frolic_tta.fit_frolic(x, z, zero_shot="inmap")
    pi = text_test_prior(x, z, 0.01, None, FrolicOptions(), identity_reduce, None)
    expected = fit_proxies(x, z, target=pi, **convergence(FrolicOptions()))
    torch.testing.assert_close(fit.head.prototypes, expected.prototypes, rtol=0, atol=1e-9)
    assert float(pi.max() / pi.min()) > 1.3  # imbalanced (measured 1.37): the labels follow it
    # the accuracy gain is measured on the label-shift worlds (benchmarks/peers.py), not here


def test_labels_balanced_to_a_shifted_prior_stop_at_the_relative_test():
    """Balanced to a long-tailed pi-tilde, InMaP's step is never halved and the proxies creep
    for over 1,000 steps before they move less than 1e-6; the relative test on ||G|| stops them
    after a few hundred, with the 2,000-step proxies' predictions."""
    prior = shifted_prior("long-tailed:10", 6, seed=2)
    world = clip_like_world(600, 6, 16, seed=2, test_prior=prior)
    x, z = world.features, world.prototypes
    corrected = FrolicOptions(bias_test="off")  # the label bias removed: a long-tailed pi-tilde
    pi = text_test_prior(x, z, 0.01, None, corrected, identity_reduce, None)
    assert convergence(FrolicOptions()) == {"tolerance": 1e-6, "relative_tolerance": 1e-3}
    fixed_steps = FrolicOptions(solver={"inmap_tolerance": None})
    assert convergence(fixed_steps)["relative_tolerance"] is None
    absolute = fit_proxies(x, z, target=pi, tolerance=1e-6)
    relative = fit_proxies(x, z, target=pi, tolerance=1e-6, relative_tolerance=RELATIVE_TOLERANCE)
    full = fit_proxies(x, z, target=pi)
    assert absolute.converged and absolute.steps > 1000  # measured: 1,088
    assert relative.converged and relative.steps < 400  # measured: 280
    assert not full.converged and full.steps == 2000
    full_pred = (x.double() @ full.prototypes.T).argmax(1)
    agree = (x.double() @ relative.prototypes.T).argmax(1) == full_pred
    assert float(agree.double().mean()) > 0.98
