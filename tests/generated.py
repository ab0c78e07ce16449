"""Generated, deterministic image datasets for module tests (importable by subprocess scripts)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

CLASS_NAMES = ["red square", "green circle", "blue stripes"]


class GeneratedImages(Dataset):
    """``n`` seeded 3x32x32 images, class ``i % 3`` with a class-specific channel offset.

    Items are ``(image, label)`` (or bare images with ``labeled=False``); the same index always
    gives the same image, in any process. The image of ``nan_index`` holds a NaN pixel (the
    encoder then gives NaN features for it).
    """

    def __init__(
        self,
        n: int,
        size: int = 32,
        labeled: bool = True,
        seed: int = 0,
        nan_index: int | None = None,
    ) -> None:
        self.n, self.size, self.labeled, self.seed = n, size, labeled, seed
        self.nan_index = nan_index

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        g = torch.Generator().manual_seed(self.seed * 100_003 + index)
        label = index % len(CLASS_NAMES)
        image = 0.5 * torch.randn(3, self.size, self.size, generator=g)
        image[label] += 1.0
        if index == self.nan_index:
            image[0, 0, 0] = float("nan")
        return (image, label) if self.labeled else image
