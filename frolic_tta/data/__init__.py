"""Datasets, dataset wrappers and Lightning datamodules for Frolic test-time adaptation."""

from frolic_tta.data.datamodules import FrolicDataModule, ImageFolderDataModule
from frolic_tta.data.datasets import (
    DATASETS,
    DatasetSpec,
    build_dataset,
    build_split_file_dataset,
    canonical_dataset_name,
    clean_class_name,
)
from frolic_tta.data.imagenet import (
    ImageNetV2Folder,
    WnidImageFolder,
    imagenet_class_names,
    imagenet_wnids,
)
from frolic_tta.data.indexed import (
    DataDescription,
    DatasetNotFoundError,
    DescribesData,
    IndexedDataset,
    SplitFileDataset,
    UnlabeledImageFolder,
    dataset_paths,
)
from frolic_tta.data.splits import (
    STANDARD_SPLITS,
    LoadedDataset,
    StandardSplit,
    find_standard_split,
    load_dataset,
)

__all__ = [
    "DATASETS",
    "DataDescription",
    "DatasetNotFoundError",
    "DescribesData",
    "DatasetSpec",
    "LoadedDataset",
    "FrolicDataModule",
    "ImageFolderDataModule",
    "ImageNetV2Folder",
    "IndexedDataset",
    "STANDARD_SPLITS",
    "SplitFileDataset",
    "StandardSplit",
    "UnlabeledImageFolder",
    "WnidImageFolder",
    "build_dataset",
    "build_split_file_dataset",
    "canonical_dataset_name",
    "clean_class_name",
    "dataset_paths",
    "find_standard_split",
    "imagenet_class_names",
    "imagenet_wnids",
    "load_dataset",
]
