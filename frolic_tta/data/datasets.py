"""Registry of the datasets evaluated in the Frolic paper: where their files are, their class names.

Torchvision datasets are built with torchvision's own classes (and its download logic); the
ImageNet variants (:mod:`frolic_tta.data.imagenet`), UCF101 frames and ObjectNet are read with
``torchvision.datasets.ImageFolder`` (sub)classes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torchvision.datasets as tvd
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES
from torch.utils.data import Dataset

from frolic_tta.data.imagenet import (
    ImageNetV2Folder,
    WnidImageFolder,
    imagenet_class_names,
    imagenet_wnids,
    metadata,
)
from frolic_tta.data.indexed import DatasetNotFoundError, SplitFileDataset
from frolic_tta.errors import warn

__all__ = [
    "DATASETS",
    "DatasetSpec",
    "build_dataset",
    "build_split_file_dataset",
    "canonical_dataset_name",
    "clean_class_name",
]


def clean_class_name(name: str) -> str:
    """Turn a folder-style class name into words.

    ``"apple_pie"`` -> ``"apple pie"``, ``"apartment_building/outdoor"`` ->
    ``"apartment building outdoor"``, ``"ApplyEyeMakeup"`` -> ``"Apply Eye Makeup"``.
    """
    name = name.strip().strip("/")
    if not re.search(r"[\s_/]", name):
        name = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", name)
    return re.sub(r"[\s_/]+", " ", name).strip()


_MISSING = re.compile(r"dataset not found|not present in the root", re.IGNORECASE)

Builder = Callable[[Path, str, bool], tuple[Dataset, list[str]]]


@dataclass(frozen=True)
class DatasetSpec:
    """How to build one dataset.

    Attributes:
        key: Registry key (also the key of :data:`frolic_tta.clip.DATASET_TEMPLATES`).
        title: Human-readable name, used in messages.
        build: ``(root, split, download) -> (dataset, class_names)``.
        location: Where the files are expected, relative to ``root`` (for error messages).
        note: Appended to ``location`` in error messages.
        splits: Accepted ``split`` values, or None when the source has no official splits.
        downloadable: Whether torchvision can download it.
    """

    key: str
    title: str
    build: Builder
    location: tuple[str, ...]
    splits: tuple[str, ...] | None = ("test",)
    downloadable: bool = True
    note: str = ""


def _names(key: str) -> Any:
    return metadata()["class_names"][key]


def _imagenet(root: Path, split: str, download: bool) -> tuple[Dataset, list[str]]:
    ds = tvd.ImageNet(str(root / "imagenet"), split="train" if split == "train" else "val")
    index = {w: i for i, w in enumerate(imagenet_wnids())}
    return ds, [IMAGENET_CLASSNAMES[index[w]] for w in ds.wnids]


def _caltech(root: Path, split: str, download: bool) -> tuple[Dataset, list[str]]:
    ds = tvd.Caltech101(str(root), download=download)
    return ds, [_names("caltech101").get(c, clean_class_name(c)) for c in ds.categories]


def _eurosat(root: Path, split: str, download: bool) -> tuple[Dataset, list[str]]:
    ds = tvd.EuroSAT(str(root), download=download)
    return ds, [_names("eurosat").get(c, clean_class_name(c)) for c in ds.classes]


def _tv(
    cls: Any, names: Callable[[Any], list[str]], has_split: bool = True, **split_map: str
) -> Builder:
    def build(root: Path, split: str, download: bool) -> tuple[Dataset, list[str]]:
        kwargs: dict[str, Any] = {"split": split_map.get(split, split)} if has_split else {}
        if cls is not tvd.StanfordCars:  # its download() always raises: the URL is gone
            kwargs["download"] = download
        ds = cls(str(root), **kwargs)
        return ds, names(ds)

    return build


def _folder(
    candidates: tuple[str, ...], make: Callable[[Path], tuple[Dataset, list[str]]]
) -> Builder:
    def build(root: Path, split: str, download: bool) -> tuple[Dataset, list[str]]:
        for candidate in candidates:
            if (root / candidate).is_dir():
                return make(root / candidate)
        raise FileNotFoundError(f"none of {list(candidates)} under '{root}'")

    return build


def _wnid_folder(subset: bool) -> Callable[[Path], tuple[Dataset, list[str]]]:
    def make(path: Path) -> tuple[Dataset, list[str]]:
        ds = WnidImageFolder(path, subset=subset)
        return ds, ds.class_names

    return make


def _plain_folder(path: Path) -> tuple[Dataset, list[str]]:
    ds = tvd.ImageFolder(str(path))
    return ds, [clean_class_name(c) for c in ds.classes]


def _v2_folder(path: Path) -> tuple[Dataset, list[str]]:
    return ImageNetV2Folder(str(path)), imagenet_class_names()


def _folder_spec(
    key: str, title: str, candidates: tuple[str, ...], make: Callable[[Path], Any]
) -> DatasetSpec:
    return DatasetSpec(key, title, _folder(candidates, make), candidates, None, False)


_CLEAN = lambda ds: [clean_class_name(c) for c in ds.classes]  # noqa: E731
_AS_IS = lambda ds: list(ds.classes)  # noqa: E731
_FLOWERS = lambda ds: list(_names("flowers102"))  # noqa: E731
_TRAIN_VAL_TEST = ("train", "val", "test")
_SPECS = [
    DatasetSpec("dtd", "DTD", _tv(tvd.DTD, _AS_IS), ("dtd/dtd",), _TRAIN_VAL_TEST),
    DatasetSpec("eurosat", "EuroSAT", _eurosat, ("eurosat/2750",), None),
    DatasetSpec(
        "flowers102",
        "Flowers102",
        _tv(tvd.Flowers102, _FLOWERS),
        ("flowers-102",),
        _TRAIN_VAL_TEST,
    ),
    DatasetSpec("food101", "Food101", _tv(tvd.Food101, _CLEAN), ("food-101",), ("train", "test")),
    DatasetSpec(
        "oxford_pets",
        "Oxford-IIIT Pet",
        _tv(tvd.OxfordIIITPet, _AS_IS, train="trainval"),
        ("oxford-iiit-pet",),
        ("train", "trainval", "test"),
    ),
    DatasetSpec(
        "stanford_cars",
        "Stanford Cars",
        _tv(tvd.StanfordCars, _AS_IS),
        ("stanford_cars",),
        ("train", "test"),
        downloadable=False,
        note=" (with devkit/, cars_test/ and cars_test_annos_withlabels.mat)",
    ),
    DatasetSpec(
        "fgvc_aircraft",
        "FGVC-Aircraft",
        _tv(tvd.FGVCAircraft, _AS_IS),
        ("fgvc-aircraft-2013b",),
        ("train", "val", "trainval", "test"),
    ),
    DatasetSpec("caltech101", "Caltech101", _caltech, ("caltech101/101_ObjectCategories",), None),
    DatasetSpec("sun397", "SUN397", _tv(tvd.SUN397, _CLEAN, has_split=False), ("SUN397",), None),
    DatasetSpec(
        "imagenet",
        "ImageNet",
        _imagenet,
        ("imagenet",),
        ("train", "val", "test"),
        downloadable=False,
        note=" (ILSVRC2012_devkit_t12.tar.gz and ILSVRC2012_img_val.tar, or meta.bin and val/)",
    ),
    _folder_spec(
        "ucf101",
        "UCF101 (middle frames)",
        ("ucf101/UCF-101-midframes", "UCF-101-midframes", "ucf101"),
        _plain_folder,
    ),
    _folder_spec(
        "imagenet_v2",
        "ImageNet-V2",
        (
            "imagenetv2/imagenetv2-matched-frequency-format-val",
            "imagenetv2-matched-frequency-format-val",
            "imagenet_v2",
            "imagenetv2",
        ),
        _v2_folder,
    ),
    _folder_spec(
        "imagenet_sketch",
        "ImageNet-Sketch",
        (
            "imagenet-sketch/images",
            "imagenet-sketch/sketch",
            "imagenet-sketch",
            "sketch",
            "imagenet_sketch",
        ),
        _wnid_folder(subset=False),
    ),
    _folder_spec(
        "imagenet_a",
        "ImageNet-A",
        ("imagenet-adversarial/imagenet-a", "imagenet-a", "imagenet_a"),
        _wnid_folder(subset=True),
    ),
    _folder_spec(
        "imagenet_r",
        "ImageNet-R",
        ("imagenet-rendition/imagenet-r", "imagenet-r", "imagenet_r"),
        _wnid_folder(subset=True),
    ),
    _folder_spec(
        "objectnet",
        "ObjectNet",
        ("objectnet-1.0/images", "objectnet/images", "objectnet"),
        _plain_folder,
    ),
]
#: Registry of the supported datasets, by key.
DATASETS: dict[str, DatasetSpec] = {spec.key: spec for spec in _SPECS}

_ALIASES = {
    "pets": "oxford_pets",
    "oxfordiiitpet": "oxford_pets",
    "flowers": "flowers102",
    "oxford_flowers": "flowers102",
    "cars": "stanford_cars",
    "aircraft": "fgvc_aircraft",
    "food": "food101",
    "caltech": "caltech101",
    "sun": "sun397",
    "ucf": "ucf101",
    "describabletextures": "dtd",
    "imagenet_adversarial": "imagenet_a",
    "imagenet_rendition": "imagenet_r",
}


def canonical_dataset_name(name: str, strict: bool = True) -> str | None:
    """Map a dataset name or alias (``"ImageNet-A"``, ``"OxfordPets"``, ``"cars"``) to its key.

    Args:
        name: The name to look up (case, ``-``, ``_`` and spaces do not matter).
        strict: Raise ``ValueError`` for an unknown name instead of returning ``None``.
    """
    norm = re.sub(r"[\s\-]+", "_", str(name).strip().lower())
    squashed = norm.replace("_", "")
    for key in DATASETS:
        if squashed == key.replace("_", ""):
            return key
    key = _ALIASES.get(norm) or _ALIASES.get(squashed)
    if key is None and strict:
        raise ValueError(f"unknown dataset {name!r}; expected one of {sorted(DATASETS)}")
    return key


def _not_found(
    spec: DatasetSpec, path: Path, download: bool, exc: Exception
) -> DatasetNotFoundError:
    where = " or ".join(f"'{path / loc}'" for loc in spec.location) + spec.note
    if download:
        problem = f"could not be downloaded to {where} ({type(exc).__name__}: {exc})"
        fix = f"Download it by hand so that it is there, and pass --data.root '{path}'."
    else:
        problem = f"not found: looked for {where}"
        fix = "Put the files there or point --data.root at the folder that holds them"
        fix += (
            ", or pass --data.download true to let torchvision download them."
            if spec.downloadable
            else f" ({spec.title} cannot be downloaded automatically)."
        )
    return DatasetNotFoundError(f"{spec.title} (dataset {spec.key!r}) {problem}. {fix}")


def _remove_if_empty(folders: list[Path]) -> None:
    """Remove the folders a failed download created (``folders``, deepest first) if no file."""
    for folder in folders:
        if folder.is_dir() and not any(p.is_file() for p in folder.rglob("*")):
            for sub in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                sub.rmdir()
            folder.rmdir()


def build_dataset(
    name: str, root: str | os.PathLike[str] = "data", split: str = "test", download: bool = False
) -> tuple[Dataset, list[str]]:
    """Build one of the paper's datasets and its class names.

    Args:
        name: Dataset key or alias (see :data:`DATASETS`).
        root: Folder that holds the datasets (torchvision's ``root``).
        split: Which split; ``"test"`` maps to ImageNet's ``"val"``. Sources without official
            splits (EuroSAT, Caltech101, SUN397 in torchvision, and the folder-based sets) use
            every image; :func:`frolic_tta.data.load_dataset` uses CoOp's standard splits.
        download: Let torchvision download it when missing (where torchvision can).

    Returns:
        ``(dataset, class_names)``; the dataset yields ``(PIL image, label)`` pairs.

    Raises:
        DatasetNotFoundError: The files are not there (or the download failed).
        ValueError: Unknown dataset or split.
    """
    spec = DATASETS[canonical_dataset_name(name)]  # type: ignore[index]
    if spec.splits is not None and split not in spec.splits:
        raise ValueError(
            f"split for {spec.key!r} must be one of {list(spec.splits)}, got {split!r}"
        )
    path = Path(root).expanduser()
    download = download and spec.downloadable
    tops = sorted({path / Path(location).parts[0] for location in spec.location})
    folders = [p for p in (*tops, path) if download and not p.exists()]
    try:
        dataset, class_names = spec.build(path, split, download)
    except DatasetNotFoundError:
        raise
    except RuntimeError as exc:
        if not _MISSING.search(str(exc)):
            raise
        _remove_if_empty(folders)
        raise _not_found(spec, path, download, exc) from None
    except OSError as exc:  # FileNotFoundError from folders, URLError from failed downloads
        _remove_if_empty(folders)
        raise _not_found(spec, path, download, exc) from None
    if spec.splits is None and split != "all":
        warn(
            f"{spec.title} has no official {split!r} split here; using all {len(dataset)} "
            f"images (pass --data.split_file with a CoOp split JSON for the standard split)",
        )
    return dataset, class_names


def build_split_file_dataset(
    split_file: str | os.PathLike[str],
    image_dir: str | os.PathLike[str] | None = None,
    split: str = "test",
) -> tuple[SplitFileDataset, list[str]]:
    """Build a dataset from a CoOp-style split JSON (see :class:`SplitFileDataset`)."""
    dataset = SplitFileDataset(split_file, image_dir=image_dir, split=split)
    return dataset, list(dataset.classes)
