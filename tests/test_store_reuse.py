"""Stored features are never stale or foreign: a changed image changes the key, two writers never
mix, and a manifest cannot point outside its store."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from frolic_tta.data.store import (
    MANIFEST,
    FeatureStoreError,
    load_store,
    samples_fingerprint,
    write_manifest,
    write_shard,
)
from frolic_tta.lightning.adaptation import FrolicAdaptation
from frolic_tta.lightning.batch import FrolicBatch
from frolic_tta.lightning.cli import main
from frolic_tta.lightning.store import FeatureStoreWriter
from tests.test_store import encoder_calls, read_run, store_args  # noqa: F401

KEY = {"format": 2, "model_name": "m", "num_samples": 4}


def bmp_folder(root: Path, seed: int) -> Path:
    """3 classes x 3 uncompressed 32x32 BMPs: every file has the same size whatever it shows."""
    rng = np.random.default_rng(seed)
    for kind in range(3):
        (root / f"class_{kind}").mkdir(parents=True, exist_ok=True)
        for i in range(3):
            pixels = rng.integers(0, 255, size=(32, 32, 3), dtype=np.uint8)
            pixels[..., kind] = 220
            Image.fromarray(pixels).save(root / f"class_{kind}" / f"img_{i}.bmp")
    return root


def test_images_replaced_by_files_of_the_same_size_are_not_reused(
    tiny_clip,
    tmp_path,
    encoder_calls,  # noqa: F811
    capsys,
):
    # issue 16, found 4: the key hashed paths and sizes only, so the old features were reused
    folder, store = bmp_folder(tmp_path / "images", seed=0), tmp_path / "store"
    sizes = {p: p.stat().st_size for p in folder.rglob("*.bmp")}
    main(store_args(tiny_clip, folder, tmp_path / "first", store))
    first, first_logits = read_run(tmp_path / "first")
    bmp_folder(folder, seed=1)  # other pictures, same names and sizes
    assert {p: p.stat().st_size for p in folder.rglob("*.bmp")} == sizes
    with pytest.raises(SystemExit) as info:
        main(store_args(tiny_clip, folder, tmp_path / "second", store))
    assert info.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"error: Expected the feature store in '{store}' to match this run, ")
    assert "(samples: this run " in err
    encoder_calls.clear()
    write = ("--data.feature_store_mode", "write")
    main(store_args(tiny_clip, folder, tmp_path / "second", store, *write))
    second, second_logits = read_run(tmp_path / "second")
    assert second["features"].startswith("encoded, stored in") and sum(encoder_calls) == 9
    assert not torch.allclose(first_logits["logits"], second_logits["logits"])


def test_full_hash_mode_sees_a_rewrite_that_keeps_size_and_time(tmp_path):
    paths = [tmp_path / f"{i}.bin" for i in range(3)]
    for i, path in enumerate(paths):
        path.write_bytes(bytes([i]) * 64)
    names = [str(p) for p in paths]
    quick, full = samples_fingerprint(names), samples_fingerprint(names, verify=True)
    stat = paths[1].stat()
    paths[1].write_bytes(bytes([9]) * 64)
    assert samples_fingerprint(names) != quick  # a new modification time
    os.utime(paths[1], ns=(stat.st_atime_ns, stat.st_mtime_ns))  # `touch -r`: the old time
    assert samples_fingerprint(names) == quick  # the documented limit of the quick rule
    assert samples_fingerprint(names, verify=True) != full


def fake_trainer() -> SimpleNamespace:
    strategy = SimpleNamespace(barrier=lambda *a: None, broadcast=lambda obj, src=0: obj)
    return SimpleNamespace(
        is_global_zero=True,
        global_rank=0,
        world_size=1,
        precision="32-true",
        accelerator=object(),
        strategy=strategy,
        callbacks=[FrolicAdaptation(torch.eye(8))],  # never started: no moments to add
    )


def read_batch(features: torch.Tensor) -> FrolicBatch:
    """A batch as the adaptation hands it to the store writer."""
    index, labels = torch.arange(4), torch.tensor([0, 1, 0, 1])
    return FrolicBatch({}, features, index, torch.ones(4, dtype=torch.bool), labels, None, True)


def test_two_runs_writing_one_store_never_mix(tmp_path):
    # issue 16, found 5: two runs interleaved in one store; its manifest vouched for the other
    # run's shard and a later run used the wrong features
    store = tmp_path / "store"
    runs = {}
    for name in ("a", "b"):
        features = torch.nn.functional.normalize(torch.randn(4, 8), dim=1)
        writer = FeatureStoreWriter(str(store), {**KEY, "run": name})
        runs[name] = (writer, features, fake_trainer())
    for writer, _, trainer in runs.values():  # both start before either finishes
        writer.on_predict_start(trainer, None)
    for writer, features, trainer in runs.values():
        writer.on_adaptation_batch(trainer, trainer.callbacks[0], read_batch(features))
    runs["a"][0].on_predict_epoch_end(runs["a"][2], None)
    stored = load_store(store, {**KEY, "run": "a"})
    torch.testing.assert_close(stored.features, runs["a"][1])
    runs["b"][0].on_predict_epoch_end(runs["b"][2], None)
    stored = load_store(store, {**KEY, "run": "b"})  # b's features, whole, under b's key
    torch.testing.assert_close(stored.features, runs["b"][1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]  # no private folder left
    with pytest.raises(FeatureStoreError, match="run: this run a, the store b"):
        load_store(store, {**KEY, "run": "a"})


def test_a_manifest_shard_outside_the_store_is_refused(tmp_path):
    store = tmp_path / "store"
    features = torch.nn.functional.normalize(torch.randn(4, 3), dim=1)
    write_shard(store, 0, torch.arange(4), features, key=KEY)
    write_manifest(store, KEY, world_size=1)
    shutil.copy(store / "features_rank0.pt", tmp_path / "elsewhere.pt")
    manifest = json.loads((store / MANIFEST).read_text())
    manifest["shards"][0]["file"] = "../elsewhere.pt"
    (store / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(FeatureStoreError) as info:
        load_store(store, KEY)
    assert str(info.value) == (
        f"Expected the shards listed in the manifest.json of the feature store '{store}' to be "
        "files inside it, but it lists '../elsewhere.pt': delete the store and encode again"
    )


def test_interleaved_writers_of_one_folder_never_vouch_for_each_other(tmp_path):
    # issue 37: A's shard, B's shard, B's manifest, A's manifest in one folder. A's manifest
    # hashed the shard that was there, B's, and a read with A's key returned B's features
    store = tmp_path / "store"
    features = {name: torch.nn.functional.normalize(torch.randn(4, 8), dim=1) for name in "ab"}
    keys = {name: {**KEY, "run": name} for name in "ab"}
    write_shard(store, 0, torch.arange(4), features["a"], key=keys["a"])
    write_shard(store, 0, torch.arange(4), features["b"], key=keys["b"])
    write_manifest(store, keys["b"], world_size=1)
    with pytest.raises(FeatureStoreError) as info:  # A's manifest: a shard it did not write
        write_manifest(store, keys["a"], world_size=1)
    assert str(info.value) == (
        f"Expected shard 'features_rank0.pt' in '{store}' to be written by this run, but it "
        "holds the features of another (run: this run a, the shard b): two runs wrote one "
        "store folder at once; write it again"
    )
    for verify in (True, False):  # A's key: A's features or an error, never B's
        with pytest.raises(FeatureStoreError, match="run: this run a, the store b"):
            load_store(store, keys["a"], verify=verify)
    torch.testing.assert_close(load_store(store, keys["b"]).features, features["b"])
    write_shard(store, 0, torch.arange(4), features["a"], key=keys["a"])  # after B's manifest
    for verify in (True, False):  # B's manifest over A's shard: refused, also unverified
        with pytest.raises(FeatureStoreError, match="'features_rank0.pt'"):
            load_store(store, keys["b"], verify=verify)
