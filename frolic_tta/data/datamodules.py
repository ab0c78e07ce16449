"""Lightning datamodules that feed the Frolic module ``{"image", "index"[, "label"]}`` batches.

Class names are computed in ``__init__`` (so the CLI can link ``data.class_names`` to
``model.class_names``); the image transform is resolved in :meth:`setup`: the ``preprocess``
argument if given, else the attached LightningModule's ``.preprocess`` (open_clip's eval
transform on ``FrolicModule``).

**Feature store** (``feature_store=DIR``, :mod:`frolic_tta.data.store`): :meth:`setup` computes
the key of the features this run would encode (the module's model and weights, the transform,
the dataset, split, ``limit`` and file list). If ``DIR`` holds a store with that key, batches
are ``{"features", "index"[, "label"]}`` read from it (no image is decoded, the encoder does not
run); if it holds none, the images are encoded as usual and :attr:`store_request` says which
store to write: ``FrolicModule.configure_callbacks`` registers a ``FeatureStoreWriter`` that
writes it (data does not know the model's callbacks). A store with another key, or a broken
one, raises :class:`~frolic_tta.data.store.FeatureStoreError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision.datasets import ImageFolder

from frolic_tta.data.class_names import labelled_class_names
from frolic_tta.data.datasets import canonical_dataset_name, clean_class_name
from frolic_tta.data.feature_dataset import FeatureDataset, collate_stored
from frolic_tta.data.indexed import (
    DataDescription,
    DatasetNotFoundError,
    IndexedDataset,
    UnlabeledImageFolder,
    check_class_names,
    dataset_paths,
)
from frolic_tta.data.loaders import check_samples_per_rank, default_num_workers
from frolic_tta.data.splits import load_dataset
from frolic_tta.data.store import DTYPES, feature_key, has_manifest, load_store

__all__ = [
    "STORE_MODES",
    "FrolicDataModule",
    "ImageFolderDataModule",
    "StoreRequest",
    "default_num_workers",
]

STORE_MODES = ("auto", "read", "write")
"""``auto``: read the store if there is one, else encode and write it; ``read``: the store must
exist; ``write``: encode and replace it."""
StoreDtype = Literal["float32", "float16"]
StoreMode = Literal["auto", "read", "write"]
ClassNames = list[str] | dict[str, str] | None
FEATURE_BATCH_SIZE = 2048
"""Default ``feature_batch_size``: stored features per batch. No encoder runs on them, so a
small batch only adds per-batch overhead (the largest temporary is a (rows, K) float64 product)."""


@dataclass(frozen=True)
class StoreRequest:
    """The feature store a datamodule asks to be written from this run's encoded features."""

    directory: Path
    key: dict[str, Any]  # :func:`~frolic_tta.data.store.feature_key`
    dtype: str  # "float32" or "float16"


class _IndexedDataModule(L.LightningDataModule):
    """Shared loader logic: limit, transform resolution, feature store, predict/test loaders.

    Args:
        batch_size: Images per batch.
        num_workers: DataLoader worker processes; ``None``: what the machine's CPUs allow
            (:func:`default_num_workers`).
        limit: Keep only this many samples (a seeded random subset, in order).
        preprocess: Image transform; default: the LightningModule's ``.preprocess``.
        class_names: For unlabelled images, the class names (a list). For labelled data, the
            words of its classes: a list naming them (in any order; they keep the data's order
            and labels) or a mapping ``{class: words}``; names of other classes are refused
            (:mod:`frolic_tta.data.class_names`).
        feature_store: Folder of a feature store: read it when it holds this run's features,
            else encode and write it (see the module docstring).
        feature_store_dtype: ``"float32"`` or ``"float16"`` (half the size) for a new store.
        feature_store_mode: ``"auto"``, ``"read"`` (the store must exist) or ``"write"``
            (encode and replace it).
        feature_store_verify: key the store by every image's content (SHA-256) instead of
            its size and modification time (:mod:`frolic_tta.data.store_key`).
        feature_batch_size: Stored features per batch when the store is read (no encoder runs:
            large batches keep Lightning's per-batch overhead out of a refit).
    """

    dataset_name: str = "custom"  #: the dataset's name in the report (set by subclasses)
    split_source: str | None = None  #: which split, in words (``None``: not known)

    def __init__(
        self,
        batch_size: int = 64,
        num_workers: int | None = None,
        limit: int | None = None,
        preprocess: Callable[[Any], Any] | None = None,
        class_names: ClassNames = None,
        feature_store: str | None = None,
        feature_store_dtype: StoreDtype = "float32",
        feature_store_mode: StoreMode = "auto",
        feature_store_verify: bool = False,
        feature_batch_size: int = FEATURE_BATCH_SIZE,
    ) -> None:
        super().__init__()
        if feature_store_dtype not in DTYPES:
            raise ValueError(
                f"Expected `feature_store_dtype` to be one of {list(DTYPES)}, but got "
                f"{feature_store_dtype!r}"
            )
        if feature_store_mode not in STORE_MODES:
            raise ValueError(
                f"Expected `feature_store_mode` to be one of {list(STORE_MODES)}, but got "
                f"{feature_store_mode!r}"
            )
        self.feature_store = feature_store
        self.feature_store_dtype = feature_store_dtype
        self.feature_store_mode = feature_store_mode
        self.feature_store_verify = bool(feature_store_verify)
        #: Where the features come from, in words (``metrics.json``'s ``"features"``).
        self.feature_source = "encoded"
        self._limit = limit
        #: Set by :meth:`setup`: the store to write from this run (``None``: none, or read).
        self.store_request: StoreRequest | None = None
        for name, size in (("batch_size", batch_size), ("feature_batch_size", feature_batch_size)):
            if size < 1:
                raise ValueError(f"{name} must be a positive integer, got {size}")
        self.feature_batch_size = feature_batch_size
        if num_workers is not None and num_workers < 0:
            raise ValueError(f"num_workers must be >= 0 or None (automatic), got {num_workers}")
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be a positive integer or None, got {limit}")
        self.batch_size, self.num_workers, self.preprocess = batch_size, num_workers, preprocess
        #: The class names: the user's ``class_names`` until a subclass sets its source (a
        #: mapping ``{class: words}`` is resolved against the data's classes there).
        mapping = isinstance(class_names, Mapping)
        self.class_names = class_names if mapping else check_class_names(class_names)
        self.dataset: IndexedDataset | None = None

    def _set_source(self, source: Dataset, class_names: list[str] | None, labeled: bool) -> None:
        """The samples (``limit`` applied), their class names and whether they are labelled."""
        self.source = self._apply_limit(source, self._limit)
        self.class_names = check_class_names(class_names)
        #: Whether batches carry a ``"label"`` entry.
        self.labeled = labeled

    @staticmethod
    def _apply_limit(source: Dataset, limit: int | None) -> Dataset:
        """Keep a seeded random subset of ``limit`` samples, in their original order."""
        n = len(source)  # type: ignore[arg-type]
        if limit is None or limit >= n:
            return source
        generator = torch.Generator().manual_seed(0)
        keep = torch.randperm(n, generator=generator)[:limit].sort().values
        return Subset(source, keep.tolist())

    @property
    def num_classes(self) -> int | None:
        """Number of classes, when the class names are known."""
        return None if self.class_names is None else len(self.class_names)

    @property
    def paths(self) -> list[str] | None:
        """File path of each ``batch["index"]``, when known."""
        return dataset_paths(self.source)

    def describe(self) -> DataDescription:
        """What the report says about these data (:class:`~frolic_tta.data.DescribesData`)."""
        names = (self.dataset_name, self.split_source, self.feature_source)
        return DataDescription(*names, self.paths)

    def _resolve_transform(self) -> Callable[[Any], Any]:
        if self.preprocess is not None:
            return self.preprocess
        module = getattr(getattr(self, "trainer", None), "lightning_module", None)
        transform = getattr(module, "preprocess", None)
        if transform is None:
            raise ValueError(
                "no image transform: expected `preprocess=` on the datamodule or a Trainer whose "
                "LightningModule has a `.preprocess` transform; got neither"
            )
        return transform

    def setup(self, stage: str | None = None) -> None:
        """Wrap the source dataset with the resolved image transform, or read the feature store.

        Raises:
            FeatureStoreError: ``feature_store`` holds a store of other features or a broken
                one, or (``feature_store_mode="read"``) none.
        """
        transform = self._resolve_transform()
        self.dataset = IndexedDataset(self.source, transform)
        self.store_request = None
        if self.feature_store is not None:
            self._setup_store(transform)

    def _setup_store(self, transform: Callable[[Any], Any]) -> None:
        module = getattr(getattr(self, "trainer", None), "lightning_module", None)
        hparams = getattr(module, "hparams", {})
        if "model_name" not in hparams:
            raise ValueError(
                "Expected a Trainer with a FrolicModule (`model_name`, `pretrained` hparams) "
                f"for `feature_store`, but got {type(module).__name__}"
            )
        key = feature_key(
            hparams["model_name"],
            hparams.get("pretrained"),
            transform,
            self.dataset_name,
            self.split_source,
            self._limit,
            len(self.source),  # type: ignore[arg-type]
            self.paths,
            verify=self.feature_store_verify,
        )
        folder = Path(self.feature_store)  # type: ignore[arg-type]
        mode = self.feature_store_mode
        if mode == "read" or (mode == "auto" and has_manifest(folder)):
            s = load_store(folder, key)
            self.dataset = FeatureDataset(s.features, s.labels, s.errors, s.moments)  # type: ignore[assignment]
            self.feature_source = s.describe(folder)
            return
        self.store_request = StoreRequest(folder, key, self.feature_store_dtype)
        self.feature_source = f"encoded, stored in {folder} ({self.feature_store_dtype})"

    def predict_dataloader(self) -> DataLoader:
        """Deterministic (unshuffled) loader over the whole source (or its stored features).

        Raises:
            FrolicInputError: fewer samples than processes (Lightning's predict sampler needs at
                least one per rank); decided on the same numbers on every rank.
        """
        if self.dataset is None:
            self.setup("predict")
        trainer = getattr(self, "trainer", None)
        world_size = int(getattr(trainer, "world_size", 1) or 1)
        check_samples_per_rank(len(self.source), world_size)  # type: ignore[arg-type]
        workers = self.num_workers
        if workers is None:
            workers = default_num_workers(int(getattr(trainer, "num_devices", 1) or 1))
        stored = isinstance(self.dataset, FeatureDataset)  # no encoder: gathered, large batches
        return DataLoader(
            self.dataset,  # type: ignore[arg-type]
            batch_size=self.feature_batch_size if stored else self.batch_size,
            shuffle=False,
            num_workers=0 if stored else workers,
            collate_fn=collate_stored if stored else None,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=False,
        )

    def test_dataloader(self) -> DataLoader:
        """Same loader as :meth:`predict_dataloader`."""
        return self.predict_dataloader()


def override_class_names(
    class_names: Sequence[str] | Mapping[str, str] | None,
    names: list[str],
    source: str,
    aliases: Sequence[Sequence[str]] = (),
) -> list[str]:
    """The class names of a labelled source, spelled as the user's ``class_names`` give them:
    :func:`~frolic_tta.data.class_names.labelled_class_names` (names match classes by name, in
    any order, or map each class to its words; never a renaming by position)."""
    return labelled_class_names(class_names, names, source, aliases)


def _folder_source(
    root: str, labeled: bool, class_names: ClassNames
) -> tuple[Dataset, list[str] | None]:
    if not labeled:
        return UnlabeledImageFolder(root), class_names
    try:
        source = ImageFolder(root)
    except FileNotFoundError as exc:
        raise DatasetNotFoundError(
            f"image folder '{root}': {exc} Point --data.root at a folder with one sub-folder per "
            "class, or, for images without class folders, pass --data.labeled false with "
            "--data.class_names '[cat, dog, bird]'."
        ) from None
    names = [clean_class_name(c) for c in source.classes]
    where = f"the class folders of '{root}'"
    return source, override_class_names(class_names, names, where, [source.classes])


class FrolicDataModule(_IndexedDataModule):
    """One of the paper's datasets (or a user folder) for test-time adaptation.

    Args:
        dataset: Dataset key or alias (``"dtd"``, ``"imagenet_a"``, ...; see
            ``frolic_tta.data.DATASETS``), ``"folder"`` (a labelled ImageFolder at ``root``) or
            ``"unlabeled"`` (every image under ``root``, no labels).
        root: Folder holding the datasets (or the folder itself for ``folder``/``unlabeled``).
        split: Dataset split (``"test"`` by default; ImageNet's ``"val"``).
        download: Let torchvision download missing data where it can.
        split_file: CoOp-style split JSON; when given, its ``split`` entries are used. Without
            it, CoOp's ``split_zhou_<Name>.json`` is used when it sits in the dataset's folder
            under ``root`` (see ``frolic_tta.data.splits``; ``split="all"`` skips it).
        image_dir: Folder the split file's paths are relative to (default: the file's folder).
        **kwargs: the loader and feature-store options of every Frolic datamodule (batch
            size, workers, ``limit``, ``preprocess``, ``class_names``, ``feature_store``, ...).
    """

    def __init__(
        self,
        dataset: str,
        root: str = "data",
        split: str = "test",
        download: bool = False,
        split_file: str | None = None,
        image_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        key = str(dataset).strip().lower()
        if key in ("folder", "unlabeled"):
            source, names = _folder_source(root, key == "folder", self.class_names)
            split_source = "all images"
        else:
            key = canonical_dataset_name(dataset)  # type: ignore[assignment]
            loaded = load_dataset(key, root, split, download, split_file, image_dir)
            source, split_source = loaded.dataset, loaded.split_source
            names = override_class_names(self.class_names, loaded.class_names, f"dataset {key!r}")
        self._set_source(source, names, labeled=key != "unlabeled")
        self.dataset_name = key
        #: Which images were used, in words (written to ``metrics.json`` as ``"split"``).
        self.split_source = split_source


class ImageFolderDataModule(_IndexedDataModule):
    """A user's image folder: one sub-folder per class (``labeled=True``) or any layout.

    Args:
        root: The folder.
        labeled: ``True``: ``torchvision.datasets.ImageFolder`` (labels and class names from
            the sub-folders); ``False``: every image under ``root``, without labels.
        **kwargs: the loader and feature-store options of every Frolic datamodule (batch
            size, workers, ``limit``, ``preprocess``, ``class_names``, ``feature_store``, ...).
    """

    def __init__(self, root: str, labeled: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        source, names = _folder_source(root, labeled, self.class_names)
        self._set_source(source, names, labeled)
        self.dataset_name = "folder" if labeled else "unlabeled"
        #: Which images were used, in words (written to ``metrics.json`` as ``"split"``).
        self.split_source = "all images"
