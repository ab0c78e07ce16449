"""A feature store keeps its moment sums: a refit with the same prototypes skips their float64
pass and equals the run that wrote it; other prompts, part of the store, a float16 store or a
changed file never give sums of other features."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from frolic_tta.data.store import (
    MANIFEST,
    FeatureStoreError,
    load_store,
    write_manifest,
    write_shard,
)
from frolic_tta.data.store_moments import MOMENTS, same_samples
from frolic_tta.lightning.cli import main
from frolic_tta.lightning.store import add_store_moments
from frolic_tta.pipeline import shard_moment_sums
from tests.test_store import KEY, encoder_calls, read_run, store_args, write_three_ranks  # noqa: F401

OTHER_TEMPLATES = ("--model.templates", "[a blurry photo of a {}.]")


@pytest.fixture(scope="module")
def writer_threads():
    """The thread count the store is written with (the suite's)."""
    return torch.get_num_threads()


@pytest.fixture(scope="module")
def written(tiny_clip, image_folder, tmp_path_factory, writer_threads):
    """A store written by a 1-process run of the CLI, and that run's outputs."""
    root = tmp_path_factory.mktemp("moments")
    main(store_args(tiny_clip, image_folder, root / "write", root / "store"))
    return root / "store", read_run(root / "write")


def test_a_refit_uses_the_stored_sums_and_equals_the_run_that_wrote_them(
    written, writer_threads, tiny_clip, image_folder, tmp_path, encoder_calls  # noqa: F811
):
    store, (write_metrics, write_logits) = written
    entry = json.loads((store / MANIFEST).read_text())["moments"]
    assert entry["file"] == MOMENTS and entry["num_classes"] == 3
    assert entry["tau_c"] == pytest.approx(0.01, rel=1e-6)
    assert not write_metrics["moments_from_store"]
    # on the writer's threads, not encoder_calls' one: the prompts' bits follow the matrix
    # library's thread count (MKL's AVX2 kernels on an Intel Xeon: 84 of 96 entries 1.6e-7
    # apart between 2 threads and 1), and other bits are other prototypes to the store
    torch.set_num_threads(writer_threads)
    main(store_args(tiny_clip, image_folder, tmp_path, store))
    metrics, logits = read_run(tmp_path)
    assert encoder_calls == [] and metrics["moments_from_store"]
    for key in ("logits", "prediction", "confidence"):  # the run's own sums: bit for bit
        assert torch.equal(logits[key], write_logits[key]), key
    assert metrics["tau_g"] == write_metrics["tau_g"]


@pytest.mark.parametrize(
    "extra",
    [OTHER_TEMPLATES, ("--trainer.limit_predict_batches", "3", "--data.feature_batch_size", "4")],
    ids=["prompts", "part"],
)
def test_other_prompts_or_part_of_the_store_compute_the_sums_again(
    written, tiny_clip, image_folder, tmp_path, extra
):
    store, _ = written
    main(store_args(tiny_clip, image_folder, tmp_path / "refit", store, *extra))
    main(store_args(tiny_clip, image_folder, tmp_path / "plain", None, *extra))
    (refit, refit_logits), (plain, plain_logits) = (
        read_run(tmp_path / "refit"),
        read_run(tmp_path / "plain"),
    )
    assert not refit["moments_from_store"] and not plain["moments_from_store"]
    torch.testing.assert_close(refit_logits["logits"], plain_logits["logits"], rtol=0, atol=1e-6)
    assert torch.equal(refit_logits["prediction"], plain_logits["prediction"])


def test_a_changed_or_missing_moments_file_is_refused(written, tmp_path):
    store, _ = written
    copy = tmp_path / "store"
    copy.mkdir()
    for path in store.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    original = (copy / MOMENTS).read_bytes()
    (copy / MOMENTS).write_bytes(original[:-10] + b"0123456789")
    with pytest.raises(FeatureStoreError) as info:
        load_store(copy)
    assert str(info.value) == (
        f"Expected '{MOMENTS}' in the feature store '{copy}' to be the one its {MANIFEST} lists, "
        "but its size or SHA-256 differs: delete the store and encode again"
    )
    (copy / MOMENTS).unlink()
    with pytest.raises(FeatureStoreError, match=rf"^Expected '{MOMENTS}' in .* but it is missing"):
        load_store(copy)


def test_a_float16_store_keeps_the_sums_of_its_rounded_features_without_bad_samples(tmp_path):
    features, _ = write_three_ranks(tmp_path, torch.float16)
    prototypes = torch.nn.functional.normalize(torch.randn(4, 6), dim=1)
    add_store_moments(tmp_path, prototypes, 0.05)
    stored = load_store(tmp_path, KEY)
    sums = stored.moments.for_run(prototypes, 0.05)
    reference = shard_moment_sums(stored.features, prototypes, 0.05)  # as a refit reads them
    for name, value in sums.items():
        torch.testing.assert_close(value, getattr(reference, name), rtol=1e-12, atol=1e-12)
    original = shard_moment_sums(features, prototypes, 0.05)  # the float32 features
    assert not same_samples(original.count, original.feature_sum, sums)
    assert same_samples(reference.count, reference.feature_sum.flip(0).flip(0), sums)
    assert stored.moments.for_run(prototypes, 0.01) is None  # another tau_c
    nudged = prototypes.clone()
    nudged[0, 0] = torch.nextafter(nudged[0, 0], torch.tensor(2.0))
    assert stored.moments.for_run(nudged, 0.05) is None  # one ulp: other prototypes
    # a sample whose image could not be read is left out, as FrolicModule leaves it out
    bad = tmp_path / "bad"
    errors = ["", "unreadable image: OSError"] + [""] * 8
    write_shard(bad, 0, torch.arange(10), features, torch.arange(10) % 4, errors, key=KEY)
    write_manifest(bad, KEY, world_size=1)
    add_store_moments(bad, prototypes, 0.05)
    kept = load_store(bad, KEY).moments.sums
    assert float(kept["count"]) == 9.0
    usable = shard_moment_sums(features[torch.arange(10) != 1], prototypes, 0.05)
    torch.testing.assert_close(kept["soft_sum"], usable.soft_sum, rtol=1e-12, atol=1e-12)


def test_same_samples_tells_a_permutation_from_other_samples():
    g = torch.Generator().manual_seed(1)
    x = torch.nn.functional.normalize(torch.randn(500, 16, generator=g), dim=1).double()
    stored = {"count": torch.tensor(500.0, dtype=torch.float64), "feature_sum": x.sum(0)}
    assert same_samples(torch.tensor(500.0), x[torch.randperm(500, generator=g)].sum(0), stored)
    other = x.clone()
    other[7] = torch.nn.functional.normalize(torch.randn(16, generator=g), dim=0).double()
    assert not same_samples(torch.tensor(500.0), other.sum(0), stored)
    assert not same_samples(torch.tensor(499.0), x[1:].sum(0), stored)


def test_stores_without_moments_still_load(tmp_path: Path):
    write_three_ranks(tmp_path)
    assert load_store(tmp_path, KEY).moments is None
