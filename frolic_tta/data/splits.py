"""The standard test splits: CoOp's ``split_zhou_<Name>.json`` files, found where they sit.

CoOp (Zhou et al., "Learning to Prompt for Vision-Language Models"; its ``DATASETS.md``) fixed
train/val/test splits for nine of the paper's datasets and published them as JSON files that
live in each dataset's folder. :func:`load_dataset` uses such a file when it is there (CoOp's
folder layout or the torchvision layout this package reads), else the dataset's own split (or
all of its images), and says which in :attr:`LoadedDataset.split_source`. FGVC-Aircraft and
ImageNet come with official test files of their own (read by torchvision); the ImageNet
variants and ObjectNet are whole test sets.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from torch.utils.data import Dataset

from frolic_tta.data.datasets import DATASETS, build_dataset, canonical_dataset_name
from frolic_tta.data.indexed import DatasetNotFoundError, SplitFileDataset
from frolic_tta.errors import warn

__all__ = [
    "STANDARD_SPLITS",
    "LoadedDataset",
    "StandardSplit",
    "find_standard_split",
    "load_dataset",
]

COOP_DATASETS_URL = "https://github.com/KaiyangZhou/CoOp/blob/main/DATASETS.md"
"""Where CoOp says how to get its split files (Google Drive links, one per dataset)."""


@dataclass(frozen=True)
class StandardSplit:
    """Where CoOp's split file of one dataset may sit and what its paths are relative to.

    Attributes:
        file: The file name, e.g. ``"split_zhou_EuroSAT.json"``.
        folders: Folders under ``root`` that may hold the file, CoOp's layout first.
        image_dirs: Folders under ``root`` the file's relative image paths may start from; the
            first that holds the file's first image is used.
    """

    file: str
    folders: tuple[str, ...]
    image_dirs: tuple[str, ...]


def _split(name: str, pairs: tuple[tuple[str, str], ...]) -> StandardSplit:
    folders = tuple(dict.fromkeys(folder for folder, _ in pairs))
    images = tuple(os.path.normpath(f"{folder}/{sub}") for folder, sub in pairs)
    return StandardSplit(f"split_zhou_{name}.json", folders, images)


#: CoOp's split file of each dataset that has one: ``(folder, image folder inside it)`` pairs,
#: CoOp's ``DATASETS.md`` layout first, then the torchvision layout of :data:`DATASETS`.
STANDARD_SPLITS: dict[str, StandardSplit] = {
    "caltech101": _split(
        "Caltech101",
        (("caltech-101", "101_ObjectCategories"), ("caltech101", "101_ObjectCategories")),
    ),
    "oxford_pets": _split("OxfordPets", (("oxford_pets", "images"), ("oxford-iiit-pet", "images"))),
    "stanford_cars": _split("StanfordCars", (("stanford_cars", "."),)),
    "flowers102": _split("OxfordFlowers", (("oxford_flowers", "jpg"), ("flowers-102", "jpg"))),
    "food101": _split("Food101", (("food-101", "images"),)),
    "sun397": _split("SUN397", (("sun397", "SUN397"), ("SUN397", "."))),
    "dtd": _split("DescribableTextures", (("dtd", "images"), ("dtd/dtd", "images"))),
    "eurosat": _split("EuroSAT", (("eurosat", "2750"),)),
    "ucf101": _split(
        "UCF101", (("ucf101", "UCF-101-midframes"), ("UCF-101-midframes", "."), ("ucf101", "."))
    ),
}


def _first_image(split_file: Path) -> str | None:
    """The first relative image path listed in the file (any split), if it can be read."""
    try:
        content = json.loads(split_file.read_text(encoding="utf-8"))
        for entries in content.values():
            if entries:
                return str(entries[0][0])
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None  # SplitFileDataset reports what is wrong with the file
    return None


def find_standard_split(
    dataset: str, root: str | os.PathLike[str] = "data"
) -> tuple[Path, Path] | None:
    """Find CoOp's split file of ``dataset`` under ``root`` and the folder its paths start from.

    Args:
        dataset: Dataset key or alias.
        root: Folder that holds the datasets (``--data.root``).

    Returns:
        ``(split_file, image_dir)``, or ``None`` when the dataset has no standard split file or
        none of :attr:`StandardSplit.folders` holds it.

    Raises:
        DatasetNotFoundError: The file is there but its first image is in none of the
            :attr:`StandardSplit.image_dirs`.
    """
    spec = STANDARD_SPLITS.get(canonical_dataset_name(dataset))  # type: ignore[arg-type]
    if spec is None:
        return None
    base = Path(root).expanduser()
    found = [base / folder / spec.file for folder in spec.folders]
    split_file = next((path for path in found if path.is_file()), None)
    if split_file is None:
        return None
    first = _first_image(split_file)
    candidates = [base / d for d in spec.image_dirs]
    for image_dir in candidates:
        if first is None or (image_dir / first).is_file():
            return split_file, image_dir
    tried = ", ".join(f"'{d}'" for d in candidates)
    raise DatasetNotFoundError(
        f"split file '{split_file}' lists '{first}', which is in none of {tried}; put the "
        f"images there (see docs/cli.md) or pass --data.split_file and --data.image_dir"
    )


@dataclass(frozen=True)
class LoadedDataset:
    """A dataset, its class names, and which split of it this is.

    Attributes:
        dataset: Yields ``(PIL image, label)`` pairs.
        class_names: The ``K`` class names.
        split_source: What was used, in words: ``"split_zhou_EuroSAT.json (test)"``,
            ``"official test split"``, ``"all images (no standard split found)"``, ...
    """

    dataset: Dataset
    class_names: list[str]
    split_source: str


def load_dataset(
    name: str,
    root: str | os.PathLike[str] = "data",
    split: str = "test",
    download: bool = False,
    split_file: str | os.PathLike[str] | None = None,
    image_dir: str | os.PathLike[str] | None = None,
) -> LoadedDataset:
    """Load one of the paper's datasets on its standard split when there is one.

    In order: ``split_file`` when given (its ``split`` list, paths relative to ``image_dir``);
    else CoOp's split file of the dataset when :func:`find_standard_split` finds it under
    ``root`` (``split="all"`` skips it); else :func:`~frolic_tta.data.build_dataset`, i.e. the
    dataset's official split or, for sources without one, every image with a warning.

    Args:
        name: Dataset key or alias.
        root: Folder that holds the datasets.
        split: ``"test"``, ``"train"``, ``"val"`` (a split file's lists) or ``"all"``.
        download: Let torchvision download missing data where it can.
        split_file: An explicit CoOp-style split JSON.
        image_dir: Folder the explicit split file's paths are relative to.

    Returns:
        The :class:`LoadedDataset`.
    """
    key: str = canonical_dataset_name(name)  # type: ignore[assignment]
    if split_file is not None:
        dataset = SplitFileDataset(split_file, image_dir=image_dir, split=split)
        source = f"{Path(split_file).name} ({split}, --data.split_file)"
        return LoadedDataset(dataset, list(dataset.classes), source)
    standard = STANDARD_SPLITS.get(key)
    found = find_standard_split(key, root) if split != "all" else None
    if found is not None:
        dataset = SplitFileDataset(found[0], image_dir=found[1], split=split)
        return LoadedDataset(dataset, list(dataset.classes), f"{found[0].name} ({split})")
    spec = DATASETS[key]
    if spec.splits is not None:
        dataset, names = build_dataset(key, root, split=split, download=download)
        source = f"official {split} split"
        if standard is not None:
            source += f" ({standard.file} not found)"
        return LoadedDataset(dataset, names, source)
    if standard is None or split == "all":  # whole test sets (ImageNet variants, ObjectNet)
        dataset, names = build_dataset(key, root, split=split, download=download)
        return LoadedDataset(dataset, names, "all images")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # replaced by the warning below
        dataset, names = build_dataset(key, root, split="all", download=download)
    where = " or ".join(f"'{Path(root) / folder}'" for folder in standard.folders)
    warn(
        f"{spec.title}: no standard {split!r} split found (looked for {standard.file} in "
        f"{where}); using all {len(dataset)} images. CoOp's DATASETS.md ({COOP_DATASETS_URL}) "
        f"links the file; put it in that folder, or pass --data.split_file.",
    )
    return LoadedDataset(dataset, names, "all images (no standard split found)")
