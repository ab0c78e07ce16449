"""Dataset wrappers that produce the batch contract of the Frolic LightningModule.

Every item the module sees is a dict ``{"image": Tensor, "index": int, "error": str}`` plus
``"label": int`` when the source is labelled; ``index`` is the position of the sample in the
wrapped dataset, so per-sample outputs can be matched back to files (see :func:`dataset_paths`).

**Unreadable files.** A file that cannot be read or decoded (missing, truncated, not an image)
does not stop a long run: :class:`IndexedDataset` returns a blank placeholder of the right shape
with ``"error"`` set to the reason (``""`` for a good sample) and ``"label"`` -1, and
:class:`~frolic_tta.FrolicModule` leaves it out of the adaptation and reports it.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from PIL import Image
from torch.utils.data import Dataset, Subset
from torchvision.datasets.folder import IMG_EXTENSIONS, default_loader

__all__ = [
    "UNREADABLE_ERRORS",
    "DatasetNotFoundError",
    "IndexedDataset",
    "SplitFileDataset",
    "UnlabeledImageFolder",
    "check_class_names",
    "dataset_paths",
]

UNREADABLE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,  # missing file, PIL's UnidentifiedImageError, "image file is truncated"
    SyntaxError,  # PIL: "broken PNG file", "not a TIFF file"
    EOFError,
    ValueError,  # PIL: "Decompressed Data Too Large", "tile cannot extend outside image"
    Image.DecompressionBombError,
    zlib.error,
    struct.error,
)
"""What reading and decoding one image may raise for a bad *file* (not for a bad program)."""

_PROBES = 16  # neighbours tried for the shape of a placeholder


class DatasetNotFoundError(FileNotFoundError):
    """Raised when the files of a dataset are not where they were looked for."""


def check_class_names(class_names: Any, name: str = "class_names") -> list[str] | None:
    """``class_names`` as a new list of strings, or ``None``.

    Raises:
        TypeError: a single string (``"catdog"`` would be six classes) or anything but a list
            (or tuple) of strings.
    """
    if class_names is None:
        return None
    if isinstance(class_names, str) or not isinstance(class_names, list | tuple):
        raise TypeError(
            f"Expected `{name}` to be a list of class names such as ['cat', 'dog'], but got "
            f"{type(class_names).__name__} {class_names!r:.80}"
        )
    wrong = [c for c in class_names if not isinstance(c, str)]
    if wrong:
        raise TypeError(
            f"Expected `{name}` to hold strings, but got {type(wrong[0]).__name__} {wrong[0]!r:.40}"
        )
    return list(class_names)


def _blank_like(image: Any) -> Any:
    """A black image of the same shape and type (tensor or PIL image)."""
    if isinstance(image, torch.Tensor):
        return torch.zeros_like(image)
    if isinstance(image, Image.Image):
        return Image.new(image.mode, image.size)
    raise TypeError(f"Expected a tensor or PIL image to copy the shape of, but got {type(image)}")


class IndexedDataset(Dataset):
    """Wrap a map-style dataset so that items become ``{"image", "index", "error"[, "label"]}``.

    Args:
        dataset: Any map-style dataset whose items are ``(image, label)`` pairs or bare images.
            A pair whose label is ``None`` counts as unlabelled: its ``"label"`` is -1, so that
            a batch of labelled and unlabelled pairs collates (every item has the same keys).
        transform: Applied to the image (e.g. open_clip's eval preprocess); ``None`` keeps it.
        skip_unreadable: When loading or transforming an item raises one of
            :data:`UNREADABLE_ERRORS`, return a blank placeholder (the shape of a readable
            neighbour) with ``"error"`` = the reason and ``"label"`` = -1, instead of raising.
    """

    def __init__(
        self,
        dataset: Dataset,
        transform: Callable[[Any], Any] | None = None,
        skip_unreadable: bool = True,
    ) -> None:
        self.dataset = dataset
        self.transform = transform
        self.skip_unreadable = skip_unreadable
        self._paths: list[str] | None = None

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def _load(self, index: int) -> tuple[Any, Any]:
        """``(transformed image, label)`` of one item: ``None`` for a bare image, -1 for a pair
        whose label is ``None``; raises what loading raises."""
        item = self.dataset[index]
        label = None
        if isinstance(item, tuple | list):
            if len(item) != 2:
                raise TypeError(
                    f"expected dataset items to be an image or an (image, label) pair, "
                    f"got a {type(item).__name__} of length {len(item)} at index {index}"
                )
            item, label = item
            label = -1 if label is None else label
        return (self.transform(item) if self.transform is not None else item), label

    def __getitem__(self, index: int) -> dict[str, Any]:
        try:
            image, label = self._load(index)
        except UNREADABLE_ERRORS as error:
            if not self.skip_unreadable:
                raise
            return self._placeholder(index, error)
        out: dict[str, Any] = {"image": image, "index": int(index), "error": ""}
        if label is not None:
            out["label"] = int(label)
        return out

    def _placeholder(self, index: int, error: BaseException) -> dict[str, Any]:
        """A blank item flagged with the reason; its shape and keys come from a neighbour."""
        reason = f"unreadable image: {type(error).__name__}: {error}".strip()
        path = self._path(index)
        if path is not None and path not in reason:
            reason += f" ({path})"
        n = len(self)
        for offset in range(1, min(n, _PROBES + 1)):
            try:
                image, label = self._load((index + offset) % n)
            except UNREADABLE_ERRORS:
                continue
            out: dict[str, Any] = {"image": _blank_like(image), "index": int(index)}
            out["error"] = reason
            if label is not None:
                out["label"] = -1
            return out
        raise RuntimeError(
            f"sample {index} is unreadable ({reason}) and so are its {min(n - 1, _PROBES)} "
            "neighbours: check the dataset's files"
        ) from error

    def _path(self, index: int) -> str | None:
        if self._paths is None:
            self._paths = dataset_paths(self.dataset) or []
        return self._paths[index] if index < len(self._paths) else None

    @property
    def paths(self) -> list[str] | None:
        """Per-index file paths of the wrapped dataset, when they can be known."""
        return dataset_paths(self.dataset)


def _check_dir(root: str | os.PathLike[str], what: str, option: str = "--data.root") -> Path:
    path = Path(root).expanduser()
    if not path.is_dir():
        raise DatasetNotFoundError(
            f"{what}: no folder at '{path}'. Point {option} at the folder that holds the images."
        )
    return path


class UnlabeledImageFolder(Dataset):
    """Every image file under a folder (recursively, sorted by path), without labels.

    Args:
        root: Folder to scan.
        extensions: Accepted file suffixes (case-insensitive); torchvision's image extensions by
            default.
        loader: Turns a path into an image; torchvision's default loader (PIL, RGB) by default.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        extensions: Sequence[str] = IMG_EXTENSIONS,
        loader: Callable[[str], Any] = default_loader,
    ) -> None:
        self.root = _check_dir(root, "unlabeled image folder")
        suffixes = tuple(e.lower() for e in extensions)
        files = (p for p in self.root.rglob("*") if p.name.lower().endswith(suffixes))
        self.paths: list[str] = sorted(str(p) for p in files if p.is_file())
        if not self.paths:
            raise DatasetNotFoundError(
                f"unlabeled image folder: no files ending in {list(suffixes)} under '{self.root}'"
            )
        self.loader = loader

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Image.Image:
        return self.loader(self.paths[index])


class SplitFileDataset(Dataset):
    """Images listed in a CoOp-style split file.

    The file is JSON ``{"train": [[relpath, label, classname], ...], "val": [...], "test": [...]}``.
    Class names are collected from every split of the file (labels must be ``0..K-1``, each with
    one name) so that ``K`` does not depend on which classes the chosen split happens to contain.

    Args:
        split_file: Path of the JSON file.
        image_dir: Folder the relative paths are resolved against; the split file's folder by
            default.
        split: Which list of the file to use.
        loader: Turns a path into an image.
    """

    def __init__(
        self,
        split_file: str | os.PathLike[str],
        image_dir: str | os.PathLike[str] | None = None,
        split: str = "test",
        loader: Callable[[str], Any] = default_loader,
    ) -> None:
        path = Path(split_file).expanduser()
        if not path.is_file():
            raise DatasetNotFoundError(f"split file not found: '{path}' (--data.split_file)")
        with path.open() as f:
            content = json.load(f)
        if not isinstance(content, dict) or split not in content:
            keys = sorted(content) if isinstance(content, dict) else type(content).__name__
            raise ValueError(
                f"split file '{path}' must be a JSON object with a {split!r} list; got {keys}"
            )
        names: dict[int, str] = {}
        for key, entries in content.items():
            for entry in entries:
                if not (isinstance(entry, list | tuple) and len(entry) == 3):
                    raise ValueError(
                        f"split file '{path}', {key!r}: expected [relpath, label, classname] "
                        f"entries, got {entry!r}"
                    )
                label, name = int(entry[1]), str(entry[2])
                if names.setdefault(label, name) != name:
                    raise ValueError(
                        f"split file '{path}': label {label} has two class names, "
                        f"{names[label]!r} and {name!r}"
                    )
        if sorted(names) != list(range(len(names))):
            missing = sorted(set(range(max(names, default=-1) + 1)) - set(names))
            raise ValueError(f"split file '{path}': labels must be 0..K-1; missing {missing[:10]}")
        self.classes = [names[i].replace("_", " ") for i in range(len(names))]
        base = _check_dir(
            path.parent if image_dir is None else image_dir, "split-file images", "--data.image_dir"
        )
        self.samples = [(str(base / rel), int(label)) for rel, label, _ in content[split]]
        if self.samples and not Path(self.samples[0][0]).is_file():
            raise DatasetNotFoundError(
                f"split file '{path}': image '{self.samples[0][0]}' does not exist; pass the "
                f"folder the paths are relative to as --data.image_dir"
            )
        self.loader = loader

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        file, label = self.samples[index]
        return self.loader(file), label


def dataset_paths(dataset: Any) -> list[str] | None:
    """Per-index file paths of a dataset, or ``None`` when they cannot be known.

    Understands ``Subset``/``IndexedDataset`` wrappers, ``ImageFolder``-like ``samples``, a
    ``paths`` list, and the file lists of torchvision's dataset classes.
    """
    if isinstance(dataset, Subset):
        inner = dataset_paths(dataset.dataset)
        return None if inner is None else [inner[i] for i in dataset.indices]
    if isinstance(dataset, IndexedDataset):
        return dataset_paths(dataset.dataset)
    paths = getattr(dataset, "paths", None)
    if isinstance(paths, list):
        return [str(p) for p in paths]
    for attr in ("samples", "_samples"):  # ImageFolder, StanfordCars: [(path, label), ...]
        samples = getattr(dataset, attr, None)
        if isinstance(samples, list) and (not samples or isinstance(samples[0], tuple)):
            return [str(s[0]) for s in samples]
    for attr in ("_image_files", "_images"):  # DTD, Food101, Flowers102, Aircraft, SUN397, Pets
        files = getattr(dataset, attr, None)
        if isinstance(files, list):
            return [str(p) for p in files]
    if all(hasattr(dataset, a) for a in ("categories", "index", "y", "root")):  # Caltech101
        return [
            os.path.join(
                dataset.root, "101_ObjectCategories", dataset.categories[y], f"image_{i:04d}.jpg"
            )
            for i, y in zip(dataset.index, dataset.y, strict=True)
        ]
    return None


@dataclass(frozen=True)
class DataDescription:
    """What a run's report says about its data (``metrics.json``'s ``"dataset"``, ``"split"``
    and ``"features"``, ``predictions.csv``'s paths).

    Attributes:
        dataset_name: the dataset's name (``"custom"`` when not known).
        split_source: which split, in words (``None``: not known).
        feature_source: where the features come from, in words.
        paths: file path of each ``batch["index"]`` (``None``: read from the dataset).
    """

    dataset_name: str = "custom"
    split_source: str | None = None
    feature_source: str = "encoded"
    paths: list[str] | None = None


@runtime_checkable
class DescribesData(Protocol):
    """A datamodule that describes its data to the report (the package's datamodules do; a
    user's own ``LightningDataModule`` need not: its data are then ``"custom"``)."""

    def describe(self) -> DataDescription:
        """The :class:`DataDescription` of the data set up for this run."""
        ...
