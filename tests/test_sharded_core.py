"""Sharded (2 uneven shards) == whole, in threads and in a real 2-process gloo group."""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import frolic_tta
from frolic_tta.logits import TensorLogits
from frolic_tta.metrics import FrolicMoments
from frolic_tta.soft_sums import EXACT_SOFT_SUMS, posterior_sums
from frolic_tta.synthetic import clip_world, prior_shift_world
from tests.sharding import run_sharded

SPLIT = 1337  # uneven: 1337 vs 663 rows


@pytest.fixture(scope="module")
def world():
    return clip_world(num_samples=2000, seed=7)


def test_metric_shards_merge_to_whole(world):
    whole = FrolicMoments(world.prototypes)
    whole.update(world.features)
    first, second = FrolicMoments(world.prototypes), FrolicMoments(world.prototypes)
    for start in range(0, SPLIT, 100):  # several batches
        first.update(world.features[start : min(start + 100, SPLIT)])
    second.update(world.features[SPLIT:])
    first.merge_state(second)
    expected, merged = whole.compute(), first.compute()
    for name in ("count", "feature_sum", "outer_sum", "soft_count", "soft_sum"):
        torch.testing.assert_close(
            getattr(merged, name), getattr(expected, name), rtol=1e-12, atol=1e-9
        )
        assert getattr(merged, name).dtype == torch.float64
    functional = frolic_tta.moment_sums(world.features, world.prototypes, 0.01)
    torch.testing.assert_close(functional.outer_sum, expected.outer_sum)


@pytest.mark.parametrize(
    ("covariance", "bias"), [("soft", "soft"), ("paper", "paper"), ("soft", "implicit")]
)
def test_threads_sharded_equals_whole(world, covariance, bias):
    whole = frolic_tta.frolic(world.features, world.prototypes, covariance=covariance, bias=bias)
    shards = [world.features[:SPLIT], world.features[SPLIT:]]

    def run(features, reduce_fn):
        return frolic_tta.frolic(
            features, world.prototypes, covariance=covariance, bias=bias, reduce_fn=reduce_fn
        )

    results = run_sharded(run, shards)
    for result in results:
        assert result.tau_g == pytest.approx(whole.tau_g, rel=1e-6, abs=1e-9)
        torch.testing.assert_close(result.beta, whole.beta, rtol=0, atol=1e-6)
        # the paper's head is a function of the float64 moment sums alone (exact to 1e-9); the
        # default's labels are debiased by matchings solved to 1e-6 (measured: 5e-6 of scale)
        scale = float(whole.head.gaussian.weight.abs().max())
        tight = 1e-9 if covariance == "paper" else 2e-5 * scale
        torch.testing.assert_close(
            result.head.gaussian.weight, whole.head.gaussian.weight, rtol=1e-9, atol=tight
        )
    torch.testing.assert_close(
        torch.cat([r.logits for r in results]), whole.logits, rtol=1e-5, atol=1e-4
    )


def test_threads_sharded_label_bias_with_oracle():
    world = prior_shift_world(num_samples=3001, separation=0.5)
    cut = 1900
    for kwargs in ({"method": "soft"}, {"method": "paper"}):
        whole = frolic_tta.estimate_label_bias(world.logits, **kwargs)
        parts = run_sharded(
            lambda shard, reduce_fn, kw=kwargs: frolic_tta.estimate_label_bias(
                shard, reduce_fn=reduce_fn, **kw
            ),
            [world.logits[:cut], world.logits[cut:]],
        )
        for part in parts:
            torch.testing.assert_close(part, whole, rtol=0, atol=1e-6)
    whole = frolic_tta.estimate_label_bias(world.logits, labels=world.labels)
    parts = run_sharded(
        lambda shard, reduce_fn: frolic_tta.estimate_label_bias(
            shard[0], labels=shard[1], reduce_fn=reduce_fn
        ),
        [(world.logits[:cut], world.labels[:cut]), (world.logits[cut:], world.labels[cut:])],
    )
    torch.testing.assert_close(parts[0], whole, rtol=0, atol=1e-6)


def _gloo_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    torch.set_num_threads(1)
    data = clip_world(num_samples=2000, seed=7)
    features = data.features[:SPLIT] if rank == 0 else data.features[SPLIT:]

    def reduce_fn(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    metric = FrolicMoments(data.prototypes)
    metric.update(features)
    sums = metric.compute()  # torchmetrics syncs its "sum" states over the group
    result = frolic_tta.fit_frolic(features, data.prototypes, sums=sums, reduce_fn=reduce_fn)
    torch.save(
        {
            "tau_g": result.head.tau_g,
            "beta": result.head.beta,
            "count": sums.count,
            "outer": sums.outer_sum,
            "logits": result.logits,
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    dist.destroy_process_group()


def test_two_process_gloo_group_equals_whole(world):
    whole = frolic_tta.fit_frolic(world.features, world.prototypes)
    with tempfile.TemporaryDirectory() as out_dir:
        init_file = os.path.join(out_dir, "init")
        mp.spawn(_gloo_worker, args=(2, init_file, out_dir), nprocs=2, join=True)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]
    for rank in ranks:
        assert float(rank["count"]) == 2000.0
        torch.testing.assert_close(rank["outer"], whole.sums.outer_sum, rtol=1e-12, atol=1e-9)
        assert rank["tau_g"] == pytest.approx(whole.head.tau_g, rel=1e-6)
        torch.testing.assert_close(rank["beta"], whole.head.beta, rtol=0, atol=1e-6)
    logits = torch.cat([ranks[0]["logits"], ranks[1]["logits"]])
    torch.testing.assert_close(logits, whole.logits, rtol=1e-5, atol=1e-4)


def encoder_world(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """512 features of ``benchmarks/ddp.py``'s world (its small open_clip ViT, random weights,
    encoding the long-tailed pattern images; zero-shot 10 %), stored in float16, and its 10
    prototypes: weakly informative features, on which the rounding of float32 soft sums moved
    the test prior's weights and tau_g."""
    saved = torch.load(Path(__file__).parent / "data" / "encoder_world.pt", weights_only=True)
    features = torch.nn.functional.normalize(saved["features"].to(dtype), dim=1)
    return features, saved["prototypes"].to(dtype)


def sharded_logits(
    features: torch.Tensor, prototypes: torch.Tensor, parts: int, chunk_size: int | None = None
) -> tuple[torch.Tensor, float]:
    """f_d of DistributedSampler-style shards (rank r holds r, r + parts, ...), joined, and
    tau_g (the same on every shard)."""
    n = features.shape[0]
    index = [torch.arange(r, n, parts) for r in range(parts)]
    fits = run_sharded(
        lambda i, reduce: frolic_tta.fit_frolic(
            features[i], prototypes, reduce_fn=reduce, chunk_size=chunk_size
        ),
        index,
    )
    joined = torch.empty(n, prototypes.shape[0], dtype=features.dtype)
    for i, fit in zip(index, fits, strict=True):
        joined[i] = fit.logits
        assert fit.head.tau_g == fits[0].head.tau_g  # every shard took the same steps
    return joined, fits[0].head.tau_g


def test_float64_features_on_a_flat_mixture_agree_on_any_number_of_shards():
    # the Newton phase worked in place on float64 logits (``.to(float64)`` is no copy):
    # the buffer was overwritten by its exponentials and the Hessian became inf (a crash);
    # then EM's step test stopped the test prior's weights wherever their path crossed it
    # (2e-6 apart); now Newton's steps end at the fixed point: 8e-13 measured
    features, prototypes = encoder_world(torch.float64)
    whole, tau_g = sharded_logits(features, prototypes, 1)
    for parts in (2, 3):
        other, other_tau_g = sharded_logits(features, prototypes, parts)
        assert float((whole - other).abs().max() / whole.abs().max()) < 1e-9
        assert other_tau_g == pytest.approx(tau_g, rel=1e-9)


@functools.cache
def float32_sensitivity(entries: int = 12) -> tuple[float, float]:
    """What the float32 features of :func:`encoder_world` determine: the largest relative
    change of tau_g and of the logits (against the largest) when one feature entry moves by
    one float32 unit in the last place, over ``entries`` entries drawn with a fixed seed."""
    features, prototypes = encoder_world(torch.float32)
    base = frolic_tta.fit_frolic(features, prototypes)
    g = torch.Generator().manual_seed(0)
    tau_g = logits = 0.0
    for _ in range(entries):
        i = int(torch.randint(features.shape[0], (1,), generator=g))
        j = int(torch.randint(features.shape[1], (1,), generator=g))
        moved = features.clone()
        moved[i, j] = torch.nextafter(moved[i, j], torch.tensor(torch.inf))
        fit = frolic_tta.fit_frolic(moved, prototypes)
        tau_g = max(tau_g, abs(fit.head.tau_g / base.head.tau_g - 1.0))
        change = (fit.logits - base.logits).abs().max() / base.logits.abs().max()
        logits = max(logits, float(change))
    return tau_g, logits


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("chunk_size", [None, 97])
def test_float32_features_on_a_flat_mixture_agree_on_any_number_of_shards(chunk_size):
    # float32 soft sums grouped by shard put them 2.1e-4 (2 shards) and 1.6e-4 (3 shards) of
    # the largest logit apart, one prediction of 512 changed; float64 soft sums: about 3e-6,
    # 1.25e-5 with AVX-512 kernels (a float32 product's rounding follows the number of rows
    # in it, float32 column sums the rows that share a chunk, and the test prior's EM stopped
    # wherever its path crossed the tolerance: its weights 1.7e-4 apart). Exact passes and
    # Newton's fixed point: identical logits, tau_g to 1e-16, on an AMD EPYC under every
    # kernel set. Not on an Intel Xeon, where MKL takes its AVX-512 kernels: there the refitted
    # head differs between 1 and 2 shards in its last float64 bits (its sums over samples are
    # added in another order), so one of the 5,120 component log-likelihoods rounds to the
    # other float32 neighbour, and this flat mixture's refits carry that one unit to 6.2e-6 of
    # the largest logit and 5.0e-6 of tau_g (``MKL_ENABLE_INSTRUCTIONS=AVX2``: no flip).
    # Float64 logits took the flip away (tau_g to 5e-12) but left the last bits of every
    # product to the matrix library's blocking, which moved a capped fit's tau_g by 5 % between
    # two chunk sizes (test_estimator_edges). The bound is the world's own: one float32 unit
    # in one of its 32,768 feature entries moves tau_g by up to 9.2e-6 and the logits by up to
    # 1.3e-5 of the largest (12 entries; median 2.4e-6 for tau_g), so the float32 data do not
    # determine tau_g better than that, and a float32 rounding elsewhere is held to the same
    tau_bound, logit_bound = float32_sensitivity()
    features, prototypes = encoder_world(torch.float32)
    whole, tau_g = sharded_logits(features, prototypes, 1)
    for parts in (1, 2, 3):
        other, other_tau_g = sharded_logits(features, prototypes, parts, chunk_size)
        assert float((whole - other).abs().max() / whole.abs().max()) <= logit_bound
        assert torch.equal(whole.argmax(1), other.argmax(1))
        assert abs(other_tau_g / tau_g - 1.0) <= tau_bound


def test_soft_sums_are_float64_where_cheap():
    # the same rows grouped in chunks of 97 or of 512: float64 products do not see the grouping
    features, prototypes = encoder_world(torch.float32)
    logits = features @ prototypes.t() / 0.01
    offset = torch.linspace(-1.0, 1.0, prototypes.shape[0], dtype=torch.float64)
    n, (k, d) = features.shape[0], prototypes.shape
    assert n * k * d <= EXACT_SOFT_SUMS

    def sums(rows: int, total: float) -> torch.Tensor:
        return posterior_sums(TensorLogits(logits, rows), offset, features, total=total)

    exact = float((sums(97, n) - sums(512, n)).abs().max())
    rounded = float((sums(97, 2 * EXACT_SOFT_SUMS) - sums(512, 2 * EXACT_SOFT_SUMS)).abs().max())
    assert exact < 1e-10 < 1e-7 < rounded  # above the limit: float32 products, grouped (8e-5)
    reference = torch.softmax(logits.double() + offset, dim=1).t() @ features.double()
    assert float((sums(97, n)[k:].reshape(k, d) - reference).abs().max()) < 1e-4
