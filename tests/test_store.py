"""The feature store: written by 2 processes and read by 1, a refit equals a run that encodes, the
encoder does not run on a refit, and a store of other features or a broken one is refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import open_clip
import pytest
import torch

from frolic_tta.data import ImageFolderDataModule
from frolic_tta.data.store import (
    MANIFEST,
    FeatureDataset,
    FeatureStoreError,
    check_key,
    load_store,
    samples_fingerprint,
    write_manifest,
    write_shard,
)
from frolic_tta.lightning.cli import main
from tests.conftest import IMAGE_FOLDER_CLASSES, IMAGES_PER_CLASS
from tests.test_cli import run_train, tiny_args

N = len(IMAGE_FOLDER_CLASSES) * IMAGES_PER_CLASS
QUIET = ("--report.plots", "false", "--trainer.enable_progress_bar", "false")


def store_args(tiny_clip, folder: Path, out: Path, store: Path | None, *extra: str) -> list[str]:
    args = tiny_args(tiny_clip, folder, out, *QUIET, *extra)
    return args + (["--data.feature_store", str(store)] if store is not None else [])


def read_run(out: Path) -> tuple[dict, dict]:
    metrics = json.loads((out / "metrics.json").read_text())
    return metrics, torch.load(out / "logits.pt", weights_only=True)


@pytest.fixture
def encoder_calls(monkeypatch):
    """Images through the image tower's forward (open_clip's VisionTransformer), per run."""
    calls: list[int] = []
    forward = open_clip.transformer.VisionTransformer.forward

    def counting(self, x, *args, **kwargs):
        calls.append(x.shape[0])
        return forward(self, x, *args, **kwargs)

    monkeypatch.setattr(open_clip.transformer.VisionTransformer, "forward", counting)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield calls
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ddp_store(tiny_clip, image_folder, tmp_path_factory):
    """A store written by a 2-process DDP run of train.py (and that run's outputs)."""
    root = tmp_path_factory.mktemp("ddp_store")
    store, out = root / "store", root / "out"
    two = ("--trainer.devices", "2", "--trainer.strategy", "ddp")
    result = run_train(store_args(tiny_clip, image_folder, out, store, *two))
    assert result.returncode == 0, result.stderr[-3000:]
    return store, out


def test_store_written_by_two_processes_is_read_by_one(
    ddp_store, tiny_clip, image_folder, tmp_path, encoder_calls
):
    store, ddp_out = ddp_store
    manifest = json.loads((store / MANIFEST).read_text())
    assert manifest["written_by"]["world_size"] == 2 and len(manifest["shards"]) == 2
    assert manifest["num_samples"] == N and manifest["dtype"] == "float32"
    ddp_metrics, ddp_logits = read_run(ddp_out)
    assert ddp_metrics["images_encoded"] == N  # summed over both ranks
    assert ddp_metrics["features"] == f"encoded, stored in {store} (float32)"
    main(store_args(tiny_clip, image_folder, tmp_path, store, "--trainer.devices", "1"))
    assert encoder_calls == []  # the image encoder never ran
    metrics, logits = read_run(tmp_path)
    assert metrics["images_encoded"] == 0 and metrics["moments_from_store"]  # 2 ranks' sums
    assert metrics["features"].startswith(f"feature store {store} ({N} x 32 float32, written by 2")
    assert torch.equal(logits["index"], torch.arange(N))
    assert torch.equal(logits["prediction"], ddp_logits["prediction"])
    assert torch.equal(logits["target"], ddp_logits["target"])
    # the same features: 1 and 2 processes differ only in the order of float64 sums
    torch.testing.assert_close(logits["logits"], ddp_logits["logits"], rtol=1e-5, atol=1e-5)
    assert metrics["accuracy"] == pytest.approx(ddp_metrics["accuracy"], abs=1e-6)


def test_refit_from_the_store_equals_a_run_without_it(
    tiny_clip, image_folder, tmp_path, encoder_calls
):
    store = tmp_path / "store"
    runs = {}
    for name, folder in (("plain", None), ("write", store), ("refit", store)):
        encoder_calls.clear()
        main(store_args(tiny_clip, image_folder, tmp_path / name, folder))
        runs[name] = (*read_run(tmp_path / name), sum(encoder_calls))
    assert [runs[name][2] for name in runs] == [N, N, 0]  # images through the encoder
    assert [runs[name][0]["images_encoded"] for name in runs] == [N, N, 0]
    plain = runs["plain"][1]
    for name in ("write", "refit"):
        for key in ("logits", "prediction", "confidence", "target"):
            assert torch.equal(runs[name][1][key], plain[key]), (name, key)
        assert runs[name][0]["accuracy"] == runs["plain"][0]["accuracy"]
        assert runs[name][0]["tau_g"] == runs["plain"][0]["tau_g"]
    assert [runs[name][0]["moments_from_store"] for name in runs] == [False, False, True]
    assert runs["plain"][0]["features"] == "encoded"


def test_a_store_of_other_features_is_refused(
    tiny_clip, image_folder, tmp_path, encoder_calls, capsys
):
    store = tmp_path / "store"
    main(store_args(tiny_clip, image_folder, tmp_path / "all", store))
    stored = json.loads((store / MANIFEST).read_text())["key"]["samples"]
    capsys.readouterr()
    encoder_calls.clear()
    with pytest.raises(SystemExit) as exit_info:
        main(store_args(tiny_clip, image_folder, tmp_path / "twelve", store, "--data.limit", "12"))
    assert exit_info.value.code == 2 and encoder_calls == []
    ours = samples_fingerprint(ImageFolderDataModule(str(image_folder), limit=12).paths)
    expected = (
        f"error: Expected the feature store in '{store}' to match this run, but it was written "
        f"for other features (limit: this run 12, the store None; num_samples: this run 12, the "
        f"store {N}; samples: this run {ours[:45]}..., the store {stored[:45]}...): delete it, "
        "or pass --data.feature_store_mode write to encode again and replace it\n"
    )
    assert capsys.readouterr().err == expected
    # write mode encodes again and replaces the store
    twelve = ("--data.limit", "12", "--data.feature_store_mode", "write")
    main(store_args(tiny_clip, image_folder, tmp_path / "twelve", store, *twelve))
    assert sum(encoder_calls) == 12
    assert json.loads((store / MANIFEST).read_text())["num_samples"] == 12
    assert sorted(p.name for p in store.iterdir()) == ["features_rank0.pt", MANIFEST, "moments.pt"]


# ---------------------------------------------------------------- the store functions
KEY = {"format": 1, "model_name": "m", "dataset": "d", "num_samples": 10}


def write_three_ranks(folder: Path, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """10 samples over 3 uneven ranks (indices r, r + 3, ...: Lightning's predict sampler)."""
    g = torch.Generator().manual_seed(0)
    features = torch.randn(10, 6, generator=g)
    features = features / features.norm(dim=1, keepdim=True)
    labels = torch.arange(10) % 4
    for rank in range(3):
        index = torch.arange(rank, 10, 3)
        write_shard(folder, rank, index, features[index].to(dtype), labels[index], key=KEY)
    write_manifest(folder, KEY, world_size=3)
    return features, labels


def test_shards_of_any_world_size_are_joined_by_global_index(tmp_path):
    features, labels = write_three_ranks(tmp_path)
    stored = load_store(tmp_path, KEY)
    assert torch.equal(stored.features, features) and torch.equal(stored.labels, labels)
    assert stored.manifest["written_by"]["world_size"] == 3
    half = tmp_path / "half"
    write_three_ranks(half, torch.float16)
    small = load_store(half, KEY)
    torch.testing.assert_close(small.features, features, rtol=0, atol=2e-3)
    torch.testing.assert_close(small.features.norm(dim=1), torch.ones(10), rtol=0, atol=1e-6)
    assert small.manifest["dtype"] == "float16"


def test_another_key_is_refused_naming_what_differs(tmp_path):
    with pytest.raises(FeatureStoreError) as info:
        check_key({**KEY, "dataset": "dtd", "extra": 1}, KEY, tmp_path)
    assert str(info.value) == (
        f"Expected the feature store in '{tmp_path}' to match this run, but it was written for "
        "other features (dataset: this run d, the store dtd; extra: this run None, the store 1): "
        "delete it, or pass --data.feature_store_mode write to encode again and replace it"
    )
    check_key(dict(KEY), KEY, tmp_path)  # equal: no error


def test_missing_changed_or_incomplete_shards_are_refused(tmp_path):
    write_three_ranks(tmp_path)
    shard = tmp_path / "features_rank1.pt"
    original = shard.read_bytes()
    shard.unlink()
    with pytest.raises(FeatureStoreError, match=r"^Expected shard 'features_rank1.pt' in the "):
        load_store(tmp_path, KEY)
    shard.write_bytes(original[:-10] + b"0123456789")
    with pytest.raises(FeatureStoreError, match="but its size or SHA-256 differs"):
        load_store(tmp_path, KEY)
    shard.write_bytes(original[:100])
    with pytest.raises(FeatureStoreError, match="Expected a readable shard 'features_rank1.pt'"):
        load_store(tmp_path, KEY, verify=False)
    shard.write_bytes(original)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    manifest["shards"] = manifest["shards"][:2]  # rank 2's samples are not listed
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(FeatureStoreError, match=r"Expected 10 samples in .* its shards hold 7"):
        load_store(tmp_path, KEY)
    manifest["shards"].append(manifest["shards"][0])  # rank 0's indices twice
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(FeatureStoreError, match="repeats one or is out of range"):
        load_store(tmp_path, KEY)
    with pytest.raises(FeatureStoreError, match=r"but there is no manifest.json: run once"):
        load_store(tmp_path / "nothing", KEY)


def test_unreadable_samples_and_partial_runs(tmp_path):
    features = torch.nn.functional.normalize(torch.randn(4, 3), dim=1)
    reasons = ["", "unreadable image: OSError: truncated", "", ""]
    key = {**KEY, "num_samples": 4}
    labels = torch.tensor([0, -1, 1, 0])
    write_shard(tmp_path, 0, torch.arange(4), features, labels, reasons, key=key)
    write_manifest(tmp_path, key, world_size=1)
    stored = load_store(tmp_path, key)
    assert stored.errors == reasons  # a refit skips the same samples as the run that encoded
    item = FeatureDataset(stored.features, stored.labels, stored.errors)[1]
    assert item["error"] == reasons[1] and item["label"] == -1
    write_shard(tmp_path, 0, torch.arange(4), features, key={**KEY, "num_samples": 9})
    with pytest.raises(FeatureStoreError) as info:  # e.g. limit_predict_batches
        write_manifest(tmp_path, {**KEY, "num_samples": 9}, world_size=1)
    assert str(info.value) == (
        f"Expected the shards in '{tmp_path}' to hold all 9 samples, but they hold 4 (a run "
        "over part of the data writes no feature store)"
    )
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    manifest["num_samples"] = 3  # a manifest that contradicts its own key
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(FeatureStoreError, match=r"Expected 4 samples in .*, but its manifest.json"):
        load_store(tmp_path, key)
