"""Stored features as predict batches: one gather per batch instead of one item per sample.

A DataLoader with a batch size asks a map-style dataset for a whole batch through
``__getitems__`` when it has one (``torch.utils.data``'s fetcher). :class:`FeatureDataset` answers
with a :class:`StoredBatch`: the batch already gathered (one index into the feature tensor), which
:func:`collate_stored` hands on as it is. Any other collate function still sees a sequence of
per-sample dicts (built on demand), so ``default_collate`` gives the same batch, only slower.

Shapes: N samples, d embedding dim, n samples in a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, default_collate

from frolic_tta.data.store_moments import StoredMoments


class StoredBatch(Sequence):
    """A gathered batch ``{"features" (n, d), "index" (n,)[, "label" (n,), "error" [n]]}`` that
    is also the sequence of its samples (each a dict as ``FeatureDataset[i]`` returns)."""

    def __init__(self, batch: dict[str, Any]) -> None:
        self.batch = batch

    def __len__(self) -> int:
        return int(self.batch["index"].shape[0])

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} of a batch of {len(self)}")
        item = {k: v[i] for k, v in self.batch.items()}
        return {k: int(v) if k in ("index", "label") else v for k, v in item.items()}


def collate_stored(batch: Any) -> Any:
    """A :class:`StoredBatch` as it is (already one batch); anything else by ``default_collate``."""
    return batch.batch if isinstance(batch, StoredBatch) else default_collate(batch)


class FeatureDataset(Dataset):
    """Stored features as FrolicModule batches: ``{"features", "index"[, "label", "error"]}``.

    ``FrolicModule.predict_step`` uses ``features`` instead of running the image encoder. Give
    its DataLoader ``collate_fn=collate_stored`` (the datamodules do) to skip per-sample work.

    Args:
        features: ``(N, d)`` features in global index order.
        labels: ``(N,)`` labels or ``None``.
        errors: ``N`` reasons a sample's image could not be read (``""``: read), or ``None``.
        moments: the store's moment sums (``StoredFeatures.moments``): a ``FrolicModule``
            predicting over this dataset skips their pass where they are for its prototypes.
    """

    def __init__(
        self,
        features: Tensor,
        labels: Tensor | None = None,
        errors: list[str] | None = None,
        moments: StoredMoments | None = None,
    ) -> None:
        self.features, self.labels, self.errors = features, labels, errors
        self.moments = moments

    def __len__(self) -> int:
        return self.features.shape[0]

    def __getitem__(self, index: int) -> dict[str, Any]:
        item: dict[str, Any] = {"features": self.features[index], "index": int(index)}
        if self.labels is not None:
            item["label"] = int(self.labels[index])
        if self.errors is not None:
            item["error"] = self.errors[index]
        return item

    def __getitems__(self, indices: list[int]) -> StoredBatch:
        """The samples ``indices`` gathered at once (what ``FeatureDataset[i]`` gives each)."""
        index = torch.as_tensor(indices, dtype=torch.long)
        batch: dict[str, Any] = {"features": self.features[index], "index": index}
        if self.labels is not None:
            batch["label"] = self.labels[index].long()
        if self.errors is not None:
            batch["error"] = [self.errors[i] for i in indices]
        return StoredBatch(batch)
