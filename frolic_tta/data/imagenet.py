"""ImageNet metadata (wnids, CLIP class names) and the folder layouts of its variants.

ImageNet-V2 names its class folders ``0``..``999``; ImageNet-A/-R/-Sketch name them by WordNet id.
Both are :class:`torchvision.datasets.ImageFolder` subclasses that map folder names to
ImageNet's label space.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import torchvision.datasets as tvd
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

__all__ = ["ImageNetV2Folder", "WnidImageFolder", "imagenet_class_names", "imagenet_wnids"]

_METADATA = Path(__file__).with_name("metadata.json")


@lru_cache(maxsize=1)
def metadata() -> dict[str, Any]:
    """The package's dataset metadata: cleaned class names per dataset, ImageNet wnids."""
    with _METADATA.open(encoding="utf-8") as f:
        return json.load(f)


def imagenet_wnids() -> list[str]:
    """The 1000 ILSVRC2012 WordNet ids in class-index order (sorted)."""
    return list(metadata()["imagenet_wnids"])


def imagenet_class_names() -> list[str]:
    """open_clip's (CLIP's) cleaned ImageNet class names, in class-index order."""
    return list(IMAGENET_CLASSNAMES)


class ImageNetV2Folder(tvd.ImageFolder):
    """ImageNet-V2 layout: class folders named ``"0"`` .. ``"999"`` after the ImageNet index.

    Folders are ordered numerically (``"10"`` after ``"9"``) and each image's label is its
    folder's number, i.e. its ImageNet class index.
    """

    def find_classes(self, directory: str | os.PathLike[str]) -> tuple[list[str], dict[str, int]]:
        names = [e.name for e in os.scandir(directory) if e.is_dir()]
        bad = [n for n in names if not n.isdigit() or int(n) >= 1000]
        if bad:
            raise ValueError(
                f"ImageNet-V2 folder '{directory}': expected class folders named 0..999, "
                f"got {sorted(bad)[:5]}"
            )
        classes = sorted(names, key=int)
        return classes, {c: int(c) for c in classes}


class WnidImageFolder(tvd.ImageFolder):
    """Class folders named by ImageNet WordNet ids (ImageNet-A/-R/-Sketch layouts).

    Args:
        root: The folder holding one sub-folder per wnid.
        subset: If True (ImageNet-A/-R), the classes are the wnids present, in ImageNet order,
            labelled ``0..len-1``; if False (ImageNet-Sketch), labels are ImageNet indices and
            :attr:`class_names` has all 1000 names.
        **kwargs: Passed to ``ImageFolder``.
    """

    def __init__(self, root: str | os.PathLike[str], subset: bool = True, **kwargs: Any) -> None:
        self.subset = subset
        self._index = {w: i for i, w in enumerate(imagenet_wnids())}
        super().__init__(root, **kwargs)

    def find_classes(self, directory: str | os.PathLike[str]) -> tuple[list[str], dict[str, int]]:
        wnids = sorted(e.name for e in os.scandir(directory) if e.is_dir())
        unknown = [w for w in wnids if w not in self._index]
        if unknown:
            raise ValueError(
                f"'{directory}': expected class folders named by ImageNet wnids "
                f"(e.g. n01443537), got {unknown[:5]}"
            )
        if self.subset:
            return wnids, {w: i for i, w in enumerate(wnids)}
        return wnids, {w: self._index[w] for w in wnids}

    @property
    def class_names(self) -> list[str]:
        """CLIP class names, aligned with the labels this dataset returns."""
        if self.subset:
            return [IMAGENET_CLASSNAMES[self._index[w]] for w in self.classes]
        return imagenet_class_names()
