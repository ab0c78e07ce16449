"""Stored features gathered per batch give exactly the batches of one item per sample."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Subset, default_collate

from frolic_tta.data import ImageFolderDataModule
from frolic_tta.data.feature_dataset import FeatureDataset, StoredBatch, collate_stored


def dataset(labels: bool, errors: bool) -> FeatureDataset:
    features = torch.nn.functional.normalize(torch.randn(11, 5, dtype=torch.float32), dim=1)
    label = torch.randint(0, 3, (11,)) if labels else None
    error = [f"unreadable {i}" if i % 4 == 1 else "" for i in range(11)] if errors else None
    return FeatureDataset(features, label, error)


def same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == b[key].dtype and torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


@pytest.mark.parametrize("labels, errors", [(True, True), (True, False), (False, False)])
def test_gathered_batches_equal_per_sample_batches(labels, errors):
    data = dataset(labels, errors)
    for source in (data, Subset(data, [10, 3, 4, 0, 7, 1, 2])):
        by_item = [
            default_collate([source[i] for i in range(s, min(s + 4, len(source)))])
            for s in range(0, len(source), 4)
        ]
        gathered = list(DataLoader(source, batch_size=4, collate_fn=collate_stored))
        collated = list(DataLoader(source, batch_size=4))  # default_collate of a StoredBatch
        assert len(by_item) == len(gathered) == len(collated)
        for a, b, c in zip(by_item, gathered, collated, strict=True):
            same(a, b)
            same(a, c)


def test_stored_batch_is_the_sequence_of_its_samples():
    data = dataset(True, True)
    batch = data.__getitems__([5, 2, 9])
    assert isinstance(batch, StoredBatch) and len(batch) == 3
    for position, index in enumerate([5, 2, 9]):
        item, expected = batch[position], data[index]
        assert item.keys() == expected.keys() and item["index"] == index
        assert torch.equal(item["features"], expected["features"])
        assert (item["label"], item["error"]) == (expected["label"], expected["error"])
    assert batch[-1]["index"] == 9
    with pytest.raises(IndexError, match="sample 3 of a batch of 3"):
        batch[3]


def test_feature_batch_size_is_checked(image_folder):
    with pytest.raises(ValueError, match="^feature_batch_size must be a positive integer, got 0$"):
        ImageFolderDataModule(str(image_folder), feature_batch_size=0)
    assert ImageFolderDataModule(str(image_folder)).feature_batch_size == 2048
